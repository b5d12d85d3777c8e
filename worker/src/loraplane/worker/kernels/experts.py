"""The base routed experts on the device: one grouped GEMM per projection, no host sync.

``out[p] = x[p // x_row_div] @ w[expert(p)]^T`` for every ``(token, k)`` pair ``p``. The pairs
are grouped by expert on the device by the same counting sort the expert LoRA uses
(``moe_lora_routing`` with one slot), and the kernel runs over its tile map: tile ``t`` holds
the pairs ``tile_rows[t * BLOCK_M:][:tile_len[t]]`` of expert ``tile_seg[t]`` (``-1`` = padding,
the program returns).
Because the number of tiles has a host-known bound, nothing is read back to the host, so a
decode step of an MoE model can be captured in a CUDA graph.

Reference: ``Experts.grouped`` (one torch matmul per expert present), which the CPU path
keeps (docs/adr/0001-batch-invariant-experts.md).

``moe_combine`` sums each token's top-k pair outputs weighted by the router (plus a LoRA's
per-pair output), one token per program in a fixed order; reference: ``reference.moe_combine``.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MIN_DOT_BLOCK,
    cdiv,
    check_dim,
    check_interpretable,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
)
from loraplane.worker.kernels.moe import MoeLoraRouting, moe_lora_routing

# Under Triton's interpreter (the CPU) ``tl.dot`` is numpy's matmul, and a BLAS kernel may
# round a row differently by its place in the tile (OpenBLAS's AVX2 sgemm does). A grouped
# GEMM's tile holds whichever pairs routed to its expert, so a pair's bits would depend on
# other tokens' routing: a row with no adapter would differ from the same row of a batch
# without LoRA (docs/adr/0001-batch-invariant-experts.md). There ``_dot_over_k`` sums
# elementwise products over K instead, the same sums for every row of a tile. Triton reads
# ``TRITON_INTERPRET`` when a kernel is defined, as this module is imported.
ROWWISE_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

__all__ = [
    "ExpertLoRA",
    "expert_block_m",
    "moe_combine",
    "moe_expert_routing",
    "moe_experts_lora",
    "moe_grouped_matmul",
]


@triton.jit
def _tile_lora_rows(slot_ptr, ranks_ptr, scal_ptr, pairs, m_mask, slot_div):
    """Each row's slot (its token's), rank and scaling, and whether it has a LoRA (a slot
    of rank > 0): one round trip after the rows' slots."""
    slots = tl.load(slot_ptr + pairs // slot_div, mask=m_mask, other=-1)
    has_slot = m_mask & (slots >= 0)
    ranks = tl.load(ranks_ptr + slots, mask=has_slot, other=0)
    scales = tl.load(scal_ptr + slots, mask=has_slot, other=0.0).to(tl.float32)
    return slots, ranks, scales, has_slot & (ranks > 0)


@triton.jit
def _next_slot(slots, ranks, todo):
    """One pass of a tile's per-slot loop: the smallest slot among the rows still to do,
    its rows and its rank (from registers: no round trip)."""
    slot = tl.min(tl.where(todo, slots, 2147483647), 0)
    rows = todo & (slots == slot)
    return slot, rows, tl.max(tl.where(rows, ranks, 0), 0)


@triton.jit
def _skip_slots(slots, todo, n, N_MAX: tl.constexpr):
    """``todo`` without the rows of its ``n <= N_MAX`` smallest slots (from registers: no
    round trip), so that each of a tile's ``SPLIT`` programs takes every ``SPLIT``-th pass.
    (A compile-time loop bound: a runtime one breaks Triton 3.6's interpreter.)"""
    for i in tl.static_range(N_MAX):
        smallest = tl.min(tl.where(todo, slots, 2147483647), 0)  # (none left: no row's)
        todo = todo & ((slots != smallest) | (i >= n))
    return todo


@triton.jit
def _dot_over_k(
    x_ptrs,  # [BLOCK_M, BLOCK_K] at k = 0
    w_ptrs,  # [BLOCK_K, BLOCK_N] at k = 0
    m_mask,
    n_mask,
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``x @ w`` over K in ``BLOCK_K`` steps, fp32 (K a compile-time constant: the loop is
    unrolled). Each row's sums do not depend on the tile's other rows or on the row's place
    in the tile (``ROWWISE_DOT`` under the interpreter)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_mask = (k0 + offs_k) < HIDDEN
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if ROWWISE_DOT:
            prod = x_tile.to(tl.float32)[:, :, None] * w_tile.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=1)
        else:
            acc += tl.dot(x_tile, w_tile, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _shrink_tile(
    x_ptr,
    a_ptr,  # [S * E, SLICES * RANK, HIDDEN]
    y_ptr,  # [P, SLICES * RANK]
    slot_ptr,
    ranks_ptr,
    scal_ptr,
    pairs,
    m_mask,
    expert,
    num_experts,
    x_row_div,
    slot_div,
    x_stride_row,
    y_stride_row,
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,
    RANK: tl.constexpr,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    part,
    SPLIT: tl.constexpr,
):
    """``y[p] = x[p // x_row_div] @ A[slot(p), expert]^T`` for the tile's rows with a LoRA:
    one pass over K per distinct slot in the tile (one at decode with one adapter), the
    passes ``part``, ``part + SPLIT``, ... in slot order (``SPLIT`` programs share them)."""
    slots, ranks, _, todo = _tile_lora_rows(slot_ptr, ranks_ptr, scal_ptr, pairs, m_mask, slot_div)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, BLOCK_R)  # y's columns: slice * RANK + r
    c_in = offs_c < SLICES * RANK
    x_rows = x_ptr + (pairs // x_row_div)[:, None] * x_stride_row
    y_ptrs = y_ptr + pairs[:, None] * y_stride_row + offs_c[None, :]
    if SPLIT > 1:
        todo = _skip_slots(slots, todo, part, SPLIT - 1)
    while tl.max(todo.to(tl.int32), 0) > 0:
        slot, rows, rank = _next_slot(slots, ranks, todo)
        c_mask = c_in & (offs_c % RANK < rank)  # no bytes for the rank's padding
        weight = (slot * num_experts + expert).to(tl.int64)
        a_ptrs = a_ptr + weight * (SLICES * RANK * HIDDEN) + offs_c[None, :] * HIDDEN
        a_ptrs += offs_k[:, None]  # [BLOCK_K, BLOCK_R]
        acc = _dot_over_k(
            x_rows + offs_k[None, :], a_ptrs, rows, c_mask, DOT_PRECISION, HIDDEN, BLOCK_M,
            BLOCK_R, BLOCK_K,
        )  # fmt: skip
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rows[:, None] & c_in[None, :])
        todo = todo & (slots != slot)
        if SPLIT > 1:
            todo = _skip_slots(slots, todo, SPLIT - 1, SPLIT - 1)


@triton.jit
def _grouped_matmul_kernel(
    x_ptr,  # [rows of x, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]
    tile_seg_ptr,  # int32 [tiles]: expert of the tile, -1 = padding
    tile_len_ptr,  # int32 [tiles]: pairs in the tile
    tile_rows_ptr,  # int64 [tiles * BLOCK_M]: the tile's pairs (the first tile_len)
    lora_w_ptr,  # LORA 1: A [S * E, SLICES * RANK, K]; LORA 2: B [S * E, N, RANK]
    y_ptr,  # LORA 1: y [P, SLICES * RANK] out; LORA 2: y partials [Y_PARTS, P, RANK] fp32 in
    delta_ptr,  # LORA 2: [P, N] out, each pair's scaled LoRA (zero on pairs without one)
    slot_ptr,  # int32 [>= P // slot_div]: each token's slot, -1 = none (LORA > 0)
    ranks_ptr,  # int32 [S]
    scal_ptr,  # [S] scalings (LORA 2)
    n_out,
    x_stride_row,
    w_stride_expert,
    w_stride_row,
    out_stride_row,
    x_row_div,  # x row = pair // x_row_div (top-k: the pair's token)
    slot_div,  # slot of pair p at p // slot_div
    num_experts,
    y_stride_row,
    y_stride_part,
    lora_stride_w,
    delta_stride_row,
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,  # K; constexpr (a runtime loop bound breaks the 3.6 interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    # 0 none; 1 the shrink in program columns 0 .. LORA_COLS - 1 (they share the tile's
    # per-slot passes); 2 the expand in program columns 0 .. LORA_COLS - 1, EXPAND_CHUNKS
    # blocks of N each, into delta
    LORA: tl.constexpr,
    RANK: tl.constexpr,
    SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    Y_PARTS: tl.constexpr,
    LORA_COLS: tl.constexpr,
    EXPAND_CHUNKS: tl.constexpr,
):
    # The tile's expert, length and pairs in one round trip; x and w in the next.
    tile = tl.program_id(0)
    expert = tl.load(tile_seg_ptr + tile)
    n_rows = tl.load(tile_len_ptr + tile)
    pairs = tl.load(tile_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    if expert < 0:
        return
    m_mask = tl.arange(0, BLOCK_M) < n_rows
    pairs = tl.where(m_mask, pairs, 0)
    pid_n = tl.program_id(1)
    # (nested ifs: the constexpr test removes the branch from the other modes' code)
    if LORA == 1:  # noqa: SIM102
        # The first LORA_COLS columns of the grid are the tile's LoRA shrink: the first
        # programs to start, as the longest (one pass over K per distinct slot).
        if pid_n < LORA_COLS:
            _shrink_tile(
                x_ptr, lora_w_ptr, y_ptr, slot_ptr, ranks_ptr, scal_ptr, pairs, m_mask, expert,
                num_experts, x_row_div, slot_div, x_stride_row, y_stride_row, DOT_PRECISION,
                HIDDEN, RANK, SLICES, BLOCK_M, BLOCK_R, BLOCK_K, pid_n, LORA_COLS,
            )  # fmt: skip
            return
    if LORA == 2:  # noqa: SIM102
        # The first LORA_COLS columns are the tile's LoRA expand, started first; the base
        # columns keep the plain store (an epilogue waiting on the rows' slots, their
        # shrink and B would hold each program's 255 registers through those round trips).
        if pid_n < LORA_COLS:
            _expand_tile(
                y_ptr, lora_w_ptr, delta_ptr, slot_ptr, ranks_ptr, scal_ptr, pairs, m_mask,
                expert, pid_n, n_out, num_experts, slot_div, y_stride_row, y_stride_part,
                lora_stride_w, delta_stride_row, DOT_PRECISION, RANK, BLOCK_M, BLOCK_N, BLOCK_R,
                Y_PARTS, EXPAND_CHUNKS,
            )  # fmt: skip
            return
    pid_n -= LORA_COLS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // x_row_div)[:, None] * x_stride_row + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * w_stride_expert
    w_ptrs = w_base + offs_n[None, :].to(tl.int64) * w_stride_row + offs_k[:, None]  # [BK, BN]
    acc = _dot_over_k(
        x_ptrs, w_ptrs, m_mask, n_mask, DOT_PRECISION, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K
    )
    out_ptrs = out_ptr + pairs[:, None] * out_stride_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_tile(
    y_ptr,  # [Y_PARTS, P, RANK] fp32: the partial shrinks
    b_ptr,  # [S * E, N, RANK]
    delta_ptr,  # [P, N] out
    slot_ptr,
    ranks_ptr,
    scal_ptr,
    pairs,
    m_mask,
    expert,
    pid,
    n_out,
    num_experts,
    slot_div,
    y_stride_row,
    y_stride_part,
    b_stride_w,
    delta_stride_row,
    DOT_PRECISION: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    Y_PARTS: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """``delta = scaling * (sum of the partials) @ B[slot, expert]^T`` for the tile's rows
    over ``CHUNKS`` blocks of N (block ``pid * CHUNKS`` on), rounded once; zero on rows
    without a LoRA. One pass per distinct slot; a pass's loads of B are unrolled, so they
    leave together."""
    slots, ranks, scales, lora = _tile_lora_rows(
        slot_ptr, ranks_ptr, scal_ptr, pairs, m_mask, slot_div
    )
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + pairs[:, None] * y_stride_row + offs_r[None, :]
    y_mask = lora[:, None] & (offs_r < RANK)[None, :]
    y = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for part in tl.static_range(Y_PARTS):  # a fixed order, whatever the batch
        y += tl.load(y_ptrs + part * y_stride_part, mask=y_mask, other=0.0)
    n0 = pid * (CHUNKS * BLOCK_N)
    d_ptrs = delta_ptr + pairs[:, None] * delta_stride_row
    none = m_mask & ~lora
    for c in tl.static_range(CHUNKS):
        offs_n = n0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=delta_ptr.dtype.element_ty)
        tl.store(d_ptrs + offs_n[None, :], zero, mask=none[:, None] & (offs_n < n_out)[None, :])
    todo = lora
    while tl.max(todo.to(tl.int32), 0) > 0:
        slot, rows, rank = _next_slot(slots, ranks, todo)
        weight = (slot * num_experts + expert).to(tl.int64)
        b_base = b_ptr + weight * b_stride_w + offs_r[:, None]
        y_rows = tl.where(rows[:, None], y, 0.0).to(b_ptr.dtype.element_ty)
        for c in tl.static_range(CHUNKS):
            offs_n = n0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_out
            b_tile = tl.load(
                b_base + offs_n[None, :].to(tl.int64) * RANK,
                mask=(offs_r < rank)[:, None] & n_mask[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_N]
            delta = tl.dot(y_rows, b_tile, input_precision=DOT_PRECISION) * scales[:, None]
            tl.store(
                d_ptrs + offs_n[None, :],
                delta.to(delta_ptr.dtype.element_ty),
                mask=rows[:, None] & n_mask[None, :],
            )
        todo = todo & (slots != slot)


@triton.jit
def _experts_silu_mul_lora_kernel(
    gu_ptr,  # [P, 2I]: gate | up, the base gate_up GEMM's output
    act_ptr,  # [P, I] out
    y_ptr,  # [P, 2 * RANK]: gate_up's shrink (gate | up)
    b_ptr,  # [S * E, 2I, RANK]: gate_up's B
    a_ptr,  # [S * E, RANK, I]: down's A
    part_ptr,  # [parts, P, RANK] fp32 out: down's shrink over this program's block of I
    pair_expert_ptr,  # int32 [P]
    slot_ptr,
    ranks_ptr,
    scal_ptr,
    inter,
    gu_stride_row,
    act_stride_row,
    y_stride_row,
    b_stride_w,
    a_stride_w,
    part_stride_part,
    part_stride_row,
    num_experts,
    slot_div,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One pair x one block of I: gate_up's LoRA expand added to gate and up (fp32), the
    SwiGLU, and down's LoRA shrink over this block of I (a partial the down GEMM's LoRA
    columns sum in a fixed order). A pair without a LoRA gets the plain SwiGLU, bit for bit,
    and no partial. One pair per program, no per-slot loop: gate, up, B and A leave one
    round trip after the pair's expert and slot (B and A are zero past a slot's rank, so
    they are not masked by it; a slot of rank 0 reads its buffers and discards them), y
    with the rank. No branch on the slot: 79 registers for sm_90 (branches on the slot and
    the rank took 118; y loaded with B, 96)."""
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_r = tl.arange(0, BLOCK_R)
    r_in = offs_r < RANK
    expert = tl.load(pair_expert_ptr + pair)
    slot = tl.load(slot_ptr + pair // slot_div)
    has = slot >= 0
    rank = tl.load(ranks_ptr + slot, mask=has, other=0)
    scale = tl.load(scal_ptr + slot, mask=has, other=0.0).to(tl.float32)
    weight = (tl.maximum(slot, 0) * num_experts + expert).to(tl.int64)
    w_mask = n_mask[:, None] & r_in[None, :] & has
    b_ptrs = b_ptr + weight * b_stride_w + offs_n[:, None] * RANK + offs_r[None, :]
    a_ptrs = a_ptr + weight * a_stride_w + offs_r[None, :] * inter + offs_n[:, None]
    b_gate = tl.load(b_ptrs, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    b_up = tl.load(b_ptrs + inter * RANK, mask=w_mask, other=0.0).to(tl.float32)
    a_tile = tl.load(a_ptrs, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    g_ptrs = gu_ptr + pair * gu_stride_row + offs_n
    gate = tl.load(g_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    up = tl.load(g_ptrs + inter, mask=n_mask, other=0.0).to(tl.float32)
    lora = rank > 0
    y_ptrs = y_ptr + pair * y_stride_row + offs_r
    y_gate = tl.load(y_ptrs, mask=r_in & lora, other=0.0).to(tl.float32)
    y_up = tl.load(y_ptrs + RANK, mask=r_in & lora, other=0.0).to(tl.float32)
    g = gate + tl.sum(b_gate * y_gate[None, :], axis=1) * scale
    u = up + tl.sum(b_up * y_up[None, :], axis=1) * scale
    act = tl.where(lora, g / (1.0 + tl.exp(-g)) * u, gate / (1.0 + tl.exp(-gate)) * up)
    rounded = act.to(act_ptr.dtype.element_ty)
    part = tl.sum(a_tile * rounded.to(tl.float32)[:, None], axis=0)  # [BLOCK_R]
    part_ptrs = part_ptr + tl.program_id(1) * part_stride_part + pair * part_stride_row
    tl.store(part_ptrs + offs_r, part, mask=r_in & lora)
    tl.store(act_ptr + pair * act_stride_row + offs_n, rounded, mask=n_mask)


@triton.jit
def _combine_kernel(
    d_ptr,  # [T * TOPK, H]: each pair's expert output
    delta_ptr,  # [T * TOPK, H] added to d first (read only when HAS_DELTA)
    w_ptr,  # [T, TOPK] contiguous: the router's weights
    out_ptr,  # [T, H]
    hidden,
    d_stride_row,
    delta_stride_row,
    out_stride_row,
    TOPK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One token per program row: its pairs in a fixed order, so a token's result does not
    # depend on the batch around it (docs/adr/0001-batch-invariant-experts.md).
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = token * TOPK + j
        value = tl.load(d_ptr + pair * d_stride_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            value += tl.load(delta_ptr + pair * delta_stride_row + offs, mask=mask, other=0.0).to(
                tl.float32
            )
        acc += tl.load(w_ptr + pair).to(tl.float32) * value
    tl.store(out_ptr + token * out_stride_row + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(
    d: torch.Tensor, topk_weights: torch.Tensor, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``out [T, H]``: each token's ``k`` pair outputs weighted by the router, ``sum_j
    w[t, j] * (d + delta)[t * k + j]`` in fp32, rounded once; one launch (torch takes a
    multiply and a sum). ``d`` and ``delta`` (a LoRA's per-pair output, e.g.) ``[T * k, H]``,
    ``topk_weights [T, k]``. Reference: ``reference.moe_combine``."""
    fn = "moe_combine"
    d = check_tensor(fn, "d", d, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "d", d)
    weights = check_tensor(
        fn, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=d.device
    )
    tokens, topk = weights.shape
    if tokens * topk != d.shape[0]:
        raise ValueError(
            f"{fn}: d must have one row per (token, k) pair: topk_weights {tuple(weights.shape)} "
            f"gives {tokens * topk} pairs, d has shape {tuple(d.shape)}"
        )
    if delta is not None:
        check_tensor(
            fn, "delta", delta, ndim=2, dtypes=(d.dtype,), device=d.device, unit_last_stride=True
        )
        if delta.shape != d.shape:
            raise ValueError(
                f"{fn}: delta must have the shape of d {tuple(d.shape)}, got {tuple(delta.shape)}"
            )
    hidden = d.shape[1]
    out = d.new_empty(tokens, hidden)
    if tokens == 0 or hidden == 0:
        return out
    block_h = min(1024, next_power_of_2(hidden))
    _combine_kernel[(tokens, cdiv(hidden, block_h))](
        d,
        delta if delta is not None else d,
        weights.contiguous(),
        out,
        hidden,
        d.stride(0),
        delta.stride(0) if delta is not None else 0,
        out.stride(0),
        TOPK=topk,
        HAS_DELTA=delta is not None,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


def expert_block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per tile: 16 at decode (a few pairs per expert), up to 64 when experts fill up."""
    per_expert = cdiv(num_pairs, max(1, num_experts))
    return min(64, max(MIN_DOT_BLOCK, next_power_of_2(per_expert)))


def moe_expert_routing(
    pair_expert: torch.Tensor, num_experts: int, block_m: int | None = None
) -> MoeLoraRouting:
    """Pairs grouped by expert on the device (one launch); reuse it for gate_up and down."""
    fn = "moe_expert_routing"
    check_tensor(fn, "pair_expert", pair_expert, ndim=1, dtypes=(torch.int32,), contiguous=True)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be an int >= 1, got {num_experts!r}")
    if block_m is None:
        block_m = expert_block_m(pair_expert.shape[0], num_experts)
    return moe_lora_routing(pair_expert, None, 1, num_experts, block_s=block_m)


def moe_grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    routing: MoeLoraRouting,
    x_row_div: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [P, N]``: pair ``p`` times the weight of its expert, ``x[p // x_row_div] @ w[e]^T``.

    ``w [E, N, K]``; ``routing`` from ``moe_expert_routing`` over the ``P`` pairs; ``x`` has
    ``P // x_row_div`` rows (``x_row_div`` = top-k reads each token once per pair, with no
    gathered copy of ``x``). Every pair's row of ``out`` is written.
    """
    fn = "moe_grouped_matmul"
    x, w = _check_grouped(fn, x, w, routing, x_row_div)
    num_pairs = routing.row_order.shape[0]
    if out is None:
        out = x.new_empty(num_pairs, w.shape[1])
    else:
        check_tensor(fn, "out", out, ndim=2, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_dim(fn, "out", out, 0, num_pairs, "one row per routed pair")
        check_dim(fn, "out", out, 1, w.shape[1], "w.shape[1]")
    _launch_grouped(x, w, out, routing, x_row_div)
    return out


def _check_grouped(
    fn: str,
    x: torch.Tensor,
    w: torch.Tensor,
    routing: MoeLoraRouting,
    x_row_div: int,
    w_name: str = "w",
    div_name: str = "x_row_div",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of one grouped GEMM; errors use the caller's names for ``w`` and
    ``x_row_div``."""
    x = check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "x", x)
    w = check_tensor(fn, w_name, w, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_same_dtype(fn, w_name, w, "x", x.dtype)
    check_dim(fn, w_name, w, 2, x.shape[1], "the hidden size of x")
    if not isinstance(routing, MoeLoraRouting) or routing.num_slots != 1:
        raise ValueError(f"{fn}: routing must come from moe_expert_routing, got {routing!r}")
    if routing.num_experts != w.shape[0]:
        raise ValueError(
            f"{fn}: routing was built for {routing.num_experts} experts, {w_name} has {w.shape[0]}"
        )
    if isinstance(x_row_div, bool) or not isinstance(x_row_div, int) or x_row_div < 1:
        raise ValueError(f"{fn}: {div_name} must be an int >= 1, got {x_row_div!r}")
    num_pairs = routing.row_order.shape[0]
    if x.shape[0] * x_row_div != num_pairs:
        raise ValueError(
            f"{fn}: x.shape[0] * {div_name} must equal the routed pairs, got "
            f"{x.shape[0]} * {x_row_div} != {num_pairs}"
        )
    return x, w


def _launch_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routing: MoeLoraRouting,
    x_row_div: int,
    lora: ExpertLoRA | None = None,
    lora_mode: int = 0,
    y: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> None:
    """The grouped GEMM; ``lora_mode`` 1: gate_up's shrink into ``y`` in the first program
    columns (``shrink_split``);
    2: down's expand of the partial shrinks ``y [parts, P, R]`` into ``delta [P, N]`` in the
    first program columns (``EXPAND_CHUNKS`` blocks of N each)."""
    num_pairs, tiles = routing.row_order.shape[0], routing.tile_seg.shape[0]
    if num_pairs == 0 or tiles == 0:
        return
    n_out, hidden = w.shape[1], w.shape[2]
    block_m = routing.block_s
    block_n = min(64 if block_m <= 16 else 128, max(MIN_DOT_BLOCK, next_power_of_2(n_out)))
    block_k = min(128, max(MIN_DOT_BLOCK, next_power_of_2(hidden)))
    n_blocks = cdiv(n_out, block_n)
    rank, slices, block_r, parts, lora_cols, chunks = 1, 1, MIN_DOT_BLOCK, 1, 0, 1
    y_strides, lora_stride = (0, 0), 0
    if lora is None:
        lora_w, y_arg, slots, ranks, scalings, slot_div = (
            w,
            out,
            routing.tile_len,
            routing.tile_len,
            out,
            1,
        )
    else:
        assert y is not None
        slots, ranks, scalings, slot_div = (
            lora.token_slots,
            lora.slot_ranks,
            lora.slot_scalings,
            lora.topk,
        )
        rank, y_arg = lora.rank, y
        if lora_mode == 1:
            lora_w, slices, lora_cols = lora.a_gate_up, 2, shrink_split(lora.adapters)
            y_strides = (y.stride(0), 0)
        else:
            assert delta is not None
            lora_w, parts = lora.b_down, y.shape[0]
            chunks = min(EXPAND_CHUNKS, n_blocks)
            lora_cols = cdiv(n_blocks, chunks)
            y_strides = (y.stride(1), y.stride(0))
        lora_stride = lora_w.stride(1)
        block_r = max(MIN_DOT_BLOCK, next_power_of_2(slices * rank))
    _grouped_matmul_kernel[(tiles, n_blocks + lora_cols)](
        x,
        w,
        out,
        routing.tile_seg,
        routing.tile_len,
        routing.tile_rows,
        lora_w,
        y_arg,
        delta if delta is not None else out,
        slots,
        ranks,
        scalings,
        n_out,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        x_row_div,
        slot_div,
        routing.num_experts,
        y_strides[0],
        y_strides[1],
        lora_stride,
        delta.stride(0) if delta is not None else 0,
        DOT_PRECISION=dot_precision(x.dtype),
        HIDDEN=hidden,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        LORA=lora_mode,
        RANK=rank,
        SLICES=slices,
        BLOCK_R=block_r,
        Y_PARTS=parts,
        LORA_COLS=lora_cols,
        EXPAND_CHUNKS=chunks,
        num_warps=4,
    )


@dataclass(frozen=True, slots=True)
class ExpertLoRA:
    """The routed experts' LoRA as the fused kernels read it (``lora.layers.ExpertsLoRA``).

    Weights per (slot, expert), ``R`` the buffers' max rank: ``a_gate_up [S, E, 2R, H]``
    (gate rows, then up rows), ``b_gate_up [S, E, 2I, R]``, ``a_down [S, E, R, I]``,
    ``b_down [S, E, H, R]``; all contiguous, and zero past each slot's rank (as the runtime
    keeps them): the SwiGLU reads B and A whole. Pair ``p`` is token ``p // topk`` and has the
    slot ``token_slots[p // topk]`` (``-1``: no adapter); ``slot_ranks`` int32 ``[S]`` (a
    slot of rank 0 adds nothing), ``slot_scalings [S]``.
    """

    a_gate_up: torch.Tensor
    b_gate_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    token_slots: torch.Tensor
    slot_ranks: torch.Tensor
    slot_scalings: torch.Tensor
    topk: int
    # Distinct adapters in the batch, or a bound on them (a decode graph's segments): it sizes
    # the programs that share each expert tile's gate_up shrink (``shrink_split``).
    adapters: int = 1

    @property
    def rank(self) -> int:
        return int(self.a_down.shape[2])

    def check(self, fn: str, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """``ValueError`` naming the operand unless the buffers fit the experts' weights."""
        a_down = check_tensor(
            fn, "lora.a_down", self.a_down, ndim=4, dtypes=FLOAT_DTYPES, device=w_gate_up.device
        )
        if a_down.shape[2] < 1:
            raise ValueError(
                f"{fn}: lora.a_down must have a max rank (dim 2) >= 1, got {tuple(a_down.shape)}"
            )
        num_slots, e, r = a_down.shape[0], w_gate_up.shape[0], self.rank
        inter, hidden = w_down.shape[2], w_down.shape[1]
        expected = {
            "a_gate_up": (num_slots, e, 2 * r, hidden),
            "b_gate_up": (num_slots, e, 2 * inter, r),
            "a_down": (num_slots, e, r, inter),
            "b_down": (num_slots, e, hidden, r),
        }
        for name, shape in expected.items():
            tensor = check_tensor(
                fn,
                f"lora.{name}",
                getattr(self, name),
                ndim=4,
                dtypes=(w_gate_up.dtype,),
                device=w_gate_up.device,
                contiguous=True,
            )
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{fn}: lora.{name} must have shape {shape} (slots, experts, ...) for "
                    f"these experts' weights, got {tuple(tensor.shape)}"
                )
        for name, dtypes, size in (
            ("token_slots", (torch.int32,), None),
            ("slot_ranks", (torch.int32,), num_slots),
            ("slot_scalings", FLOAT_DTYPES, num_slots),
        ):
            tensor = check_tensor(
                fn,
                f"lora.{name}",
                getattr(self, name),
                ndim=1,
                dtypes=dtypes,
                device=w_gate_up.device,
                contiguous=True,
            )
            if size is not None:
                check_dim(fn, f"lora.{name}", tensor, 0, size, "one per slot")
        for name in ("topk", "adapters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: lora.{name} must be an int >= 1, got {value!r}")


# The fused SwiGLU's block of I: fixed, so the down shrink's partials (one per block) are
# summed in the same order whatever the batch.
SILU_BLOCK_N = 128
# Blocks of N per program of down's LoRA expand (its loads of B leave together).
EXPAND_CHUNKS = 8
# With many adapters an expert tile's rows hold several slots, and gate_up's LoRA shrink
# makes one pass over K per distinct slot. From SHRINK_SPLIT_FROM adapters in the batch,
# SHRINK_SPLIT programs share each tile's passes; below it one program does them all (a
# second one cost 0.3-3 us a layer with 4 adapters), and down's expand stays one program per
# group of blocks (splitting it cost more than it saved). Measured at Qwen3-30B-A3B's shapes,
# 16 adapters: docs/kernels.md, docs/performance.md. A decode graph counts its adapters in
# powers of two (its segments), so there batches of 5-7 adapters split too (not measured).
SHRINK_SPLIT_FROM = 8
SHRINK_SPLIT = 2


def shrink_split(adapters: int) -> int:
    """Programs sharing an expert tile's gate_up LoRA shrink, for a batch of (up to)
    ``adapters`` distinct adapters."""
    return SHRINK_SPLIT if adapters >= SHRINK_SPLIT_FROM else 1


def _launch_silu_lora(
    gu: torch.Tensor,
    act: torch.Tensor,
    y: torch.Tensor,
    partials: torch.Tensor,
    pair_expert: torch.Tensor,
    routing: MoeLoraRouting,
    lora: ExpertLoRA,
) -> None:
    """The fused SwiGLU (``moe_experts_lora``'s step 2), one pair x one block of I a program."""
    num_pairs, parts = gu.shape[0], partials.shape[0]
    inter, rank = act.shape[1], lora.rank
    _experts_silu_mul_lora_kernel[(num_pairs, parts)](
        gu,
        act,
        y,
        lora.b_gate_up,
        lora.a_down,
        partials,
        pair_expert,
        lora.token_slots,
        lora.slot_ranks,
        lora.slot_scalings,
        inter,
        gu.stride(0),
        act.stride(0),
        y.stride(0),
        lora.b_gate_up.stride(1),
        lora.a_down.stride(1),
        partials.stride(0),
        partials.stride(1),
        routing.num_experts,
        lora.topk,
        RANK=rank,
        BLOCK_N=SILU_BLOCK_N,
        BLOCK_R=max(MIN_DOT_BLOCK, next_power_of_2(rank)),
        num_warps=4,
    )


def moe_experts_lora(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    pair_expert: torch.Tensor,
    routing: MoeLoraRouting,
    lora: ExpertLoRA,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, delta)``, both ``[P, H]``: the routed experts' outputs with each pair's LoRA on
    gate_up, and down's LoRA per pair, ``d + delta`` being the pair's output (the top-k
    combine adds them: ``moe_combine(d, topk_weights, delta)``). Three launches, no LoRA
    kernel of its own, no buffer to zero, no host sync:

    1. gate_up's grouped GEMM; program column 0 of each expert tile (columns 0 and 1 with
       many adapters: ``shrink_split``) is the tile's LoRA shrink ``y = x @ A_gate_up^T``
       (one pass over K per distinct slot in the tile).
    2. per pair and block of I: ``gate/up += scaling * y @ B_gate_up^T`` (fp32), the
       SwiGLU, and down's shrink of this block of I (a partial, ``[parts, P, R]`` fp32).
    3. down's grouped GEMM; the first program columns of each expert tile sum the tile's
       partials in a fixed order and write ``delta = scaling * y @ B_down^T``, rounded once
       (zero on pairs without a LoRA); the other columns are the plain base GEMM.

    Pairs whose token has no adapter (slot -1, or a slot of rank 0) get the base experts'
    values bit for bit in ``d`` and zeros in ``delta``. ``x [T, H]`` (pair ``p`` reads row
    ``p // topk``), ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``, ``pair_expert`` int32
    ``[P]``, ``routing`` from ``moe_expert_routing`` over it. Reference:
    ``reference.moe_lora_shrink`` / ``moe_lora_expand`` around ``silu_and_mul`` and one
    matmul per expert.
    """
    fn = "moe_experts_lora"
    if check:
        if not isinstance(lora, ExpertLoRA):
            raise ValueError(f"{fn}: lora must be an ExpertLoRA, got {type(lora).__name__}")
        for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            check_tensor(fn, name, w, ndim=3, dtypes=FLOAT_DTYPES)
        lora.check(fn, w_gate_up, w_down)
        x, w_gate_up = _check_grouped(
            fn, x, w_gate_up, routing, lora.topk, w_name="w_gate_up", div_name="lora.topk"
        )
        w_down = check_tensor(
            fn, "w_down", w_down, ndim=3, dtypes=(x.dtype,), device=x.device, contiguous=True
        )
        check_dim(fn, "w_down", w_down, 0, w_gate_up.shape[0], "one weight per expert")
        check_dim(fn, "w_down", w_down, 1, x.shape[1], "the hidden size of x")
        check_dim(fn, "w_down", w_down, 2, w_gate_up.shape[1] // 2, "half of w_gate_up's rows")
        check_dim(fn, "lora.token_slots", lora.token_slots, 0, x.shape[0], "one per token of x")
        check_tensor(
            fn,
            "pair_expert",
            pair_expert,
            ndim=1,
            dtypes=(torch.int32,),
            device=x.device,
            contiguous=True,
        )
        check_dim(fn, "pair_expert", pair_expert, 0, routing.row_order.shape[0], "one per pair")
    topk = lora.topk
    num_pairs = routing.row_order.shape[0]
    inter, rank = w_down.shape[2], lora.rank
    gu = x.new_empty(num_pairs, 2 * inter)
    y = x.new_empty(num_pairs, 2 * rank)
    _launch_grouped(x, w_gate_up, gu, routing, topk, lora, 1, y)
    parts = cdiv(inter, SILU_BLOCK_N)
    act = x.new_empty(num_pairs, inter)
    partials = torch.empty(parts, num_pairs, rank, dtype=torch.float32, device=x.device)
    d = x.new_empty(num_pairs, w_down.shape[1])
    delta = x.new_empty(num_pairs, w_down.shape[1])
    tiles = routing.tile_seg.shape[0]
    if num_pairs == 0 or tiles == 0:
        return d, delta
    _launch_silu_lora(gu, act, y, partials, pair_expert, routing, lora)
    _launch_grouped(act, w_down, d, routing, 1, lora, 2, partials, delta)
    return d, delta
