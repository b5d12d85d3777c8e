"""Decode attention in place over the paged KV cache (kernels/attention.py) against SDPA.

Most cases build a contiguous cache ``[rows, positions, ...]``, which is a paged one of one
page per row (``identity``); ``test_pages_scattered_over_the_pool`` pages it for real."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from loraplane.worker.kernels import attention
from loraplane.worker.kernels.shrink import split_counts

pytestmark = pytest.mark.kernels

ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def sdpa_reference(q, k_cache, v_cache, cache_rows, seq_lens, scale):  # type: ignore[no-untyped-def]
    """fp64, one sequence at a time: SDPA over the row's first seq_lens[t] positions."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        n = int(seq_lens[t])
        keys = k_cache[cache_rows[t], :n].double().transpose(0, 1)[None]  # [1, kv, n, d]
        values = v_cache[cache_rows[t], :n].double().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q[t].double()[None, :, None, :], keys, values, scale=scale, enable_gqa=True
        )
        out[t] = o[0, :, 0, :]
    return out


def identity(rows: int) -> torch.Tensor:
    """The page table of a contiguous cache: row ``r`` is page ``r``."""
    return torch.arange(rows, dtype=torch.int32, device=DEVICE)[:, None]


def make_case(tokens, heads, kv_heads, head_dim, positions, lens, dtype, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    rows = tokens + 2
    k_cache = torch.randn(rows, positions, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(rows, positions, kv_heads, head_dim, generator=gen)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    cache_rows = torch.randperm(rows, generator=gen)[:tokens]
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    return [t.to(DEVICE) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype))] + [
        cache_rows.to(DEVICE),
        seq_lens.to(DEVICE),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "lens"),
    [
        (4, 2, 16, [1, 7, 64, 65]),  # GQA 2; lengths at and across the 64-position blocks
        (8, 1, 32, [130, 3]),  # MQA: eight query heads on one KV head
        (3, 3, 24, [5, 100, 1]),  # MHA, head_dim not a power of two
        (32, 8, 64, [33]),  # Llama-3-8B's grouping (4), one token
    ],
)
def test_matches_sdpa_over_each_rows_prefix(heads, kv_heads, head_dim, lens, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k_cache, v_cache, rows, seq_lens = make_case(
        len(lens), heads, kv_heads, head_dim, 160, lens, dtype
    )
    scale = head_dim**-0.5
    out = attention.decode_attention(
        q, k_cache, v_cache, identity(k_cache.shape[0]), rows, seq_lens, scale
    )
    want = sdpa_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), rows.cpu(), seq_lens.cpu(), scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_positions_past_the_length_are_never_read() -> None:
    """NaN beyond each row's length (a stale or unwritten cache) must not reach the output."""
    q, k_cache, v_cache, rows, seq_lens = make_case(2, 4, 2, 16, 96, [10, 70], torch.float32)
    table = identity(k_cache.shape[0])
    want = attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.25)
    for t, n in enumerate([10, 70]):
        k_cache[rows[t], n:] = float("nan")
        v_cache[rows[t], n:] = float("nan")
    out = attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("heads", "q's 5 heads must be a multiple of the cache's 2 KV heads"),
        ("lens", "seq_lens must have dtype in (torch.int64), got torch.int32"),
        ("rows", "cache_rows.shape[0] must be 2 (one per token of q)"),
        ("v", "v_cache must have k_cache's shape and strides"),
        ("table", "page_table must have dtype in (torch.int32), got torch.int64"),
    ],
)
def test_bad_arguments_name_the_field(field: str, message: str) -> None:
    q, k_cache, v_cache, rows, seq_lens = make_case(2, 4, 2, 16, 32, [3, 4], torch.float32)
    if field == "heads":
        q = torch.zeros(2, 5, 16, device=DEVICE)
    elif field == "lens":
        seq_lens = seq_lens.to(torch.int32)
    elif field == "rows":
        rows = rows[:1]
    elif field == "v":
        v_cache = v_cache[:, :16]
    table = identity(k_cache.shape[0])
    if field == "table":
        table = table.long()
    with pytest.raises(ValueError, match=re.escape(message)):
        attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 1.0)


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_split_positions_combine_to_the_same_attention(splits: int) -> None:
    """Flash-decoding splits: chunks of ``CHUNK`` positions dealt round-robin to ``splits``
    programs, the last to finish combining them. Lengths below one chunk (splits past it
    stay idle), across a chunk edge, and over more chunks than splits; a second launch on the
    same counts gives the same bits (the combining split zeroed them)."""
    c = attention.CHUNK
    lens = [1, c, c + 1, 2 * c + 190]
    q, k_cache, v_cache, rows, seq_lens = make_case(
        4, 8, 2, 32, 3 * c, lens, torch.float32, seed=splits
    )
    old = attention.SPLITS_OVERRIDE
    attention.SPLITS_OVERRIDE = splits
    try:
        table = identity(k_cache.shape[0])
        got = attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2)
        again = attention.decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.2)
    finally:
        attention.SPLITS_OVERRIDE = old
    want = sdpa_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), rows.cpu(), seq_lens.cpu(), 0.2)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)
    assert not split_counts(q.device).any()  # left zero for the next split kernel


def test_split_count_fills_the_gpu_for_small_batches_only() -> None:
    """More (token, KV head) pairs, fewer splits: one once the pairs alone fill the GPU;
    never more than MAX_SPLITS."""
    cpu = torch.device("cpu")
    counts = [attention.splits_for(t, 1, cpu) for t in (1, 2, 4, 8, 64)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 1 and counts[-1] == 1
    assert all(1 <= c <= attention.MAX_SPLITS for c in counts)


@pytest.mark.parametrize("page_size", [16, 5])
def test_pages_scattered_over_the_pool(page_size: int) -> None:
    """The same attention when each row's positions sit on pages scattered over a shared
    pool in any order (a page size that does not divide the blocks, too), and the pool's
    other pages (NaN) are never read."""
    lens = [1, 17, 64, 90]
    q, k_rows, v_rows, rows, seq_lens = make_case(4, 4, 2, 16, 96, lens, torch.float32, seed=3)
    per_row = -(-96 // page_size)
    gen = torch.Generator().manual_seed(page_size)
    pool = k_rows.shape[0] * per_row + 7
    order = torch.randperm(pool, generator=gen)[: k_rows.shape[0] * per_row]
    table = order.view(k_rows.shape[0], per_row).to(torch.int32)
    k_cache = torch.full((pool, page_size, 2, 16), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    for r in range(k_rows.shape[0]):
        for p in range(per_row):
            n = min(page_size, 96 - p * page_size)
            k_cache[table[r, p], :n] = k_rows[r, p * page_size : p * page_size + n]
            v_cache[table[r, p], :n] = v_rows[r, p * page_size : p * page_size + n]
    got = attention.decode_attention(q, k_cache, v_cache, table.to(DEVICE), rows, seq_lens, 0.25)
    want = sdpa_reference(q.cpu(), k_rows.cpu(), v_rows.cpu(), rows.cpu(), seq_lens.cpu(), 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
