"""Single-launch LoRA apply for decode batches on CUDA: shrink, grid barrier, expand.

``lora_apply`` is two launches, a shrink and an expand. At decode each is a few-microsecond
kernel whose time is launch and load latency, not bytes, so their count is the cost (about
4.5 us each in an H200 decode step, docs/performance.md). Here one cooperative launch of at most
``2 x SMs`` programs does both: every program takes shrink items ``(block, segment, slice,
K split)`` in turn and writes fp32 partials, all meet at a grid barrier (an arrival counter in
global memory), then they take expand items ``(block, segment, column block)`` that sum the
partials in a fixed order and add ``s * y B`` into ``out``. Same tiles, same order of sums as
``lora_apply``: the results are bitwise equal.

The barrier needs every program resident at once: a cooperative launch guarantees it or fails.
The Triton interpreter runs programs one after another, so this path is CUDA-only and the
callers fall back to ``lora_apply`` elsewhere (``fused_apply_supported``).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    check_dim,
    check_tensor,
    dot_precision,
    expand_config,
    shrink_config,
    split_k_for,
)
from loraplane.worker.kernels.expand import check_apply_operands, check_seg_ranks

__all__ = ["FUSED_MAX_ROWS", "fused_apply_supported", "lora_apply_fused"]

# Rows up to which one launch beats two (decode batches); prefill keeps the two launches,
# whose grids fill the GPU by themselves.
FUSED_MAX_ROWS = 256
# Programs per multiprocessor: two 4-warp programs fit in any SM's registers (2 x 128 threads
# x 255 registers < 64K), so the cooperative launch can never be refused.
PROGRAMS_PER_SM = 2


@triton.jit
def _grid_arrive_and_wait(bar_ptr, num_programs):
    """Every program's writes before this are visible to every program after it."""
    tl.debug_barrier()  # this program's threads have issued their stores
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < num_programs:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_leave(bar_ptr, num_programs):
    """The last program to leave resets the counters for the next launch on this buffer."""
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == num_programs - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _segment_rows(seg_indptr_ptr, row_order_ptr, seg, blk, BLOCK_S: tl.constexpr, HAS_ROW_ORDER):
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    offs_s = tl.load(seg_indptr_ptr + seg) + blk * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = offs_s < seg_end
    if HAS_ROW_ORDER:
        rows = tl.load(row_order_ptr + offs_s, mask=s_mask, other=0)
    else:
        rows = offs_s.to(tl.int64)
    return offs_s.to(tl.int64), rows, s_mask


@triton.jit
def _lora_apply_fused_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [slots, NUM_SLICES * R, K]
    b_ptr,  # [slots, N_total, R]
    out_ptr,  # [T, N_total]
    y_ptr,  # fp32 [SPLIT_K, positions, NUM_SLICES * R]
    bar_ptr,  # int32 [2], zero between launches
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    seg_ranks_ptr,  # int32 [S]
    seg_scalings_ptr,  # float32 [S]
    row_order_ptr,  # int64 [positions] (read only when HAS_ROW_ORDER)
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1]
    num_segs,
    seg_blocks,
    col_blocks,
    num_programs,
    n_total,
    rank_max,
    x_stride_row,
    out_stride_row,
    a_stride_slot,
    a_stride_row,
    b_stride_slot,
    b_stride_row,
    y_stride_split,
    NUM_SLICES: tl.constexpr,
    HAS_ROW_ORDER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    width = NUM_SLICES * rank_max
    offs_r = tl.arange(0, BLOCK_R)

    # --- shrink: y[split, pos, slice*R + r] = x[row, K-part] A[slot, slice*R + r, K-part]^T
    for item in range(pid, seg_blocks * num_segs * NUM_SLICES * SPLIT_K, num_programs):
        split = item % SPLIT_K
        slice_id = (item // SPLIT_K) % NUM_SLICES
        seg = (item // (SPLIT_K * NUM_SLICES)) % num_segs
        blk = item // (SPLIT_K * NUM_SLICES * num_segs)
        offs_s, rows, s_mask = _segment_rows(
            seg_indptr_ptr, row_order_ptr, seg, blk, BLOCK_S, HAS_ROW_ORDER
        )
        rank = tl.minimum(tl.load(seg_ranks_ptr + seg), rank_max)
        slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        s_mask = s_mask & (rank > 0)
        r_mask = offs_r < rank
        offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * x_stride_row + offs_k[None, :]
        a_base = a_ptr + slot * a_stride_slot + (slice_id * rank_max).to(tl.int64) * a_stride_row
        a_ptrs = a_base + offs_r[None, :] * a_stride_row + offs_k[:, None]
        acc = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k_mask = (k0 + offs_k) < HIDDEN
            x_tile = tl.load(x_ptrs, mask=s_mask[:, None] & k_mask[None, :], other=0.0)
            a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        y_ptrs = y_ptr + split * y_stride_split + offs_s[:, None] * width
        y_ptrs += slice_id * rank_max + offs_r[None, :]
        tl.store(y_ptrs, acc, mask=s_mask[:, None] & (offs_r < rank_max)[None, :])

    _grid_arrive_and_wait(bar_ptr, num_programs)

    # --- expand: out[row, n] += scaling * sum_split(y) B[slot, n, :]^T, slice by slice
    for item in range(pid, seg_blocks * num_segs * col_blocks, num_programs):
        n0 = (item % col_blocks) * BLOCK_N
        seg = (item // col_blocks) % num_segs
        blk = item // (col_blocks * num_segs)
        offs_s, rows, s_mask = _segment_rows(
            seg_indptr_ptr, row_order_ptr, seg, blk, BLOCK_S, HAS_ROW_ORDER
        )
        rank = tl.minimum(tl.load(seg_ranks_ptr + seg), rank_max)
        scaling = tl.load(seg_scalings_ptr + seg)
        slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        s_mask = s_mask & (rank > 0)
        r_mask = offs_r < rank
        offs_n = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(NUM_SLICES):
            col_lo = tl.load(slice_offsets_ptr + i)
            col_hi = tl.load(slice_offsets_ptr + i + 1)
            if (col_lo < n0 + BLOCK_N) & (col_hi > n0):
                n_mask = (offs_n >= col_lo) & (offs_n < col_hi)
                y_ptrs = y_ptr + offs_s[:, None] * width + i * rank_max + offs_r[None, :]
                y_mask = s_mask[:, None] & r_mask[None, :]
                y_sum = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
                for sp in tl.static_range(SPLIT_K):
                    y_sum += tl.load(y_ptrs + sp * y_stride_split, mask=y_mask, other=0.0)
                b_ptrs = (
                    b_ptr
                    + slot * b_stride_slot
                    + offs_n[None, :].to(tl.int64) * b_stride_row
                    + offs_r[:, None]
                )
                b_tile = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                acc += tl.dot(
                    y_sum.to(b_ptr.dtype.element_ty), b_tile, input_precision=DOT_PRECISION
                )
        out_ptrs = out_ptr + rows[:, None] * out_stride_row + offs_n[None, :]
        out_mask = s_mask[:, None] & (offs_n < n_total)[None, :]
        base = tl.load(out_ptrs, mask=out_mask, other=0.0)
        result = base.to(tl.float32) + scaling * acc
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)

    _grid_leave(bar_ptr, num_programs)


def fused_apply_supported(x: torch.Tensor) -> bool:
    """One launch for ``x``'s LoRA? Compiled Triton on CUDA, decode-sized batches only."""
    return (
        x.device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and x.shape[0] <= FUSED_MAX_ROWS
    )


_SM_COUNTS: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    count = _SM_COUNTS.get(device)
    if count is None:
        count = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def lora_apply_fused(
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
    *,
    seg_ranks: torch.Tensor,
    seg_scalings: torch.Tensor,
    barrier: torch.Tensor,
) -> None:
    """``lora_apply(..., seg_ranks=, seg_scalings=)`` in one cooperative launch.

    Operands as ``lora_apply``'s, checked the same way. ``barrier`` is an int32 ``[2]`` zero
    tensor on ``x``'s device that no other launch uses concurrently (each LoRA layer owns
    one); it is zero again when the kernel ends. CUDA only (``fused_apply_supported``).
    """
    fn = "lora_apply_fused"
    check_apply_operands(
        fn,
        x,
        lora_a,
        lora_b,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order,
        slice_offsets,
        out,
        max_seg_len,
    )
    check_seg_ranks(fn, x.device, seg_slots, seg_ranks, seg_scalings)
    bar = check_tensor(
        fn, "barrier", barrier, ndim=1, dtypes=(torch.int32,), device=x.device, contiguous=True
    )
    check_dim(fn, "barrier", bar, 0, 2, "an arrival and a departure counter")
    num_slices = slice_offsets.shape[0] - 1
    rank_max = lora_a.shape[1] // num_slices
    hidden = x.shape[1]
    positions = row_order.shape[0] if row_order is not None else x.shape[0]
    num_segs = seg_slots.shape[0]
    n_total = lora_b.shape[1]
    if positions == 0 or num_segs == 0 or max_seg_len == 0 or n_total == 0:
        return
    s_cfg = shrink_config(max_seg_len, rank_max, hidden)
    e_cfg = expand_config(max_seg_len, rank_max, n_total)
    # One row block size for both halves: the expand's items read the shrink's rows.
    block_s = max(s_cfg.block_s, e_cfg.block_s)
    seg_blocks = triton.cdiv(max_seg_len, block_s)
    col_blocks = triton.cdiv(n_total, e_cfg.block_n)
    split_k = split_k_for(seg_blocks * num_segs * num_slices, hidden, s_cfg.block_k)
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), s_cfg.block_k) * s_cfg.block_k
    split_k = triton.cdiv(hidden, k_per_split)
    items = max(seg_blocks * num_segs * num_slices * split_k, seg_blocks * num_segs * col_blocks)
    programs = min(items, PROGRAMS_PER_SM * _sm_count(x.device))
    y = torch.empty(
        (split_k, positions, num_slices * rank_max), dtype=torch.float32, device=x.device
    )
    _lora_apply_fused_kernel[(programs,)](
        x,
        lora_a,
        lora_b,
        out,
        y,
        barrier,
        seg_indptr,
        seg_slots,
        seg_ranks,
        seg_scalings,
        row_order if row_order is not None else seg_indptr,
        slice_offsets,
        num_segs,
        seg_blocks,
        col_blocks,
        programs,
        n_total,
        rank_max,
        x.stride(0),
        out.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        positions * num_slices * rank_max,
        NUM_SLICES=num_slices,
        HAS_ROW_ORDER=row_order is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        HIDDEN=hidden,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        BLOCK_S=block_s,
        BLOCK_R=s_cfg.block_r,
        BLOCK_K=s_cfg.block_k,
        BLOCK_N=e_cfg.block_n,
        num_warps=4,
        launch_cooperative_grid=True,
    )
