"""Backends that run the LoRA kernels: `triton` (default) or `torch` (the references).

Both expose the same calls over a `LoRABatchInfo`; the wrappers never know which runs.
"""

from __future__ import annotations

from typing import Any

import torch

from loraplane.worker.lora.batch_info import LoRABatchInfo


class LoRABackend:
    """Dispatch to one kernel family. `name` is 'triton' or 'torch'."""

    def __init__(self, name: str) -> None:
        if name == "torch":
            from loraplane.worker.kernels import reference

            self._kernels: Any = reference
            self._routing: Any = None
        elif name == "triton":
            from loraplane.worker import kernels

            self._kernels = kernels
            self._routing = kernels.moe_lora_routing  # type: ignore[attr-defined]
        else:
            raise ValueError(
                f"LoRA backend {name!r} is not supported; expected 'triton' or 'torch'"
            )
        self.name = name

    def shrink(
        self, x: torch.Tensor, lora_a: torch.Tensor, info: LoRABatchInfo, num_slices: int
    ) -> torch.Tensor:
        return self._kernels.lora_shrink(  # type: ignore[no-any-return]
            x,
            lora_a,
            info.seg_indptr,
            info.seg_slots,
            info.slot_ranks,
            info.row_order,
            num_slices,
            info.max_seg_len,
        )

    def expand(
        self,
        y: torch.Tensor,
        lora_b: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        self._kernels.lora_expand(
            y,
            lora_b,
            info.seg_indptr,
            info.seg_slots,
            info.slot_ranks,
            info.slot_scalings,
            info.row_order,
            slice_offsets,
            out,
            info.max_seg_len,
        )

    def apply(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out += s * (x A) B`` per token's own slot: ``expand(shrink(x))``, fused where it pays."""
        if self.name == "torch":
            y = self.shrink(x, lora_a, info, slice_offsets.shape[0] - 1)
            self.expand(y, lora_b, info, slice_offsets, out)
            return
        self._kernels.lora_apply(
            x,
            lora_a,
            lora_b,
            info.seg_indptr,
            info.seg_slots,
            info.slot_ranks,
            info.slot_scalings,
            info.row_order,
            slice_offsets,
            out,
            info.max_seg_len,
            seg_ranks=info.seg_ranks,
            seg_scalings=info.seg_scalings,
        )

    def moe_routing(
        self, pair_expert: torch.Tensor, pair_slot: torch.Tensor, num_slots: int, num_experts: int
    ) -> Any:
        """Pairs grouped by (slot, expert), computed once per MoE layer and reused."""
        if self._routing is None:
            return None
        return self._routing(pair_expert, pair_slot, num_slots, num_experts)

    def moe_shrink(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_slot: torch.Tensor,
        info: LoRABatchInfo,
        num_slices: int,
        topk: int,
        routing: Any,
    ) -> torch.Tensor:
        return self._kernels.moe_lora_shrink(  # type: ignore[no-any-return]
            x,
            lora_a,
            pair_expert,
            pair_slot,
            info.slot_ranks,
            num_slices,
            topk=topk,
            routing=routing,
        )

    def moe_expand(
        self,
        y: torch.Tensor,
        lora_b: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_slot: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
        out: torch.Tensor,
        routing: Any,
    ) -> None:
        self._kernels.moe_lora_expand(
            y,
            lora_b,
            pair_expert,
            pair_slot,
            info.slot_ranks,
            info.slot_scalings,
            slice_offsets,
            out,
            routing=routing,
        )


def make_backend(name: str) -> LoRABackend:
    return LoRABackend(name)
