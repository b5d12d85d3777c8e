"""Attention over the paged KV cache in place, GQA: decode (one new token per sequence) and
prompt chunks (``extend_attention``, at the end of this module).

``out[t, h] = softmax(scale * q[t, h] K_row^T) V_row`` over the first ``seq_lens[t]`` positions of
page-table row ``cache_rows[t]``, for the KV head of ``h`` (``h // (heads / kv_heads)``).
Position ``p`` of row ``r`` is position ``p % page_size`` of page ``page_table[r, p //
page_size]`` (``models/kv_cache.py``); a block of ``BLOCK_L`` positions loads its page ids
first, then the keys and values of each position where its page puts it. A program
holds all the query heads that share one KV head and streams keys and values in ``BLOCK_L``
blocks with an online softmax (fp32); the cache is never copied.

The positions are cut into ``CHUNK``-position chunks and each (token, KV head) gets
``splits`` programs (flash-decoding): split ``s`` takes chunks ``s, s + splits, ...`` and
writes its unnormalized sum with its running max and denominator; the last split of a pair
to finish combines them (no second launch). ``splits_for`` picks the count from the batch's
shape alone, enough programs for the GPU (a decode batch of 32 rows has only 32 x 8 (token,
KV head) pairs for 132 multiprocessors); with one split the kernel writes the output itself. Measured on an H200
(``bench/probes/attention_tune.py``): one program per (token, KV head) read 16
rows x 4096 positions at 2.6 TB/s; split, 3.4 TB/s. A split the row's length does not reach
reads no position, but still stores its empty record and counts itself in (the combine waits
for every split).

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
    cdiv,
    check_dim,
    check_interpretable,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
)
from loraplane.worker.kernels.shrink import COUNT_SLOTS, split_counts

__all__ = ["decode_attention", "extend_attention"]


# Positions per chunk; a program takes chunks ``split, split + SPLITS, ...`` of its row,
# ``BLOCK_L`` positions per step, with ``NUM_WARPS`` (module values, so
# bench/probes/attention_tune.py can set them). Measured on an H200 (attention_tune.json):
# 256 x 64 was the best or within 5% of it at 16-128 rows and 512-4096 positions
# among 128/256 positions per chunk, 32/64/128 per step and 4/8 warps.
CHUNK = 256
BLOCK_L = 64
NUM_WARPS = 4
# Programs wanted in flight: about four per multiprocessor.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 16
# A fixed split count instead of the rule in ``splits_for`` when set (bench/probes/switches.py
# attn=N; 0 would be invalid, 1 is the unsplit kernel).
SPLITS_OVERRIDE: int | None = None


@triton.jit
def _online_softmax_block(
    q,  # [rows, BLOCK_D]: the queries
    k_ptr,
    v_ptr,
    table_row,  # the row's page-table entries
    base,  # the KV head's offset
    offs_n,  # [BLOCK_N]: positions of the row
    n_mask,  # [BLOCK_N]: the positions to load
    keep,  # [rows, BLOCK_N] (or broadcast to it): the scores that count
    offs_d,
    d_mask,
    m_i,  # [rows] fp32: running max, denominator and unnormalized sum
    l_i,
    acc,  # [rows, BLOCK_D]
    scale,
    kv_stride_page,
    kv_stride_pos,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One block of a row's positions, read through its pages, folded into the queries'
    online softmax (fp32); returns the new max, denominator and sum."""
    page = tl.load(table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_offs = base + page * kv_stride_page + (offs_n % PAGE_SIZE) * kv_stride_pos
    k = tl.load(
        k_ptr + kv_offs[None, :] + offs_d[:, None],
        mask=d_mask[:, None] & n_mask[None, :],
        other=0.0,
    )  # [BLOCK_D, BLOCK_N]
    v = tl.load(
        v_ptr + kv_offs[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [rows, BLOCK_N]
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [T, heads, d]
    k_ptr,  # [pages, page_size, kv_heads, d]
    v_ptr,  # same shape and strides as k
    out_ptr,  # [T, heads, d] (SPLITS == 1)
    part_ptr,  # fp32 [T, heads, SPLITS, d + 2]: acc | max | sum of each split (SPLITS > 1)
    count_ptr,  # int32 [>= T * kv_heads], zero between launches (SPLITS > 1)
    table_ptr,  # int32 [rows, pages_per_row]
    cache_rows_ptr,  # int64 [T]: page-table rows
    seq_lens_ptr,  # int64 [T]: positions attended, >= 1
    scale,
    q_stride_t,
    q_stride_h,
    table_stride,
    kv_stride_page,
    kv_stride_pos,
    kv_stride_head,
    out_stride_t,
    out_stride_h,
    num_heads,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(cache_rows_ptr + t)
    length = tl.load(seq_lens_ptr + t)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    table_row = table_ptr + row * table_stride
    base = kv_head * kv_stride_head
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    chunks = tl.cdiv(length, CHUNK)
    c = split
    while c < chunks:  # a device-read bound: a while loop (see kernels/moe.py)
        # a fixed trip count inside, so the loads of the next block are issued early
        for i in range(0, CHUNK, BLOCK_L):
            offs_l = c * CHUNK + i + tl.arange(0, BLOCK_L)
            l_mask = offs_l < length  # the chunk's first block always holds a position
            m_i, l_i, acc = _online_softmax_block(
                q,
                k_ptr,
                v_ptr,
                table_row,
                base,
                offs_l,
                l_mask,
                l_mask[None, :],
                offs_d,
                d_mask,
                m_i,
                l_i,
                acc,
                scale,
                kv_stride_page,
                kv_stride_pos,
                PAGE_SIZE,
                DOT_PRECISION,
            )
        c += SPLITS

    hd_mask = g_mask[:, None] & d_mask[None, :]
    if SPLITS == 1:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        # This split's unnormalized sum, running max and softmax denominator (a split past
        # the row's chunks leaves max -inf and sum 0: it weighs nothing). Then, as the
        # split-K shrink does (kernels/shrink.py), every split counts itself in (release);
        # the last to arrive (acquire) combines all splits in split order, so the output is
        # the same bits whichever arrives last, and zeroes the count for the next launch.
        width = HEAD_DIM + 2
        recs = part_ptr + ((t * num_heads + heads) * SPLITS).to(tl.int64) * width
        rec = recs + split * width
        tl.store(rec[:, None] + offs_d[None, :], acc, mask=hd_mask)
        tl.store(rec + HEAD_DIM, m_i, mask=g_mask)
        tl.store(rec + HEAD_DIM + 1, l_i, mask=g_mask)
        pair = t * tl.num_programs(1) + kv_head
        tl.debug_barrier()  # every thread's partial stores are issued before the release
        arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.debug_barrier()  # every thread's loads are ordered after the acquire
            m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
            den = tl.zeros((BLOCK_G,), dtype=tl.float32)
            total = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
            for sp in tl.static_range(SPLITS):  # split 0 holds the first chunk: m finite
                rec = recs + sp * width
                m_s = tl.load(rec + HEAD_DIM, mask=g_mask, other=0.0, cache_modifier=".cg")
                l_s = tl.load(rec + HEAD_DIM + 1, mask=g_mask, other=0.0, cache_modifier=".cg")
                o_s = tl.load(
                    rec[:, None] + offs_d[None, :], mask=hd_mask, other=0.0, cache_modifier=".cg"
                )
                m_new = tl.maximum(m, m_s)
                a = tl.exp(m - m_new)
                b = tl.exp(m_s - m_new)
                den = den * a + l_s * b
                total = total * a[:, None] + o_s * b[:, None]
                m = m_new
            out = total / den[:, None]
            out_ptrs = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + offs_d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
            tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")


_SM_COUNT: dict[torch.device, int] = {}


def splits_for(tokens: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (token, KV head): enough for ``PROGRAMS_PER_SM`` per multiprocessor.

    Only the batch's shape decides (a decode graph is captured once and replayed at every
    length): a row shorter than ``splits x CHUNK`` positions leaves the splits past its
    chunks idle, a longer one gives each split several chunks."""
    if SPLITS_OVERRIDE is not None:
        return SPLITS_OVERRIDE
    if device.type != "cuda":
        return min(MAX_SPLITS, max(1, cdiv(8, max(1, tokens * kv_heads))))  # (tests: a few)
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    want = PROGRAMS_PER_SM * sms
    return min(MAX_SPLITS, max(1, cdiv(want, max(1, tokens * kv_heads))))


def _check_cache(
    fn: str, q: torch.Tensor, k_cache: object, v_cache: object, page_table: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked ``k_cache``, ``v_cache`` and ``page_table`` of an attention over ``q``."""
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
    if q.shape[1] % k.shape[2]:
        raise ValueError(
            f"{fn}: q's {q.shape[1]} heads must be a multiple of the cache's {k.shape[2]} KV heads"
        )
    table = check_tensor(
        fn,
        "page_table",
        page_table,
        ndim=2,
        dtypes=(torch.int32,),
        device=q.device,
        unit_last_stride=True,
    )
    return k, v, table


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``out [T, heads, d]``: token ``t`` attends to positions ``[0, seq_lens[t])`` of its row.

    ``q [T, heads, d]`` (unit stride in ``d``); ``k_cache``/``v_cache`` ``[pages, page_size,
    kv_heads, d]`` with one layout; ``page_table`` int32 ``[rows, pages_per_row]`` (unit stride
    in its last dimension); ``cache_rows``/``seq_lens`` int64 ``[T]`` on the device.
    ``heads`` must be a multiple of ``kv_heads``. Rows, lengths and page ids are trusted (no
    host sync): each length must be in ``1..pages_per_row * page_size`` and the row's pages
    that cover it must be pages of the cache. A contiguous cache ``[rows, positions, ...]`` is
    a paged one with ``page_size = positions`` and the table ``[[0], [1], ...]``.
    """
    fn = "decode_attention"
    q = check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    k, v, table = _check_cache(fn, q, k_cache, v_cache, page_table)
    kv_heads = k.shape[2]
    for name, t in (("cache_rows", cache_rows), ("seq_lens", seq_lens)):
        checked = check_tensor(
            fn, name, t, ndim=1, dtypes=(torch.int64,), device=q.device, contiguous=True
        )
        check_dim(fn, name, checked, 0, q.shape[0], "one per token of q")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    tokens, heads, head_dim = q.shape
    group = heads // kv_heads
    splits = splits_for(tokens, kv_heads, q.device)
    if splits < 1:
        raise ValueError(f"{fn}: the split count must be >= 1, got {splits}")
    if CHUNK % BLOCK_L or BLOCK_L > CHUNK:
        raise ValueError(
            f"{fn}: CHUNK ({CHUNK}) must be a multiple of BLOCK_L ({BLOCK_L}): chunks would overlap"
        )
    part, counts = out, cache_rows  # (not read with one split)
    if splits > 1:
        if tokens * kv_heads > COUNT_SLOTS:
            raise ValueError(
                f"{fn}: {splits} splits need a count per (token, KV head), at most "
                f"{COUNT_SLOTS}; got {tokens} tokens x {kv_heads} KV heads"
            )
        part = torch.empty(
            (tokens, heads, splits, head_dim + 2), dtype=torch.float32, device=q.device
        )
        counts = split_counts(q.device)
    block_d = max(MIN_DOT_BLOCK, next_power_of_2(head_dim))
    _decode_attention_kernel[(tokens, kv_heads, splits)](
        q,
        k,
        v,
        out,
        part,
        counts,
        table,
        cache_rows,
        seq_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        table.stride(0),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        heads,
        PAGE_SIZE=k.shape[1],
        GROUP=group,
        BLOCK_G=max(MIN_DOT_BLOCK, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_L=BLOCK_L,
        CHUNK=CHUNK,
        SPLITS=splits,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=NUM_WARPS,
    )
    return out


# Prompt chunks (chunks of two or more new tokens, from position 0 or past a cached prefix):
# one launch for all the chunks of a step. The host cuts every chunk into tiles of at most
# ``block_m`` consecutive queries (``ForwardBatch.prompt_tiles``, once per batch, not per
# layer; the model's tiles are ``models.batch.PROMPT_TILE``, 64); a program takes one (query head, tile) and streams its row's keys and values
# ``EXTEND_BLOCK_N`` positions at a time, from position 0 to the tile's last query, with an
# online softmax in fp32 (the flash-attention forward pass, the keys read through the page
# table as ``decode_attention`` reads them). Query ``i`` of a tile at position ``p`` sees the
# positions ``0..p`` of its row: the step has written its own keys and values into the cache
# before attending (``Attention.forward``), so the causal mask over the cache is the whole
# rule, for a chunk from position 0 and for one past a cached prefix alike.
EXTEND_BLOCK_N = 64
EXTEND_NUM_WARPS = 4
EXTEND_NUM_STAGES = 2  # K and V blocks in flight: 2 x 32 KiB of shared memory at d 128, bf16
# A tile's four int32 fields (``ForwardBatch.prompt_tiles``): its first query's row of q, its
# page-table row, its first query's position, its query count (1..BLOCK_M).
TILE_FIELDS = 4


@triton.jit
def _extend_attention_kernel(
    q_ptr,  # [T, heads, d]
    k_ptr,  # [pages, page_size, kv_heads, d]
    v_ptr,  # same shape and strides as k
    out_ptr,  # [T, heads, d]: the tiles' rows are written, no other
    table_ptr,  # int32 [rows, pages_per_row]
    tiles_ptr,  # int32 [tiles, 4]: token, cache row, position, count
    scale,
    q_stride_t,
    q_stride_h,
    table_stride,
    kv_stride_page,
    kv_stride_pos,
    kv_stride_head,
    out_stride_t,
    out_stride_h,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)  # heads of one tile run side by side: its K and V stay in L2
    tile = tiles_ptr + tl.program_id(1) * 4
    token = tl.load(tile).to(tl.int64)
    row = tl.load(tile + 1)
    first = tl.load(tile + 2)
    count = tl.load(tile + 3)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = first + offs_m  # [BLOCK_M]
    q_ptrs = q_ptr + (token + offs_m)[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    table_row = table_ptr + row * table_stride
    base = (head // GROUP) * kv_stride_head
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = first + count  # keys 0..end-1: up to the tile's last query
    # a for loop with a device-read bound (as kernels/sampling.py's passes): the compiler
    # pipelines its loads over ``num_stages`` blocks
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # causal over the cache; position 0 is in the first block, so every row's max is
        # finite from the first block on (padding rows too: their positions pass the end)
        m_i, l_i, acc = _online_softmax_block(
            q,
            k_ptr,
            v_ptr,
            table_row,
            base,
            offs_n,
            n_mask,
            offs_n[None, :] <= q_pos[:, None],
            offs_d,
            d_mask,
            m_i,
            l_i,
            acc,
            scale,
            kv_stride_page,
            kv_stride_pos,
            PAGE_SIZE,
            DOT_PRECISION,
        )

    # (a tile of no query, a captured prompt step's padding, has l 0 and stores nothing)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = (
        out_ptr + (token + offs_m)[:, None] * out_stride_t + head * out_stride_h + offs_d[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    block_m: int,
) -> torch.Tensor:
    """Write into ``out [T, heads, d]`` the attention of the queries the ``tiles`` cover.

    A tile ``(token, row, position, count)`` (int32 ``[tiles, 4]``, ``ForwardBatch.prompt_tiles``
    with the same ``block_m``) is ``count`` (``1..block_m``) consecutive queries ``q[token ..
    token + count]`` at positions ``position ..``; query ``i`` attends to positions ``0 ..
    position + i`` of page-table row ``row``. ``q`` and ``out`` ``[T, heads, d]`` (unit stride in
    ``d``); caches and table as ``decode_attention`` takes them. Rows of ``out`` no tile covers
    are left as they are. Tiles and page ids are trusted (no host sync): a tile's rows must lie
    in ``q``, its positions within its row's pages. Returns ``out``.
    """
    fn = "extend_attention"
    q = check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "q", q)
    k, v, table = _check_cache(fn, q, k_cache, v_cache, page_table)
    out = check_tensor(
        fn, "out", out, ndim=3, dtypes=(q.dtype,), device=q.device, unit_last_stride=True
    )
    if out.shape != q.shape:
        raise ValueError(f"{fn}: out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    tiles = check_tensor(
        fn, "tiles", tiles, ndim=2, dtypes=(torch.int32,), device=q.device, contiguous=True
    )
    check_dim(fn, "tiles", tiles, 1, TILE_FIELDS, "token, cache row, position, count")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"{fn}: block_m must be an int >= 1, got {block_m!r}")
    if tiles.shape[0] == 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    _extend_attention_kernel[(heads, tiles.shape[0])](
        q,
        k,
        v,
        out,
        table,
        tiles,
        float(scale),
        q.stride(0),
        q.stride(1),
        table.stride(0),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=k.shape[1],
        GROUP=heads // k.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT_BLOCK, next_power_of_2(head_dim)),
        BLOCK_M=max(MIN_DOT_BLOCK, next_power_of_2(block_m)),
        BLOCK_N=EXTEND_BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=EXTEND_NUM_WARPS,
        num_stages=EXTEND_NUM_STAGES,
    )
    return out
