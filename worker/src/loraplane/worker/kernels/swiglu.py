"""SwiGLU ``act = silu(gate) * up`` in Triton, optionally with gate_up's LoRA expand fused in.

``gu [T, 2I]`` is a gate_up projection's output: gate in columns ``[0, I)``, up in ``[I, 2I)``.
Without LoRA, ``silu_and_mul`` is one kernel where torch needs two (``silu``, then ``mul``
reading back what ``silu`` wrote).

With LoRA (``PendingLoRA.silu_mul``), the same kernel adds each row's LoRA term to its gate
and up values before the activation, so the expand never writes ``gu`` back: at decode, the
expand's read-modify-write of ``gu`` (``T * 2I`` elements, 14.7 MB at 128 Llama-3-8B rows)
and its launch are the biggest LoRA cost left in a dense layer (docs/performance.md).

Grid ``(row blocks, column blocks of I)`` in the batch's own row order. A program reads its
rows' slots (``token_slots``, -1 = no adapter) and loops over the distinct slots among them:
rows of one slot share one tile of B, so a block of rows from one request costs one pass.
The shrink's output ``y`` is indexed by row (``lora_apply_shrink(by_row=True)``). Rows with no
adapter get the plain activation; their ``y`` rows are never read.

Rounding: ``gate + lora`` and ``up + lora`` are rounded to ``gu``'s dtype first, as the
unfused expand stores them, then ``silu(gate) * up`` is computed in fp32 and rounded once.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MIN_DOT_BLOCK,
    check_tensor,
    dot_precision,
    next_power_of_2,
    rank_block,
)

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2I]: gate | up
    act_ptr,  # [T, I]
    y_ptr,  # [T, 2R] by row, or fp32 partials [Y_SPLIT, T, 2R] (read only when HAS_LORA)
    b_ptr,  # [weight_slots, 2I, R] (read only when HAS_LORA)
    token_slots_ptr,  # int32 [T], -1 = no adapter (read only when HAS_LORA)
    slot_ranks_ptr,  # int32 [num_slots]
    slot_scalings_ptr,  # float32 [num_slots]
    rows,
    inter,
    rank_max,
    gu_stride_row,
    act_stride_row,
    y_stride_row,
    y_stride_split,
    b_stride_slot,
    b_stride_row,
    HAS_LORA: tl.constexpr,
    Y_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    m_mask = offs_m < rows
    n_mask = offs_n < inter
    mask = m_mask[:, None] & n_mask[None, :]
    g_ptrs = gu_ptr + offs_m[:, None].to(tl.int64) * gu_stride_row + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_N]
    up = tl.load(g_ptrs + inter, mask=mask, other=0.0)
    if HAS_LORA:
        slots = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)  # [BLOCK_M]
        todo = slots >= 0
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_r = tl.arange(0, BLOCK_R)
        y_rows = offs_m[:, None].to(tl.int64) * y_stride_row + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
        # One pass per distinct slot among these rows (usually one: a request's rows).
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            slot = tl.max(tl.where(todo, slots, -1), axis=0)
            hit = todo & (slots == slot)
            todo = todo & (slots != slot)
            rank = tl.minimum(tl.load(slot_ranks_ptr + slot), rank_max)
            scaling = tl.load(slot_scalings_ptr + slot)
            r_mask = offs_r < rank  # columns of B at or beyond the rank are never read
            y_mask = hit[:, None] & r_mask[None, :]
            if Y_SPLIT == 1:
                y_g = tl.load(y_ptr + y_rows, mask=y_mask, other=0.0)  # [BLOCK_M, BLOCK_R]
                y_u = tl.load(y_ptr + y_rows + rank_max, mask=y_mask, other=0.0)
            else:
                # The shrink's split-K partials, summed in a fixed order and rounded to the
                # weights' dtype, as lora_expand does.
                sum_g = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                sum_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for sp in tl.static_range(Y_SPLIT):
                    part = y_ptr + sp * y_stride_split + y_rows
                    sum_g += tl.load(part, mask=y_mask, other=0.0)
                    sum_u += tl.load(part + rank_max, mask=y_mask, other=0.0)
                y_g = sum_g.to(b_ptr.dtype.element_ty)
                y_u = sum_u.to(b_ptr.dtype.element_ty)
            b_ptrs = (
                b_ptr
                + slot.to(tl.int64) * b_stride_slot
                + offs_n[None, :].to(tl.int64) * b_stride_row
                + offs_r[:, None]
            )  # [BLOCK_R, BLOCK_N]
            b_mask = r_mask[:, None] & n_mask[None, :]
            b_g = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b_u = tl.load(b_ptrs + inter * b_stride_row, mask=b_mask, other=0.0)
            acc_g += scaling * tl.dot(y_g, b_g, input_precision=DOT_PRECISION)
            acc_u += scaling * tl.dot(y_u, b_u, input_precision=DOT_PRECISION)
        gate = (gate.to(tl.float32) + acc_g).to(gu_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + acc_u).to(gu_ptr.dtype.element_ty)
    g = gate.to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * act_stride_row + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, num_warps) forced by bench/probes/swiglu.py; None: the heuristic below.
FORCE_BLOCKS: tuple[int, int, int] | None = None


def _blocks(rows: int, inter: int, block_r: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 16-row blocks at decode (a dot needs 16), wider for
    prefill."""
    if FORCE_BLOCKS is not None:
        return FORCE_BLOCKS
    block_m = 16 if rows <= 128 else 32 if rows <= 1024 else 64
    block_n = 128 if block_r <= 64 else 64
    return block_m, min(block_n, max(MIN_DOT_BLOCK, next_power_of_2(inter))), 4


def check_gate_up(fn: str, gu: object) -> torch.Tensor:
    t = check_tensor(fn, "gu", gu, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    if t.shape[1] % 2:
        raise ValueError(
            f"{fn}: gu must be [rows, 2 * intermediate] (gate | up), got an odd width "
            f"{t.shape[1]} in shape {tuple(t.shape)}"
        )
    return t


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[:, :I]) * gu[:, I:]`` as a new ``[T, I]`` tensor, in one launch."""
    gu = check_gate_up("silu_and_mul", gu)
    return launch_silu_mul(gu, None)


def launch_silu_mul(
    gu: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Launch without checks. ``lora``: ``(y, lora_b, token_slots, slot_ranks, slot_scalings)``
    with ``y`` by row (``[T, 2R]``, or fp32 partials ``[splits, T, 2R]``)."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    act = torch.empty((rows, inter), dtype=gu.dtype, device=gu.device)
    if rows == 0 or inter == 0:
        return act
    if lora is None:
        y = b = slots = ranks = scalings = gu
        y_split, rank_max, block_r = 1, 0, MIN_DOT_BLOCK
    else:
        y, b, slots, ranks, scalings = lora
        y_split = y.shape[0] if y.dim() == 3 else 1
        rank_max = b.shape[2]
        block_r = rank_block(rank_max)
    block_m, block_n, num_warps = _blocks(rows, inter, block_r)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(inter, block_n))
    _silu_mul_kernel[grid](
        gu,
        act,
        y,
        b,
        slots,
        ranks,
        scalings,
        rows,
        inter,
        rank_max,
        gu.stride(0),
        act.stride(0),
        y.stride(-2) if lora is not None else 0,
        y.stride(0) if y_split > 1 else 0,
        b.stride(0) if lora is not None else 0,
        b.stride(1) if lora is not None else 0,
        HAS_LORA=lora is not None,
        Y_SPLIT=y_split,
        DOT_PRECISION=dot_precision(gu.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=num_warps,
    )
    return act
