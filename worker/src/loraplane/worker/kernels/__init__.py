"""Segmented multi-LoRA kernels: Triton implementations and their torch references.

``from loraplane.worker.kernels import reference`` never imports Triton. The Triton functions
are loaded lazily on first attribute access (``kernels.lora_shrink``), so a caller (tests, the
worker's backend selection) can set ``TRITON_INTERPRET=1`` before Triton is imported: Triton
decides between compiled and interpreted kernels when ``@triton.jit`` runs, at module import.
See ``docs/kernels.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ExpertLoRA",
    "MoeLoraRouting",
    "PendingLoRA",
    "decode_attention",
    "extend_attention",
    "lora_apply",
    "lora_apply_shrink",
    "lora_expand",
    "lora_shrink",
    "moe_combine",
    "moe_expert_routing",
    "moe_experts_lora",
    "moe_grouped_matmul",
    "moe_lora_expand",
    "moe_lora_routing",
    "moe_lora_shrink",
    "rms_norm",
    "rope_qkv",
    "runtime_apply_shrink",
    "runtime_moe_expand",
    "runtime_moe_shrink",
    "runtime_stacked",
    "silu_and_mul",
    "stacked_plain",
    "stacked_residual",
    "stacked_silu_mul",
]

_TRITON_EXPORTS = {
    "decode_attention": "loraplane.worker.kernels.attention",
    "extend_attention": "loraplane.worker.kernels.attention",
    "lora_shrink": "loraplane.worker.kernels.shrink",
    "lora_expand": "loraplane.worker.kernels.expand",
    "lora_apply": "loraplane.worker.kernels.expand",
    "lora_apply_shrink": "loraplane.worker.kernels.expand",
    "runtime_apply_shrink": "loraplane.worker.kernels.expand",
    "runtime_stacked": "loraplane.worker.kernels.stacked",
    "PendingLoRA": "loraplane.worker.kernels.expand",
    "MoeLoraRouting": "loraplane.worker.kernels.moe",
    "moe_lora_routing": "loraplane.worker.kernels.moe",
    "moe_lora_shrink": "loraplane.worker.kernels.moe",
    "moe_lora_expand": "loraplane.worker.kernels.moe",
    "runtime_moe_shrink": "loraplane.worker.kernels.moe",
    "runtime_moe_expand": "loraplane.worker.kernels.moe",
    "ExpertLoRA": "loraplane.worker.kernels.experts",
    "moe_combine": "loraplane.worker.kernels.experts",
    "moe_experts_lora": "loraplane.worker.kernels.experts",
    "moe_expert_routing": "loraplane.worker.kernels.experts",
    "moe_grouped_matmul": "loraplane.worker.kernels.experts",
    "rms_norm": "loraplane.worker.kernels.norm",
    "rope_qkv": "loraplane.worker.kernels.rope",
    "silu_and_mul": "loraplane.worker.kernels.swiglu",
    "stacked_plain": "loraplane.worker.kernels.stacked",
    "stacked_residual": "loraplane.worker.kernels.stacked",
    "stacked_silu_mul": "loraplane.worker.kernels.stacked",
}


def __getattr__(name: str) -> Any:
    module = _TRITON_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
