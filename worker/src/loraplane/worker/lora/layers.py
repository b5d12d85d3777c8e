"""LoRA wrappers around the model's linears, with their slot buffers.

Each wrapper owns `max_loras_per_batch` slots of A and B sized for `max_lora_rank`, and
slices an adapter's full A/B by its own base layer's shard (seed 002): column-parallel
layers split B's output rows per slice; row-parallel layers split A's input columns and
add their partial LoRA output before the base layer's own reduction, over the same group.

A wrapper applies LoRA only when `lora_active`: the LoRA context has batch info for the
section the wrapper runs in (seed 004). Attention runs in the DP-local section; the MLP,
experts and LM head in the TP-global section (they are the same without DP attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.worker.lora import extents
from loraplane.worker.lora.backend import Aside, LoRABackend, StackedOp
from loraplane.worker.lora.batch_info import LoRABatchInfo
from loraplane.worker.models.layers import (
    ColumnParallelLinear,
    RopeKV,
    RowParallelLinear,
    silu_mul,
)
from loraplane.worker.models.model import Experts

if TYPE_CHECKING:
    from loraplane.worker.kernels._triton_utils import StageInfo
    from loraplane.worker.kernels.experts import ExpertLoRA
    from loraplane.worker.lora.adapter import ExpertStack

Section = Literal["local", "global"]


def to_device(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Host ``src`` copied to ``device`` without holding the host.

    A copy from page-locked memory is queued and returns at once. A strided view of it (a
    tensor-parallel rank's columns) would go through a pageable buffer, and a copy from
    pageable memory waits for the stream; so such a view is first gathered into page-locked
    memory of its own."""
    if device.type == "cuda" and src.is_pinned() and not src.is_contiguous():
        src = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
    return src.to(device, dtype, non_blocking=True)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy host ``src`` into the slot view ``dst`` without holding the host.

    From page-locked memory a copy into a contiguous view is queued and returns at once. Into
    a view that is not contiguous (a rank below the slots' maximum: ``[:, :rank]``) torch
    waits for the stream to finish before returning (seen on an H200: the whole of a busy
    copy stream's queue), so such a copy goes through a contiguous device buffer first."""
    if dst.device.type != "cuda":
        dst.copy_(src)
    elif dst.is_contiguous() and src.is_contiguous():
        dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(to_device(src, dst.device, dst.dtype))


class LoRAContext:
    """Per-forward LoRA state shared by every wrapper of one model."""

    def __init__(self, backend: LoRABackend, dp_attention: bool) -> None:
        self.backend = backend
        self.dp_attention = dp_attention
        self.local: LoRABatchInfo | None = None
        self.global_: LoRABatchInfo | None = None

    def info(self, section: Section) -> LoRABatchInfo | None:
        if section == "global" and self.dp_attention:
            return self.global_
        return self.local

    def reset_batch_state(self) -> None:
        """Forget the last batch: with no batch info every wrapper takes the base path."""
        self.local = None
        self.global_ = None


class LoRALayer(nn.Module):
    module_names: tuple[str, ...]

    def __init__(self, ctx: LoRAContext, section: Section) -> None:
        super().__init__()
        self.ctx = ctx
        self.section: Section = section

    @property
    def lora_active(self) -> bool:
        return self.ctx.info(self.section) is not None

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> None:
        raise NotImplementedError

    def clear_slot(self, slot: int) -> None:
        raise NotImplementedError

    # --- stacked shrink (lora/stage.py) ------------------------------------------------

    # [N + P * n_slices * R, K]: the base weight, then P stage positions (None: not stacking)
    stacked: torch.Tensor | None = None
    # [P * R * N]: the stage positions' B, each [N, r] at the stage rank r (``staged_b``)
    stage_b: torch.Tensor | None = None
    _staged_b_view: tuple[int, torch.Tensor] | None = None  # (rank, staged_b(rank))
    _device_name = ""  # the GPU model, for the GEMM extent table (lora/extents.py)
    n_base = 0  # N: base output rows of `stacked`
    n_slices = 1  # A slices per position (q | k | v, gate | up)
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def _stack(
        self, base: nn.Module, n_base: int, n_slices: int, max_rank: int, positions: int
    ) -> None:
        """Move ``base.weight [N, K]`` into the first rows of ``stacked`` (no copy kept)."""
        w = base.weight
        device_name = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else ""
        stage_rows = positions * n_slices * max_rank
        pad = extents.pad_rows(device_name, w.shape[1], n_base, stage_rows)
        stacked = torch.zeros(n_base + stage_rows + pad, w.shape[1], dtype=w.dtype, device=w.device)
        stacked[:n_base].copy_(w)
        base.weight = nn.Parameter(stacked[:n_base], requires_grad=False)
        self.stacked, self.n_base, self.n_slices = stacked, n_base, n_slices
        self.stage_b = torch.zeros(positions * max_rank * n_base, dtype=w.dtype, device=w.device)
        self._device_name = device_name

    def stage_copy(self, position: int, slot: int, rank: int) -> None:
        """``slot``'s first ``rank`` A rows of each slice into ``position`` (``n * rank`` rows)
        of ``stacked``, and its B's first ``rank`` columns into ``staged_b(rank)[position]``."""
        assert self.stacked is not None and self.stage_b is not None
        n = self.n_slices
        lo = self.n_base + position * n * rank
        k = self.stacked.shape[1]
        self.stacked[lo : lo + n * rank].view(n, rank, k).copy_(
            self.lora_a[slot].view(n, -1, k)[:, :rank]
        )
        self.staged_b(rank)[position].copy_(self.lora_b[slot, :, :rank])

    def staged_b(self, rank: int) -> torch.Tensor:
        """The stage positions' B at stage rank ``rank``: ``[positions, N, rank]``, position
        ``p``'s at ``[p]``. The epilogues read it whole: a slot buffer's row holds the same
        ``rank`` values in its first ``rank`` of ``R_max`` columns, and a tile of them spans
        ``R_max / rank`` times the memory."""
        cached = self._staged_b_view
        if cached is None or cached[0] != rank:  # (every staged step asks, per projection)
            assert self.stage_b is not None
            per = self.n_base * rank
            view = self.stage_b[: self.stage_b.numel() // per * per].view(-1, self.n_base, rank)
            self._staged_b_view = cached = (rank, view)
        return cached[1]

    def staged_b_of(self, stage: StageInfo) -> torch.Tensor:
        """``staged_b`` at ``stage``'s rank, for the epilogues and the rotation of a batch
        that ``StaticLoRABatch`` filled (it names each position's B by its position)."""
        b = self.staged_b(stage.rank)
        assert b.shape[0] >= stage.width
        return b

    def _stacked_gemm(self, x: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor | None:
        """``x [W; A_staged]^T`` when this batch is staged and this wrapper stacks, else None."""
        stage = info.stage
        if stage is None or self.stacked is None:
            return None
        k, n = self.stacked.shape[1], self.n_base
        need = stage.width * self.n_slices * stage.rank
        if info.exact_base:
            # The base GEMM exactly as the LoRA-off step runs it (same weight view, same
            # shape: the same bits for rows without an adapter), the stage's rows apart.
            return torch.cat(
                (F.linear(x, self.stacked[:n]), F.linear(x, self.stacked[n : n + need])), 1
            )
        extent = extents.extent_for(
            self._device_name, k, n, need, x.shape[0], self.stacked.shape[0] - n
        )
        return F.linear(x, self.stacked[: n + extent])

    def _stacked_op(
        self,
        op: StackedOp,
        full: torch.Tensor,
        info: LoRABatchInfo,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        """The op after the projection with each row's LoRA from ``full`` (the stacked GEMM)."""
        stage = info.stage
        assert stage is not None
        n_r = self.n_slices * stage.rank
        return self.ctx.backend.stacked(
            op, full, self.n_base, n_r, self.staged_b_of(stage), stage, *extra
        )


class ColumnLoRA(LoRALayer):
    """qkv_proj (q, k, v with GQA widths) or gate_up_proj (gate, up): one launch per stack."""

    def __init__(
        self,
        base: ColumnParallelLinear,
        module_names: tuple[str, ...],
        ctx: LoRAContext,
        section: Section,
        num_slots: int,
        max_rank: int,
        stage_slots: int = 0,
    ) -> None:
        super().__init__(ctx, section)
        assert len(module_names) == len(base.output_sizes)
        self.base_layer = base
        self.module_names = module_names
        self.max_rank = max_rank
        w = base.weight
        n = len(module_names)
        self.lora_a = torch.zeros(
            num_slots, n * max_rank, base.in_features, dtype=w.dtype, device=w.device
        )
        self.lora_b = torch.zeros(
            num_slots, base.local_offsets[-1], max_rank, dtype=w.dtype, device=w.device
        )
        self.slice_offsets = torch.tensor(base.local_offsets, dtype=torch.int32, device=w.device)
        if stage_slots > 0 and base.bias is None:  # (a bias would need its own epilogue)
            self._stack(base, base.local_offsets[-1], n, max_rank, stage_slots)

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> None:
        self.clear_slot(slot)
        r = self.max_rank
        for i, name in enumerate(self.module_names):
            if name not in weights:
                continue  # modules the adapter lacks stay zero
            a, b = weights[name]  # [r, in], [out_full, r]
            lo, hi = self.base_layer.local_offsets[i], self.base_layer.local_offsets[i + 1]
            copy_in(self.lora_a[slot, i * r : i * r + rank], a)
            copy_in(self.lora_b[slot, lo:hi, :rank], self.base_layer.shard_rows(b, i))

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info(self.section)
        if info is None:
            return self.base_layer(x)  # type: ignore[no-any-return]
        full = self._stacked_gemm(x, info)
        if full is not None:
            return self._stacked_op("plain", full, info, self.slice_offsets)
        return self.ctx.backend.apply_around(
            x, self.base_layer, self.lora_a, self.lora_b, info, self.slice_offsets
        )  # [T, out_local]

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this (gate_up) projection with its LoRA; staged batches
        add the LoRA inside the activation's kernel (``kernels.stacked_silu_mul``)."""
        info = self.ctx.info(self.section)
        full = self._stacked_gemm(x, info) if info is not None else None
        if full is None:
            return silu_mul(self(x))
        assert info is not None
        return self._stacked_op("silu_mul", full, info)

    def forward_rope(self, x: torch.Tensor, rope: RopeKV) -> torch.Tensor:
        """``rope(self(x))`` of this (qkv) projection with its LoRA (see ``RopeKV``); staged
        batches of the Triton backend add the LoRA inside the rotation's kernel
        (``kernels.rope_qkv``), so it costs no launch of its own."""
        info = self.ctx.info(self.section)
        triton = self.ctx.backend.name == "triton"
        full = self._stacked_gemm(x, info) if info is not None and triton else None
        if full is None:
            return rope(self(x))
        assert info is not None and info.stage is not None  # (a stacked GEMM ran)
        return rope(full, self.staged_b_of(info.stage), info.stage)


class RowLoRA(LoRALayer):
    """o_proj or down_proj: A split by input columns; partial output reduced with the base."""

    # Add the LoRA into the residual on one rank (forward_add). A class switch so that one
    # bench run can compare it on and off (bench/probes/switches.py); on by default.
    fold_residual = True

    def __init__(
        self,
        base: RowParallelLinear,
        module_name: str,
        ctx: LoRAContext,
        section: Section,
        num_slots: int,
        max_rank: int,
        stage_slots: int = 0,
    ) -> None:
        super().__init__(ctx, section)
        self.base_layer = base
        self.module_names = (module_name,)
        w = base.weight
        self.lora_a = torch.zeros(
            num_slots, max_rank, base.in_local, dtype=w.dtype, device=w.device
        )
        self.lora_b = torch.zeros(
            num_slots, base.out_features, max_rank, dtype=w.dtype, device=w.device
        )
        self.slice_offsets = torch.tensor(
            [0, base.out_features], dtype=torch.int32, device=w.device
        )
        if stage_slots > 0 and base.tp_size == 1:  # a partial y would need the reduction
            self._stack(base, base.out_features, 1, max_rank, stage_slots)

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> None:
        self.clear_slot(slot)
        if self.module_names[0] in weights:
            a, b = weights[self.module_names[0]]  # [r, in_full], [out, r]
            copy_in(self.lora_a[slot, :rank], self.base_layer.shard_cols(a))
            copy_in(self.lora_b[slot, :, :rank], b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info(self.section)
        full = self._stacked_gemm(x, info) if info is not None else None
        if full is not None:
            assert info is not None
            out = self._stacked_op("plain", full, info, self.slice_offsets)
        elif info is None:
            out = self.base_layer.forward_partial(x)  # [T, out] partial over the group
        else:
            # x_shard A_shard: a partial shrink, expanded onto the partial base output
            out = self.ctx.backend.apply_around(
                x,
                self.base_layer.forward_partial,
                self.lora_a,
                self.lora_b,
                info,
                self.slice_offsets,
            )
        return self.base_layer.reduce(out)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; on one rank the LoRA is added into ``residual`` in place.

        The LoRA term then does not wait for the base projection: it runs beside it on the
        side stream when the backend overlaps (``run_aside``), and only the residual add
        waits for both. The sum is ``(residual + lora) + base`` on these paths (eager, or a
        graph step that is not staged, either backend), so they stay bitwise equal. A staged
        batch (``info.stage``) instead adds ``base + lora`` into the residual in one kernel,
        rounded once: equal to tolerance, not bit for bit (ADR 0007). With the layer split
        over ranks the LoRA term is partial and is reduced with the base output instead.
        """
        info = self.ctx.info(self.section)
        full = self._stacked_gemm(x, info) if info is not None else None
        if full is not None:  # a staged batch: base, LoRA and the residual add in one kernel
            assert info is not None
            return self._stacked_op("residual", full, info, residual)
        if info is None or self.base_layer.tp_size > 1 or not self.fold_residual:
            return residual + self(x)
        backend = self.ctx.backend
        aside = backend.run_aside(
            x,
            lambda: backend.apply(x, self.lora_a, self.lora_b, info, self.slice_offsets, residual),
        )
        out = self.base_layer.forward_partial(x)
        aside.result()
        return residual + out


class ExpertsLoRA(LoRALayer):
    """One (A, B) pair per (slot, expert) for gate_up (stacked) and down (seed 001)."""

    module_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, base: Experts, ctx: LoRAContext, num_slots: int, max_rank: int) -> None:
        super().__init__(ctx, "global")
        self.base_layer = base
        self.max_rank = max_rank
        w = base.w_gate_up
        e, h, i, r = base.num_experts, base.hidden, base.intermediate, max_rank
        kw = {"dtype": w.dtype, "device": w.device}
        self.a_gate_up = torch.zeros(num_slots, e, 2 * r, h, **kw)  # type: ignore[arg-type]
        self.b_gate_up = torch.zeros(num_slots, e, 2 * i, r, **kw)  # type: ignore[arg-type]
        self.a_down = torch.zeros(num_slots, e, r, i, **kw)  # type: ignore[arg-type]
        self.b_down = torch.zeros(num_slots, e, h, r, **kw)  # type: ignore[arg-type]
        self.gate_up_offsets = torch.tensor([0, i, 2 * i], dtype=torch.int32, device=w.device)
        self.down_offsets = torch.tensor([0, h], dtype=torch.int32, device=w.device)
        base.lora = self

    # Pairs up to which the LoRA runs inside the base experts' kernels. Their SwiGLU reads
    # gate_up's B and down's A once per pair (not once per (slot, expert)): at decode a few
    # pairs share an expert, at prefill thousands would re-read the same weights; measured
    # at bs 16-128 x top-8 (docs/performance.md).
    fused_max_pairs = 1024
    # Down's LoRA columns sum one partial shrink per 128 columns of the intermediate size, in
    # an unrolled loop: up to 16 (an intermediate of 2048 per rank).
    fused_max_intermediate = 2048

    def fused_operands(self, topk: int, num_pairs: int) -> ExpertLoRA | None:
        """The operands of ``kernels.moe_experts_lora`` (the LoRA inside the base experts'
        kernels) on the Triton backend for up to ``fused_max_pairs`` pairs and an
        intermediate size up to ``fused_max_intermediate``; else None (the separate LoRA
        kernels, or on the torch backend the per-pair references)."""
        if (
            self.ctx.backend.name != "triton"
            or num_pairs > self.fused_max_pairs
            or self.base_layer.intermediate > self.fused_max_intermediate
        ):
            return None
        info = self.ctx.info(self.section)
        assert info is not None
        from loraplane.worker.kernels.experts import ExpertLoRA

        return ExpertLoRA(
            self.a_gate_up,
            self.b_gate_up,
            self.a_down,
            self.b_down,
            info.token_slots[: num_pairs // topk],  # the batch's tokens (a graph's are padded)
            info.slot_ranks,
            info.slot_scalings,
            topk,
            adapters=info.num_segments,  # a graph's: its segments, fixed at capture
        )

    def set_expert_slot(self, slot: int, stacks: dict[str, ExpertStack], rank: int) -> None:
        """Each module's experts (``stacks``: the adapter's, by module) into ``slot``;
        experts and modules it lacks are zero.

        One host-to-device copy per module and operand, from the adapter's stacks: a model's
        experts number up to hundreds a layer, and a copy each would hold the
        engine's step loop, which loads a slot before the step that first uses it, for
        seconds on a 48-layer model."""
        self.clear_slot(slot)
        i, r, tp_rank = self.base_layer.intermediate, self.max_rank, self.base_layer.tp_rank
        cols = slice(tp_rank * i, (tp_rank + 1) * i)  # this rank's part of the intermediate
        device = self.a_down.device
        for module, stack in stacks.items():
            if module == "down_proj":  # A [r, I_full] split by columns; B [H, r] whole
                a_dst, b_dst = self.a_down[slot, :, :rank], self.b_down[slot, :, :, :rank]
                a_src, b_src = stack.a[:, :, cols], stack.b
            else:  # A [r, H] whole; B [I_full, r] split by rows
                k = 0 if module == "gate_proj" else 1
                a_dst = self.a_gate_up[slot, :, k * r : k * r + rank]
                b_dst = self.b_gate_up[slot, :, k * i : (k + 1) * i, :rank]
                a_src, b_src = stack.a, stack.b[:, cols]
            index = stack.experts.to(device, non_blocking=True)
            a_dst[index] = to_device(a_src, device, a_dst.dtype)  # (index_put_)
            b_dst[index] = to_device(b_src, device, b_dst.dtype)

    def clear_slot(self, slot: int) -> None:
        for buf in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down):
            buf[slot].zero_()

    def begin_gate_up(
        self, x: torch.Tensor, pair_expert: torch.Tensor, topk: int
    ) -> Aside[torch.Tensor]:
        """The pairs' routing by (slot, expert) and the gate/up shrink, beside the base gate_up
        GEMM; overlapping (a CUDA graph being captured), the expand too, into a zeroed
        ``[P, 2I]`` buffer (zero for pairs without an adapter) that the SwiGLU adds, so no
        LoRA kernel waits on the GEMM. Pair p is token ``p // topk``: it reads row
        ``p // topk`` of ``x [T, H]`` and that token's slot. Finish with ``gate_up_delta``."""
        info = self.ctx.info(self.section)
        assert info is not None
        backend = self.ctx.backend
        self._deltas = self._use_deltas(x)

        def lora() -> torch.Tensor:
            self._pairs = backend.moe_pairs(
                pair_expert, topk, self.a_gate_up.shape[0], self.a_gate_up.shape[1], info
            )
            y = backend.moe_shrink(x, self.a_gate_up, self._pairs, info, 2, topk)
            if not self._deltas:
                return y
            delta = x.new_zeros(pair_expert.shape[0], self.b_gate_up.shape[2])
            backend.moe_expand(y, self.b_gate_up, self._pairs, info, self.gate_up_offsets, delta)
            return delta

        return backend.run_aside(x, lora)

    def _use_deltas(self, x: torch.Tensor) -> bool:
        """Expands into buffers beside the GEMMs when the backend overlaps (a CUDA graph
        being captured); else into the GEMMs' outputs."""
        return self.ctx.backend.overlaps(x)

    def gate_up_delta(self, pending: Aside[torch.Tensor], gu: torch.Tensor) -> torch.Tensor | None:
        """What the SwiGLU adds to ``gu [P, 2I]``: the side stream's buffer, or (not
        overlapping) nothing, the expand having added into ``gu`` itself: no extra buffer or
        fill in an eager step, whose LoRA would gain nothing from a side stream."""
        return self._finish(pending, gu, self.b_gate_up, self.gate_up_offsets)

    def begin_down(self, act: torch.Tensor) -> Aside[torch.Tensor]:
        """The down shrink (and, overlapping, its expand into a zeroed ``[P, H]`` buffer that
        the top-k combine adds) over the gate_up call's pairs, beside the base down GEMM.
        Finish with ``down_delta``."""
        info = self.ctx.info(self.section)
        assert info is not None
        backend = self.ctx.backend

        def lora() -> torch.Tensor:
            y = backend.moe_shrink(act, self.a_down, self._pairs, info, 1, 1)
            if not self._deltas:
                return y
            delta = act.new_zeros(act.shape[0], self.b_down.shape[2])
            backend.moe_expand(y, self.b_down, self._pairs, info, self.down_offsets, delta)
            return delta

        return backend.run_aside(act, lora)

    def down_delta(self, pending: Aside[torch.Tensor], d: torch.Tensor) -> torch.Tensor | None:
        """What the top-k combine adds to ``d [P, H]`` (as ``gate_up_delta``)."""
        return self._finish(pending, d, self.b_down, self.down_offsets)

    def _finish(
        self,
        pending: Aside[torch.Tensor],
        out: torch.Tensor,
        lora_b: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor | None:
        value = pending.result()
        if self._deltas:
            return value
        info = self.ctx.info(self.section)
        assert info is not None
        self.ctx.backend.moe_expand(value, lora_b, self._pairs, info, offsets, out)
        return None
