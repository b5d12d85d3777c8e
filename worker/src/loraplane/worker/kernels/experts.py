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

__all__ = ["expert_block_m", "moe_combine", "moe_expert_routing", "moe_grouped_matmul"]


@triton.jit
def _grouped_matmul_kernel(
    x_ptr,  # [rows of x, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]
    tile_seg_ptr,  # int32 [tiles]: expert of the tile, -1 = padding
    tile_len_ptr,  # int32 [tiles]: pairs in the tile
    tile_rows_ptr,  # int64 [tiles * BLOCK_M]: the tile's pairs (the first tile_len)
    n_out,
    x_stride_row,
    w_stride_expert,
    w_stride_row,
    out_stride_row,
    x_row_div,  # x row = pair // x_row_div (top-k: the pair's token)
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,  # K; constexpr (a runtime loop bound breaks the 3.6 interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // x_row_div)[:, None] * x_stride_row + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * w_stride_expert
    w_ptrs = w_base + offs_n[None, :].to(tl.int64) * w_stride_row + offs_k[:, None]  # [BK, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_mask = (k0 + offs_k) < HIDDEN
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x_tile, w_tile, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_ptrs = out_ptr + pairs[:, None] * out_stride_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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
    x = check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "x", x)
    w = check_tensor(fn, "w", w, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_same_dtype(fn, "w", w, "x", x.dtype)
    check_dim(fn, "w", w, 2, x.shape[1], "the hidden size of x")
    if not isinstance(routing, MoeLoraRouting) or routing.num_slots != 1:
        raise ValueError(f"{fn}: routing must come from moe_expert_routing, got {routing!r}")
    if routing.num_experts != w.shape[0]:
        raise ValueError(
            f"{fn}: routing was built for {routing.num_experts} experts, w has {w.shape[0]}"
        )
    if isinstance(x_row_div, bool) or not isinstance(x_row_div, int) or x_row_div < 1:
        raise ValueError(f"{fn}: x_row_div must be an int >= 1, got {x_row_div!r}")
    num_pairs = routing.row_order.shape[0]
    if x.shape[0] * x_row_div != num_pairs:
        raise ValueError(
            f"{fn}: x.shape[0] * x_row_div must equal the routed pairs, got "
            f"{x.shape[0]} * {x_row_div} != {num_pairs}"
        )
    n_out, hidden = w.shape[1], w.shape[2]
    if out is None:
        out = x.new_empty(num_pairs, n_out)
    else:
        check_tensor(fn, "out", out, ndim=2, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_dim(fn, "out", out, 0, num_pairs, "one row per routed pair")
        check_dim(fn, "out", out, 1, n_out, "w.shape[1]")
    tiles = routing.tile_seg.shape[0]
    if num_pairs == 0 or tiles == 0:
        return out
    block_m = routing.block_s
    block_n = min(64 if block_m <= 16 else 128, max(MIN_DOT_BLOCK, next_power_of_2(n_out)))
    block_k = min(128, max(MIN_DOT_BLOCK, next_power_of_2(hidden)))
    _grouped_matmul_kernel[(tiles, cdiv(n_out, block_n))](
        x,
        w,
        out,
        routing.tile_seg,
        routing.tile_len,
        routing.tile_rows,
        n_out,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        x_row_div,
        DOT_PRECISION=dot_precision(x.dtype),
        HIDDEN=hidden,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out
