"""Llama, Qwen2, Qwen3 dense and Qwen3-MoE forward passes with a KV cache."""
