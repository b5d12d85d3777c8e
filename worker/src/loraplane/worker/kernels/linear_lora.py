"""A decode projection with its multi-LoRA in one launch: ``out = x W^T + s (x A^T) B^T`` per
row's slot; reference: ``torch.nn.functional.linear`` plus ``reference.lora_shrink`` and
``reference.lora_expand``.

At decode a LoRA costs launches, not bytes: a shrink and an expand per projection, a few
microseconds each however little they move, and on an H200 they do not run beside the cuBLAS
GEMMs, which hold every multiprocessor (docs/performance.md). Here one kernel does the three:

- Programs take a ticket (an atomic counter) as they start. The first tickets run the shrink
  (``shrink.shrink_tile``: segments of rows per slot, K split with the serial fix-up), writing
  ``y`` by row; the rest each compute a ``BLOCK_M x BLOCK_N`` tile of the base GEMM.
- A GEMM tile, once its K loop is done, waits until every shrink program has counted itself
  done (by then long since: the shrink is a few microseconds, the K loop the whole weight
  stream), then adds its rows' LoRA in the epilogue as one dot over every slot's rank rows
  stacked (``y`` of each row placed at its own slot's columns, zero elsewhere).
- Tickets are handed out in start order, so a waiting program only ever waits for programs
  that are already running: no deadlock whatever the GPU schedules. The last program to
  finish zeroes the counters for the next launch on the stream's buffer.

Measured first by ``bench/probes/triton_gemm.py`` (a Triton GEMM keeps up with cuBLAS at 16-64
decode rows; a second dot for the shrink inside the K loop does not, which is why the shrink
runs in programs of its own). Used by the LoRA layers for decode batches of at most
``MAX_ROWS`` rows when every slot's rank rows fit ``MAX_STACK`` (``linear_lora_supported``).

Rounding: ``y`` is rounded to the weights' dtype as the separate shrink's; ``s * y B^T`` is
added to the fp32 base accumulator and the sum rounded once. Rows with no adapter get exactly
this kernel's base result (their stacked ``y`` row is zero).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    check_dim,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
    rank_block,
    segment_block,
    shrink_config,
    split_k_for,
)
from loraplane.worker.kernels.shrink import COUNT_SLOTS, check_segments, shrink_tile, split_counts

__all__ = ["MAX_ROWS", "MAX_STACK", "linear_config", "linear_lora", "linear_lora_supported"]

# Decode batches only: past 64 rows the tiles this kernel can afford outgrow shared memory
# and cuBLAS pulls ahead (bench/probes/triton_gemm.py: 174 against 150 us per Llama-3-8B
# layer at 128 rows).
MAX_ROWS = 64
# Slots x max rank stacked in the epilogue's dot; past this the B tiles it loads per program
# stop being small.
MAX_STACK = 256
# The launch's three counters at the end of the stream's fix-up count buffer (the shrink's
# tile counts use its start).
_TICKET, _Y_DONE, _EXIT = COUNT_SLOTS - 3, COUNT_SLOTS - 2, COUNT_SLOTS - 1


@triton.jit
def _linear_lora_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    a_ptr,  # [slots, NUM_SLICES * R, K]
    b_ptr,  # [slots, N, R]
    y_ptr,  # [M, NUM_SLICES * R] by row (written by the shrink programs)
    part_ptr,  # fp32 [SPLIT_K, M, NUM_SLICES * R] (when SPLIT_K > 1)
    count_ptr,  # int32 [COUNT_SLOTS], zero between launches
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    seg_ranks_ptr,  # int32 [S]
    row_order_ptr,  # int64 [positions] (read only when HAS_ROW_ORDER)
    token_slots_ptr,  # int32 [M], -1 = no adapter
    slot_ranks_ptr,  # int32 [slots]
    slot_scalings_ptr,  # float32 [slots]
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1]
    M,
    N,
    rank_max,
    num_slots,
    x_stride,
    w_stride,
    out_stride,
    a_stride_slot,
    a_stride_row,
    b_stride_slot,
    b_stride_row,
    part_stride_split,
    K: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    HAS_ROW_ORDER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SHRINK_SEGS: tl.constexpr,
    SHRINK_PROGRAMS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SHRINK_BLOCK_S: tl.constexpr,
    SHRINK_BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_BLOCKS: tl.constexpr,
    PROGRAMS: tl.constexpr,
    TICKET: tl.constexpr,
    Y_DONE: tl.constexpr,
    EXIT: tl.constexpr,
):
    ticket = tl.atomic_add(count_ptr + TICKET, 1, sem="relaxed", scope="gpu")
    if ticket < SHRINK_PROGRAMS:
        tile = ticket // SPLIT_K
        shrink_tile(
            x_ptr,
            a_ptr,
            y_ptr,
            part_ptr,
            count_ptr + tile,
            seg_indptr_ptr,
            seg_slots_ptr,
            seg_ranks_ptr,
            row_order_ptr,
            tile // (NUM_SLICES * SHRINK_SEGS),
            (tile // NUM_SLICES) % SHRINK_SEGS,
            tile % NUM_SLICES,
            ticket % SPLIT_K,
            rank_max,
            x_stride,
            NUM_SLICES * rank_max,
            a_stride_slot,
            a_stride_row,
            1,
            1,
            part_stride_split,
            HAS_ROW_ORDER,
            True,  # y by row: the GEMM tiles read their own rows
            DOT_PRECISION,
            K,
            SHRINK_BLOCK_S,
            BLOCK_R,
            SHRINK_BLOCK_K,
            SPLIT_K,
            K_PER_SPLIT,
            True,  # ranks given per segment
        )
        tl.debug_barrier()  # every thread's y (or partial) stores are issued before the release
        tl.atomic_add(count_ptr + Y_DONE, 1, sem="release", scope="gpu")
    else:
        t = ticket - SHRINK_PROGRAMS
        offs_m = (t % M_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        n0 = (t // M_BLOCKS) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

        # The LoRA: every slot's rank rows stacked, [STACK] = (slot, j) pairs.
        slice_id = 0
        for i in tl.static_range(1, NUM_SLICES):
            slice_id += (n0 >= tl.load(slice_offsets_ptr + i)).to(tl.int32)
        offs_c = tl.arange(0, STACK)
        c_slot = offs_c // rank_max
        c_j = offs_c % rank_max
        c_valid = offs_c < num_slots * rank_max
        c_rank = tl.load(slot_ranks_ptr + c_slot, mask=c_valid, other=0)
        c_live = c_valid & (c_j < c_rank)  # B and y at or beyond a slot's rank are never read
        row_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)  # [BLOCK_M]
        b_ptrs = (
            b_ptr
            + c_slot[:, None].to(tl.int64) * b_stride_slot
            + offs_n[None, :].to(tl.int64) * b_stride_row
            + c_j[:, None]
        )  # [STACK, BLOCK_N]
        b = tl.load(b_ptrs, mask=c_live[:, None] & n_mask[None, :], other=0.0)
        scaling = tl.load(slot_scalings_ptr + row_slot, mask=row_slot >= 0, other=0.0)
        # Wait for the shrink programs (acquire), then read y past L1.
        done = tl.atomic_add(count_ptr + Y_DONE, 0, sem="acquire", scope="gpu")
        while done < SHRINK_PROGRAMS:
            done = tl.atomic_add(count_ptr + Y_DONE, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        y_ptrs = (
            y_ptr
            + offs_m[:, None].to(tl.int64) * (NUM_SLICES * rank_max)
            + slice_id * rank_max
            + c_j[None, :]
        )  # [BLOCK_M, STACK]
        y_mask = m_mask[:, None] & (row_slot[:, None] == c_slot[None, :]) & c_live[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0, cache_modifier=".cg")
        delta = tl.dot(y, b, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        acc += scaling[:, None] * delta
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    left = tl.atomic_add(count_ptr + EXIT, 1, sem="acq_rel", scope="gpu")
    if left == PROGRAMS - 1:  # the last to finish: every ticket is taken, every wait over
        tl.atomic_xchg(count_ptr + TICKET, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + Y_DONE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + EXIT, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True, slots=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


def linear_config(rows: int, n: int, k: int) -> LinearConfig:
    """The GEMM tiles for ``rows`` decode rows of an ``[n, k]`` weight.

    From the H200 sweep of ``bench/probes/triton_gemm.py`` at Llama-3-8B's shapes (session 6):
    one row block; 256-wide K steps at 16 rows, 128 past; 128 columns per program for a wide
    projection (gate_up), 32 for a long K (down), 64 (or 32 past 16 rows at N 4096) otherwise.
    """
    block_m = max(16, next_power_of_2(rows))
    small = block_m <= 16
    if n >= 16384:
        block_n, block_k, stages = (128 if small else 64), 128, 3
    elif k >= 8192:
        block_n, block_k, stages = 32, (256 if small else 128), 5
    else:
        block_n = 64 if small or n > 4096 else 32
        block_k, stages = (256 if small else 128), 5
    block_n = min(block_n, max(16, next_power_of_2(n)))
    block_k = min(block_k, max(16, next_power_of_2(k)))
    return LinearConfig(block_m, block_n, block_k, stages, 4)


def linear_lora_supported(
    rows: int, slice_widths: list[int], k: int, num_slots: int, rank_max: int
) -> bool:
    """Whether ``linear_lora`` takes this batch and projection: at most ``MAX_ROWS`` rows,
    ``num_slots * rank_max`` within ``MAX_STACK``, and no column block straddling two slices."""
    if rows < 1 or rows > MAX_ROWS or num_slots * rank_max > MAX_STACK or rank_max < 1:
        return False
    config = linear_config(rows, sum(slice_widths), k)
    return all(w % config.block_n == 0 for w in slice_widths)


def linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: torch.Tensor,
    slice_widths: list[int],
    token_slots: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    seg_ranks: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    max_seg_len: int,
) -> torch.Tensor:
    """``x W^T`` plus each row's own slot's ``s (x A^T) B^T``, as a new ``[M, N]`` tensor.

    The LoRA operands are the layers' and the batch info's (``lora_apply``'s, with
    ``seg_ranks`` given and ``token_slots [M]``: each row's slot, -1 = none, consistent with the
    segments). ``slice_widths``: the host's widths of the slices ``slice_offsets`` holds.
    Requires ``linear_lora_supported``. No host sync: capturable in a CUDA graph.
    """
    fn = "linear_lora"
    x = check_tensor(
        fn, "x", x, ndim=2, dtypes=(torch.float16, torch.bfloat16), unit_last_stride=True
    )
    weight = check_tensor(
        fn, "weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device, unit_last_stride=True
    )
    check_dim(fn, "weight", weight, 1, x.shape[1], "the hidden size of x")
    m, k = x.shape
    n = weight.shape[0]
    num_slices = len(slice_widths)
    for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        check_tensor(fn, name, t, ndim=3, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_same_dtype(fn, name, t, "x", x.dtype)
    num_slots, rank_max = lora_b.shape[0], lora_b.shape[2]
    check_dim(fn, "lora_b", lora_b, 1, n, "the output size of weight")
    check_dim(fn, "lora_a", lora_a, 1, num_slices * rank_max, "len(slice_widths) * max rank")
    check_dim(fn, "lora_a", lora_a, 2, k, "the hidden size of x")
    check_dim(fn, "slice_offsets", slice_offsets, 0, num_slices + 1, "len(slice_widths) + 1")
    if sum(slice_widths) != n:
        raise ValueError(f"{fn}: slice_widths {slice_widths} must add up to N = {n}")
    check_segments(fn, x.device, seg_indptr, seg_slots, slot_ranks, row_order, num_slots)
    check_dim(fn, "token_slots", token_slots, 0, m, "one slot per row of x")
    if not linear_lora_supported(m, slice_widths, k, num_slots, rank_max):
        raise ValueError(
            f"{fn}: not supported for {m} rows, slices {slice_widths}, {num_slots} slots of "
            f"rank {rank_max} (see linear_lora_supported); use the separate shrink and expand"
        )
    config = linear_config(m, n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)

    # The shrink programs, as launch_shrink would size them, writing y by row.
    shrink = shrink_config(max_seg_len, rank_max, k, x.element_size())
    shrink_segs = seg_slots.shape[0]
    tiles = triton.cdiv(max(max_seg_len, 1), segment_block(max_seg_len)) * shrink_segs * num_slices
    split_k = split_k_for(tiles, k, shrink.block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), shrink.block_k) * shrink.block_k
    split_k = triton.cdiv(k, k_per_split)
    width = num_slices * rank_max
    y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    parts = (
        torch.empty((split_k, m, width), dtype=torch.float32, device=x.device) if split_k > 1 else y
    )
    assert tiles <= _TICKET, f"{tiles} shrink tiles, fix-up counts for {_TICKET}"
    counts = split_counts(x.device)
    m_blocks = triton.cdiv(m, config.block_m)
    shrink_programs = tiles * split_k
    programs = shrink_programs + m_blocks * triton.cdiv(n, config.block_n)
    _linear_lora_kernel[(programs,)](
        x,
        weight,
        out,
        lora_a,
        lora_b,
        y,
        parts,
        counts,
        seg_indptr,
        seg_slots,
        seg_ranks,
        row_order if row_order is not None else seg_indptr,
        token_slots,
        slot_ranks,
        slot_scalings,
        slice_offsets,
        m,
        n,
        rank_max,
        num_slots,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        m * width,
        K=k,
        NUM_SLICES=num_slices,
        HAS_ROW_ORDER=row_order is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        SHRINK_SEGS=shrink_segs,
        SHRINK_PROGRAMS=shrink_programs,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        SHRINK_BLOCK_S=shrink.block_s,
        SHRINK_BLOCK_K=shrink.block_k,
        BLOCK_R=rank_block(rank_max),
        STACK=max(16, next_power_of_2(num_slots * rank_max)),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        M_BLOCKS=m_blocks,
        PROGRAMS=programs,
        TICKET=_TICKET,
        Y_DONE=_Y_DONE,
        EXIT=_EXIT,
        num_stages=config.num_stages,
        num_warps=config.num_warps,
    )
    return out
