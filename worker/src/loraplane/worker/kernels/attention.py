"""Decode attention over the KV cache in place: one new token per sequence, GQA.

``out[t, h] = softmax(scale * q[t, h] K_row^T) V_row`` over the first ``seq_lens[t]`` positions of
cache row ``cache_rows[t]``, for the KV head of ``h`` (``h // (heads / kv_heads)``). One program
per (token, KV head) holds all the query heads that share that KV head, streams the row's keys
and values once in ``BLOCK_L`` chunks with an online softmax (fp32), and never copies the cache.

Lengths are read on the device, so nothing about the batch's contexts is needed on the host:
a decode step can be captured in a CUDA graph once and replayed at every length. Reference:
``torch.nn.functional.scaled_dot_product_attention`` over the gathered rows (what the CPU path
runs, ``models/model.py``).
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
    check_dim,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
)

__all__ = ["decode_attention"]


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [T, heads, d]
    k_ptr,  # [rows, positions, kv_heads, d]
    v_ptr,  # same shape and strides as k
    out_ptr,  # [T, heads, d]
    cache_rows_ptr,  # int64 [T]
    seq_lens_ptr,  # int64 [T]: positions attended, >= 1
    scale,
    q_stride_t,
    q_stride_h,
    kv_stride_row,
    kv_stride_pos,
    kv_stride_head,
    out_stride_t,
    out_stride_h,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(cache_rows_ptr + t)
    length = tl.load(seq_lens_ptr + t)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    base = row * kv_stride_row + kv_head * kv_stride_head
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = 0
    while start < length:  # a device-read bound: a while loop (see kernels/moe.py)
        offs_l = start + tl.arange(0, BLOCK_L)
        l_mask = offs_l < length
        kv_offs = base + offs_l.to(tl.int64) * kv_stride_pos
        k = tl.load(
            k_ptr + kv_offs[None, :] + offs_d[:, None],
            mask=d_mask[:, None] & l_mask[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_L]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_L]
        s = tl.where(l_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + kv_offs[:, None] + offs_d[None, :],
            mask=l_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_L, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        start += BLOCK_L

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``out [T, heads, d]``: token ``t`` attends to positions ``[0, seq_lens[t])`` of its row.

    ``q [T, heads, d]`` (unit stride in ``d``); ``k_cache``/``v_cache`` ``[rows, positions,
    kv_heads, d]`` with one layout; ``cache_rows``/``seq_lens`` int64 ``[T]`` on the device.
    ``heads`` must be a multiple of ``kv_heads``. Lengths are trusted (no host sync): each must
    be in ``1..positions``.
    """
    fn = "decode_attention"
    q = check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    k = check_tensor(fn, "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    v = check_tensor(fn, "v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    check_same_dtype(fn, "k_cache", k, "q", q.dtype)
    check_same_dtype(fn, "v_cache", v, "q", q.dtype)
    if v.shape != k.shape or v.stride() != k.stride():
        raise ValueError(
            f"{fn}: v_cache must have k_cache's shape and strides, got {tuple(v.shape)} "
            f"{v.stride()} and {tuple(k.shape)} {k.stride()}"
        )
    if k.stride(-1) != 1:
        raise ValueError(f"{fn}: k_cache must have unit stride in head_dim, got {k.stride()}")
    check_dim(fn, "k_cache", k, 3, q.shape[2], "the head dim of q")
    kv_heads = k.shape[2]
    if q.shape[1] % kv_heads:
        raise ValueError(
            f"{fn}: q's {q.shape[1]} heads must be a multiple of the cache's {kv_heads} KV heads"
        )
    for name, t in (("cache_rows", cache_rows), ("seq_lens", seq_lens)):
        checked = check_tensor(
            fn, name, t, ndim=1, dtypes=(torch.int64,), device=q.device, contiguous=True
        )
        check_dim(fn, name, checked, 0, q.shape[0], "one per token of q")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    group = q.shape[1] // kv_heads
    head_dim = q.shape[2]
    _decode_attention_kernel[(q.shape[0], kv_heads)](
        q,
        k,
        v,
        out,
        cache_rows,
        seq_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=max(MIN_DOT_BLOCK, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT_BLOCK, next_power_of_2(head_dim)),
        BLOCK_L=64,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    return out
