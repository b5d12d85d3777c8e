"""Backends that run the LoRA kernels: `triton` (default) or `torch` (the references).

Both expose the same calls over a `LoRABatchInfo`; the wrappers never know which runs.

Overlap (`apply_around`): the shrink reads only the projection's input, so on CUDA it can run
on a side stream while the base projection runs, and only the expand waits for both. (The
routed experts' LoRA goes further when it overlaps: its expands run on the side stream too,
into buffers that the op after each grouped GEMM adds; `ExpertsLoRA`.) At
decode the shrink is a few-program kernel bound by load latency and the base GEMM streams
the weights, so the shrink's time leaves the step's critical path. The fork and join cost two
events of host time per projection, which an eager step (host-bound) cannot afford; a
captured CUDA graph pays them once at capture. `overlap="auto"` (the default) therefore
overlaps only while a graph is being captured; "on" and "off" force it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from loraplane.worker.kernels._triton_utils import StageInfo
from loraplane.worker.lora.batch_info import LoRABatchInfo

Overlap = Literal["auto", "on", "off"]
StackedOp = Literal["plain", "residual", "silu_mul"]  # kernels/stacked.py's epilogues
T = TypeVar("T")


@dataclass(slots=True)
class Aside(Generic[T]):
    """A value computed on a side stream (``stream``), or on the current one (``None``)."""

    value: T
    stream: torch.cuda.Stream | None

    def result(self) -> T:
        """The value, once the current stream has waited for the side stream's work."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return self.value


@dataclass(frozen=True, slots=True)
class MoePairs:
    """One MoE layer's (token, k) pairs as its LoRA kernels read them (``moe_pairs``)."""

    expert: torch.Tensor  # int32 [P]: each pair's expert
    routing: Any  # Triton: the pairs' MoeLoraRouting by (slot, expert); torch: None
    slots: torch.Tensor | None  # torch: int32 [P], each pair's slot (-1: none); Triton: None


class LoRABackend:
    """Dispatch to one kernel family. `name` is 'triton' or 'torch'."""

    def __init__(self, name: str, overlap: Overlap = "auto") -> None:
        if overlap not in ("auto", "on", "off"):
            raise ValueError(
                f"LoRA overlap {overlap!r} is not supported; expected 'auto', 'on' or 'off'"
            )
        self.overlap: Overlap = overlap
        # K splits of an overlapped shrink (None: the kernels' default cap); see apply_around.
        self.overlap_split_k: int | None = None
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        if name == "torch":
            from loraplane.worker.kernels import reference

            self._kernels: Any = reference
        elif name == "triton":
            from loraplane.worker import kernels

            self._kernels = kernels
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
        self._shrink_for_apply(x, lora_a, lora_b, info, slice_offsets, out).expand_into(out)

    def apply_around(
        self,
        x: torch.Tensor,
        base: Callable[[torch.Tensor], torch.Tensor],
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
    ) -> torch.Tensor:
        """``base(x)`` plus the LoRA of ``apply``; the shrink overlaps ``base`` when it pays."""
        if not self.overlaps(x):
            out = base(x)
            self.apply(x, lora_a, lora_b, info, slice_offsets, out)
            return out
        pending = self.run_aside(
            x,
            lambda: self._shrink_for_apply(
                x, lora_a, lora_b, info, slice_offsets, max_split_k=self.overlap_split_k
            ),
        )
        out = base(x)
        pending.result().expand_into(out)
        return out

    def run_aside(self, x: torch.Tensor, work: Callable[[], T]) -> Aside[T]:
        """``work()`` on the side stream when overlapping (else now, on the current stream).

        The side stream first waits for the current one (``work``'s inputs are ready), and
        ``Aside.result()`` makes the current stream wait for the side one. Memory ``work``
        allocates belongs to the side stream; what the result holds is freed after
        ``result()``'s consumer is queued, and the side stream's next use waits on the current
        stream first, so it is never reused before that consumer has read it. Temporaries
        that only the side stream used (a shrink's fp32 split-K partials) may be freed inside
        ``work``: the caching allocator reuses them only in that stream's order.
        """
        if not self.overlaps(x):
            return Aside(work(), None)
        side = self._side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            value = work()
        return Aside(value, side)

    def _shrink_for_apply(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
        out: torch.Tensor | None = None,
        max_split_k: int | None = None,
    ) -> Any:
        """``kernels.runtime_apply_shrink`` over ``info`` (``lora_apply_shrink`` without the
        checks of operands the runtime built): the shrink launched, the expand pending."""
        return self._kernels.runtime_apply_shrink(
            x,
            lora_a,
            lora_b,
            info.seg_indptr,
            info.seg_slots,
            info.seg_ranks,
            info.seg_scalings,
            info.row_order,
            slice_offsets,
            info.max_seg_len,
            out,
            max_split_k,
            info.seg_tiles,
        )

    # --- staged batches: the shrink came out of the base GEMM (lora/stage.py) -----------

    def stacked(
        self,
        op: StackedOp,
        full: torch.Tensor,
        n_base: int,
        n_r: int,
        lora_b: torch.Tensor,
        stage: StageInfo,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        """``kernels.stacked_<op>(full, n_base, n_r, lora_b, stage, *extra)``: each row's
        LoRA added to ``full[:, :N]`` inside the op after the projection (kernels/stacked.py;
        on the Triton backend without the operand checks, ``runtime_stacked``)."""
        if self.name == "triton":
            return self._kernels.runtime_stacked(op, full, n_base, n_r, lora_b, stage, *extra)  # type: ignore[no-any-return]
        kernel = getattr(self._kernels, f"stacked_{op}")
        return kernel(full, n_base, n_r, lora_b, stage, *extra)  # type: ignore[no-any-return]

    def overlaps(self, x: torch.Tensor) -> bool:
        """Whether ``run_aside`` puts work for ``x`` on the side stream now."""
        if self.name != "triton" or x.device.type != "cuda" or self.overlap == "off":
            return False
        return self.overlap == "on" or torch.cuda.is_current_stream_capturing()

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device)
        return stream

    def moe_pairs(
        self,
        pair_expert: torch.Tensor,
        topk: int,
        num_slots: int,
        num_experts: int,
        info: LoRABatchInfo,
    ) -> MoePairs:
        """One MoE layer's pairs, built once and read by its shrinks and expands. Pair ``p``
        is token ``p // topk`` and has that token's slot (``info.token_slots``).

        Triton: the pairs grouped by (slot, expert) on the device, the slots read per token
        inside the routing kernel (no per-pair copy), each tile carrying ``info.slot_ranks``.
        Torch: each pair's slot, which the references read."""
        token_slots = info.token_slots[: pair_expert.shape[0] // topk]
        if self.name == "triton":
            routing = self._kernels.moe_lora_routing(
                pair_expert,
                token_slots,
                num_slots,
                num_experts,
                slot_ranks=info.slot_ranks,
                slot_div=topk,
            )
            return MoePairs(pair_expert, routing, None)
        return MoePairs(pair_expert, None, token_slots.repeat_interleave(topk))

    def moe_shrink(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        pairs: MoePairs,
        info: LoRABatchInfo,
        num_slices: int,
        topk: int,
    ) -> torch.Tensor:
        """``y [P, num_slices * R]``: the pairs' shrink (pair ``p`` reads row ``p // topk`` of
        ``x``). On Triton the rows of pairs with no adapter are left unwritten (unread)."""
        if pairs.routing is not None:
            return self._kernels.runtime_moe_shrink(  # type: ignore[no-any-return]
                x, lora_a, info.slot_ranks, num_slices, topk, pairs.routing
            )
        return self._kernels.moe_lora_shrink(  # type: ignore[no-any-return]
            x, lora_a, pairs.expert, pairs.slots, info.slot_ranks, num_slices, topk=topk
        )

    def moe_expand(
        self,
        y: torch.Tensor,
        lora_b: torch.Tensor,
        pairs: MoePairs,
        info: LoRABatchInfo,
        slice_offsets: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out [P, N] +=`` each pair's LoRA; pairs with no adapter are untouched."""
        if pairs.routing is not None:
            self._kernels.runtime_moe_expand(
                y, lora_b, info.slot_ranks, info.slot_scalings, slice_offsets, out, pairs.routing
            )
            return
        self._kernels.moe_lora_expand(
            y,
            lora_b,
            pairs.expert,
            pairs.slots,
            info.slot_ranks,
            info.slot_scalings,
            slice_offsets,
            out,
        )


def make_backend(name: str, overlap: Overlap = "auto") -> LoRABackend:
    return LoRABackend(name, overlap)
