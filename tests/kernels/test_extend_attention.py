"""Prompt-chunk attention over the paged KV cache (kernels/attention.py, ``extend_attention``)
against SDPA per chunk over the row's gathered pages, and through ``Attention._attend``.

Each case lays out a step as the engine does: chunks of 2..N new tokens from position 0 or
past a cached prefix, one-token rows beside them, every row on pages scattered over a shared
pool (``KVCache.sync_table``). The pool's positions no chunk covers hold NaN: a kernel that
read past a query's last position would carry it into the output."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from tests.kernels.test_decode_attention import DEVICE, TOL

from loraplane.worker.bench.prefill_attention import scattered_chunks
from loraplane.worker.config import ModelConfig
from loraplane.worker.kernels import attention
from loraplane.worker.models.batch import ForwardBatch, SeqChunk
from loraplane.worker.models.kv_cache import KVCache
from loraplane.worker.models.model import Attention
from loraplane.worker.parallel.state import ParallelState

pytestmark = pytest.mark.kernels

BLOCK_M = 16  # queries per tile in the kernel cases: chunks of 17+ tokens take several


def make_step(
    layout: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    fill: float = float("nan"),
) -> tuple[KVCache, ForwardBatch, torch.Tensor]:
    """``layout`` [(start, length)] per row: the KV cache with every row's positions
    ``0..start + length - 1`` written (the rest ``fill``), the batch, and q."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(s + n for s, n in layout)
    per_row = -(-max_len // page_size)
    pool = len(layout) * per_row + 3
    kv = KVCache(
        1, len(layout), max_len, kv_heads, head_dim, dtype, DEVICE,
        page_size=page_size, num_pages=pool,
    )  # fmt: skip
    chunks, ids, offset = scattered_chunks(layout, page_size, pool, gen)
    kv.sync_table(chunks)
    kv.k[0].fill_(fill)
    kv.v[0].fill_(fill)
    for c in chunks:  # the prefix and the step's own keys: written before attending
        for p in range(c.start + c.length):
            page, slot = c.pages[p // page_size], p % page_size  # type: ignore[index]
            kv.k[0][page, slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            kv.v[0][page, slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
    batch = ForwardBatch.from_chunks(ids, chunks, all_logits=False, device=DEVICE)
    q = torch.randn(offset, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return kv, batch, q


def sdpa_per_chunk(
    q: torch.Tensor, kv: KVCache, batch: ForwardBatch, scale: float
) -> dict[int, torch.Tensor]:
    """fp64: each chunk of two or more tokens over its row's gathered keys, causal."""
    out: dict[int, torch.Tensor] = {}
    for c in batch.chunks:
        if c.length < 2:
            continue
        total = c.start + c.length
        keys, values = kv.row_keys(0, c.cache_row, total)  # [total, kv, d]
        mask = torch.arange(total)[None, :] <= torch.arange(c.start, total)[:, None]
        o = F.scaled_dot_product_attention(
            q[c.token_offset : c.token_offset + c.length].cpu().double().transpose(0, 1)[None],
            keys.cpu().double().transpose(0, 1)[None],
            values.cpu().double().transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[c.token_offset] = o[0].transpose(0, 1)  # [length, heads, d]
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "dtype", "layout"),
    [
        # MHA, d 8, a page per position: two chunks from 0 (one over two tiles), one past a
        # prefix, a decode row
        (2, 2, 8, 1, torch.float32, [(0, 2), (0, 19), (5, 3), (9, 1)]),
        # GQA 2, d 16: past prefixes across the 64-key blocks, a chunk over three tiles
        (4, 2, 16, 16, torch.float32, [(70, 2), (0, 5), (1, 1), (29, 40)]),
        # GQA 4, d 64
        (8, 2, 64, 16, torch.float32, [(3, 17), (0, 7), (60, 1)]),
        # half precision, GQA 2, odd head dim
        (4, 2, 24, 16, torch.float16, [(0, 18), (33, 4), (12, 1)]),
    ],
)
def test_matches_sdpa_per_chunk(heads, kv_heads, head_dim, page_size, dtype, layout) -> None:  # type: ignore[no-untyped-def]
    kv, batch, q = make_step(layout, heads, kv_heads, head_dim, page_size, dtype, seed=heads)
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    tiles = batch.prompt_tiles(q.device, BLOCK_M)
    got = attention.extend_attention(
        q, kv.k[0], kv.v[0], kv.page_table, tiles, scale, out, block_m=BLOCK_M
    )
    assert got is out
    for offset, want in sdpa_per_chunk(q, kv, batch, scale).items():
        rows = got[offset : offset + want.shape[0]].cpu().double()
        torch.testing.assert_close(rows, want, atol=TOL[dtype], rtol=TOL[dtype])
    for c in batch.chunks:  # rows no tile covers (the decode rows) are left as they were
        if c.length == 1:
            assert bool((got[c.token_offset] == 7.0).all())


@pytest.mark.parametrize("seed", [1, 2])
def test_random_layouts(seed: int) -> None:
    """Rows of 2..30 new tokens, half of them past a prefix of up to 80 positions, and
    decode rows, shuffled; Llama-3-8B's grouping (4) at a small head dim."""
    gen = torch.Generator().manual_seed(seed)
    layout = []
    for _ in range(5):
        n = int(torch.randint(1, 31, (1,), generator=gen))
        start = int(torch.randint(0, 81, (1,), generator=gen)) if n == 1 or seed % 2 else 0
        layout.append((start, n))
    layout.append((int(torch.randint(1, 81, (1,), generator=gen)), 6))
    kv, batch, q = make_step(layout, 8, 2, 16, 16, torch.float32, seed)
    out = torch.zeros_like(q)
    tiles = batch.prompt_tiles(q.device, BLOCK_M)
    attention.extend_attention(q, kv.k[0], kv.v[0], kv.page_table, tiles, 0.3, out, block_m=16)
    for offset, want in sdpa_per_chunk(q, kv, batch, 0.3).items():
        rows = out[offset : offset + want.shape[0]].cpu().double()
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-5)


def test_prompt_tiles_cut_each_chunk_of_two_or_more_tokens() -> None:
    chunks = [SeqChunk(3, 0, 5, 0), SeqChunk(1, 7, 1, 5), SeqChunk(0, 40, 35, 6)]
    batch = ForwardBatch.from_chunks(
        [[0] * 5, [0], [0] * 35], chunks, all_logits=False, device="cpu"
    )
    tiles = batch.prompt_tiles(torch.device("cpu"), 16)
    assert tiles.dtype == torch.int32
    assert tiles.tolist() == [
        [0, 3, 0, 5],
        [6, 0, 40, 16],
        [22, 0, 56, 16],
        [38, 0, 72, 3],
    ]
    assert batch.prompt_tiles(torch.device("cpu"), 16) is tiles  # once per batch
    assert batch.prompt_tiles(torch.device("cpu"), 64).tolist() == [[0, 3, 0, 5], [6, 0, 40, 35]]


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("tiles_dtype", "tiles must have dtype in (torch.int32), got torch.int64"),
        ("tiles_shape", "tiles.shape[1] must be 4 (token, cache row, position, count)"),
        ("out", "out must have q's shape (7, 4, 16), got (6, 4, 16)"),
        ("heads", "q's 3 heads must be a multiple of the cache's 2 KV heads"),
        ("block_m", "block_m must be an int >= 1, got 0"),
        ("bf16", "q is bfloat16 on the CPU"),
    ],
)
def test_bad_arguments_name_the_field(field: str, message: str) -> None:
    kv, batch, q = make_step([(0, 5), (3, 2)], 4, 2, 16, 4, torch.float32, seed=0)
    tiles = batch.prompt_tiles(q.device, BLOCK_M)
    out = torch.zeros_like(q)
    block_m = BLOCK_M
    k, v = kv.k[0], kv.v[0]
    if field == "tiles_dtype":
        tiles = tiles.long()
    elif field == "tiles_shape":
        tiles = tiles[:, :3].contiguous()
    elif field == "out":
        out = out[:6]
    elif field == "heads":
        q, out = q[:, :3], out[:, :3]
    elif field == "block_m":
        block_m = 0
    elif field == "bf16":
        if DEVICE.type != "cpu":
            pytest.skip("on a GPU bfloat16 is accepted: this case checks the refusal on the CPU")
        q, out, k, v = (t.to(torch.bfloat16) for t in (q, out, k, v))
    before = out.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        attention.extend_attention(q, k, v, kv.page_table, tiles, 1.0, out, block_m=block_m)
    assert torch.equal(out, before)


def test_attend_through_the_kernel_matches_the_sdpa_path() -> None:
    """``Attention._attend`` on a mixed step (prompt chunks from 0 and past a prefix beside
    decode rows): the CUDA path's kernel, run here through the interpreter, against the CPU
    path's SDPA per chunk. (The CPU path's decode rows gather whole pages and mask: the
    positions past the rows hold large finite values here, not NaN.)"""
    config = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=32,
        vocab_size=16,
    )
    attn = Attention(config, 0, ParallelState.single()).to(DEVICE)
    layout = [(0, 9), (20, 1), (12, 70), (5, 1), (0, 2)]
    kv, batch, q = make_step(layout, 4, 2, 16, 16, torch.float32, seed=5, fill=50.0)
    attn.prompt_kernel = False  # instance attributes: the class keeps its default
    want = attn._attend(q, batch, kv)
    attn.prompt_kernel = True
    got = attn._attend(q, batch, kv)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
