"""Fused segmented LoRA ``out += s * (x A) B`` in one launch, for decode-sized segments.

Same function as ``shrink.lora_shrink`` followed by ``expand.lora_expand`` (and as
``reference.lora_shrink`` + ``reference.lora_expand``), with no intermediate ``y`` in device
memory, no split-K partials and one launch instead of two to four. Each program owns a block of
a segment's rows and a block of output columns; it recomputes the rows' shrink for the slices
its columns overlap (``x A`` costs ``K * rank`` per row, small next to the launches it saves at
decode), rounds it to ``x``'s dtype exactly as the two-step path stores ``y``, and expands.

Not wired into the runtime yet: measured against the two-step path in
``bench/fused_probe.py`` first (docs/performance.md).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    check_max_seg_len,
    check_same_dtype,
    check_tensor,
    dot_precision,
    expand_config,
)
from loraplane.worker.kernels.expand import check_expand_operands
from loraplane.worker.kernels.shrink import check_segments

__all__ = ["lora_shrink_expand"]


@triton.jit
def _lora_fused_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, NUM_SLICES * R, K]
    b_ptr,  # [num_slots, N_total, R]
    out_ptr,  # [T, N_total]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    slot_ranks_ptr,  # int32 [num_slots]
    slot_scalings_ptr,  # float32 [num_slots]
    row_order_ptr,  # int64 [positions] (read only when HAS_ROW_ORDER)
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1]
    n_total,
    rank_max,
    x_stride_row,
    out_stride_row,
    a_stride_slot,
    a_stride_row,
    b_stride_slot,
    b_stride_row,
    HIDDEN: tl.constexpr,  # K: a compile-time loop bound (the interpreter needs one)
    NUM_SLICES: tl.constexpr,
    HAS_ROW_ORDER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_SUB: tl.constexpr,  # column blocks per program: the shrink is computed once for them
):
    blk = tl.program_id(0)
    seg = tl.program_id(1)
    seg_start = tl.load(seg_indptr_ptr + seg)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    pos0 = seg_start + blk * BLOCK_S
    if pos0 >= seg_end:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.minimum(tl.load(slot_ranks_ptr + slot), rank_max)
    if rank <= 0:
        return
    scaling = tl.load(slot_scalings_ptr + slot)

    offs_s = pos0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    s_mask = offs_s < seg_end
    if HAS_ROW_ORDER:
        rows = tl.load(row_order_ptr + offs_s, mask=s_mask, other=0)
    else:
        rows = offs_s.to(tl.int64)
    chunk0 = tl.program_id(2) * (BLOCK_N * N_SUB)  # this program's columns: N_SUB blocks of BLOCK_N
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_mask = offs_r < rank  # rows of A / columns of B at or beyond the rank are never read
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    # Shrink once per slice that overlaps the chunk (at most 3 slices: qkv), kept in registers.
    y0 = tl.zeros((BLOCK_S, BLOCK_R), dtype=x_ptr.dtype.element_ty)
    y1 = tl.zeros((BLOCK_S, BLOCK_R), dtype=x_ptr.dtype.element_ty)
    y2 = tl.zeros((BLOCK_S, BLOCK_R), dtype=x_ptr.dtype.element_ty)
    for i in tl.static_range(NUM_SLICES):
        col_lo = tl.load(slice_offsets_ptr + i)
        col_hi = tl.load(slice_offsets_ptr + i + 1)
        if (col_lo < chunk0 + BLOCK_N * N_SUB) & (col_hi > chunk0):
            y = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
            a_base = a_ptr + slot * a_stride_slot + (i * rank_max + offs_r[None, :]).to(tl.int64) * a_stride_row
            for k0 in range(0, HIDDEN, BLOCK_K):
                k_mask = (k0 + offs_k) < HIDDEN
                x_tile = tl.load(
                    x_ptr + rows[:, None] * x_stride_row + (k0 + offs_k)[None, :],
                    mask=s_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )  # [BLOCK_S, BLOCK_K]
                a_tile = tl.load(
                    a_base + (k0 + offs_k)[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0
                )  # [BLOCK_K, BLOCK_R]
                y += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
            # the two-step path stores y in x's dtype: round the same way
            if i == 0:
                y0 = y.to(x_ptr.dtype.element_ty)
            elif i == 1:
                y1 = y.to(x_ptr.dtype.element_ty)
            else:
                y2 = y.to(x_ptr.dtype.element_ty)

    for sub in tl.static_range(N_SUB):
        n0 = chunk0 + sub * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)  # [BLOCK_S, BLOCK_N]
        for i in tl.static_range(NUM_SLICES):
            col_lo = tl.load(slice_offsets_ptr + i)
            col_hi = tl.load(slice_offsets_ptr + i + 1)
            if (col_lo < n0 + BLOCK_N) & (col_hi > n0):
                n_mask = (offs_n >= col_lo) & (offs_n < col_hi)
                b_tile = tl.load(
                    b_ptr + slot * b_stride_slot + offs_n[None, :].to(tl.int64) * b_stride_row + offs_r[:, None],
                    mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )  # [BLOCK_R, BLOCK_N]
                if i == 0:
                    acc += tl.dot(y0, b_tile, input_precision=DOT_PRECISION)
                elif i == 1:
                    acc += tl.dot(y1, b_tile, input_precision=DOT_PRECISION)
                else:
                    acc += tl.dot(y2, b_tile, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None] * out_stride_row + offs_n[None, :]
        out_mask = s_mask[:, None] & (offs_n < n_total)[None, :]
        base = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + scaling * acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int,
    n_sub: int | None = None,
) -> None:
    """``lora_expand(lora_shrink(x, lora_a, …), lora_b, …, out)`` in one launch, in place into ``out``.

    ``n_sub``: column blocks per program (a power of two; default: chosen by the grid size).
    """
    fn = "lora_shrink_expand"
    x = check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    a = check_tensor(fn, "lora_a", lora_a, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_same_dtype(fn, "lora_a", a, "x", x.dtype)
    num_slices = slice_offsets.shape[0] - 1 if isinstance(slice_offsets, torch.Tensor) else 0
    rank_max = lora_b.shape[-1] if isinstance(lora_b, torch.Tensor) else 0
    # y's shape as the two-step path would have it, so the expand checks apply unchanged.
    y_probe = x.new_empty((1, num_slices * rank_max))
    _, b, out, offsets = check_expand_operands(fn, y_probe, lora_b, slot_scalings, slice_offsets, out, weight_ndim=3)
    if a.shape[2] != x.shape[1] or a.shape[1] != num_slices * rank_max or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{fn}: lora_a must have shape [num_slots={b.shape[0]}, num_slices*R={num_slices * rank_max}, "
            f"K={x.shape[1]}], got {tuple(a.shape)}"
        )
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: out must have one row per row of x ({x.shape[0]}), got {out.shape[0]}")
    check_segments(fn, x.device, seg_indptr, seg_slots, slot_ranks, row_order, b.shape[0])
    max_seg_len = check_max_seg_len(fn, max_seg_len)
    n_segments = seg_slots.shape[0]
    if n_segments == 0 or max_seg_len == 0 or b.shape[1] == 0:
        return
    config = expand_config(max_seg_len, rank_max, b.shape[1])
    block_k = 128 if x.shape[1] >= 128 else max(16, triton.next_power_of_2(x.shape[1]))
    if num_slices > 3:
        raise ValueError(f"{fn}: at most 3 stacked slices (q, k, v), got {num_slices}")
    n_blocks = triton.cdiv(b.shape[1], config.block_n)
    seg_blocks = triton.cdiv(max_seg_len, config.block_s)
    # Enough programs to fill the GPU (~2 per SM of an H100/H200), as few shrink repeats as that allows.
    if n_sub is not None and (n_sub < 1 or n_sub & (n_sub - 1)):
        raise ValueError(f"{fn}: n_sub must be a power of two >= 1, got {n_sub}")
    n_sub_auto = n_sub is None
    n_sub = n_sub or 1
    while n_sub < 16 and n_sub_auto and seg_blocks * n_segments * triton.cdiv(n_blocks, n_sub * 2) >= 256:
        n_sub *= 2
    grid = (seg_blocks, n_segments, triton.cdiv(n_blocks, n_sub))
    _lora_fused_kernel[grid](
        x,
        a,
        b,
        out,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order if row_order is not None else seg_indptr,
        offsets,
        b.shape[1],
        rank_max,
        x.stride(0),
        out.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        HIDDEN=x.shape[1],
        NUM_SLICES=num_slices,
        HAS_ROW_ORDER=row_order is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_S=config.block_s,
        BLOCK_R=config.block_r,
        BLOCK_K=block_k,
        BLOCK_N=config.block_n,
        N_SUB=n_sub,
        num_warps=config.num_warps,
    )
