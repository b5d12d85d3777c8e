"""Multi-LoRA: PEFT adapters, slot memory pool, batch info and layer wrappers."""
