"""loraplane worker: a PyTorch + Triton multi-LoRA inference runtime and its HTTP server."""
