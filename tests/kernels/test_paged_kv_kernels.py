"""The device kernels through the paged KV cache's own API (models/kv_cache.py), as the model's
CUDA path calls them: the fused rope writes K and V at ``KVCache.slots`` and decode attention
reads rows through ``KVCache.page_table``, for pages scattered over the pool by
``sync_table``; what they read and write is what the CPU path's ``row_keys`` sees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.kernels.test_lora_kernels_segmented import DEVICE

from loraplane.worker.kernels import attention, reference, rope
from loraplane.worker.models.batch import ForwardBatch, SeqChunk
from loraplane.worker.models.kv_cache import KVCache
from loraplane.worker.models.layers import RotaryEmbedding

pytestmark = pytest.mark.kernels

H, KV, D, PAGE = 4, 2, 16, 4
LENGTHS = [9, 1, 14]  # positions cached per row before the decode step


def _cache() -> KVCache:
    kv = KVCache(1, 3, 24, KV, D, torch.float32, DEVICE, page_size=PAGE, num_pages=20)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(20, generator=gen).tolist()  # each row's pages, scattered
    chunks = []
    for row, n in enumerate(LENGTHS):
        pages = tuple(order[row * 6 : row * 6 + n // PAGE + 1])  # room for position n
        chunks.append(SeqChunk(cache_row=row, start=n, length=1, token_offset=row, pages=pages))
    kv.sync_table(chunks)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    return kv


def test_rope_writes_at_the_slots_the_table_gives_and_attention_reads_them() -> None:
    kv = _cache()
    gen = torch.Generator().manual_seed(1)
    batch = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(LENGTHS, dtype=torch.int64, device=DEVICE),
        cache_rows=torch.arange(3, dtype=torch.int64, device=DEVICE),
        chunks=[],
        logit_rows=torch.arange(3, dtype=torch.int64, device=DEVICE),
    )
    qkv = torch.randn(3, (H + 2 * KV) * D, generator=gen).to(DEVICE)
    cos_sin = RotaryEmbedding(D, 10000.0).to(DEVICE).cos_sin(24, torch.float32)
    before = kv.k[0].clone()
    ref_k, ref_v = kv.k[0].clone(), kv.v[0].clone()
    want_q = reference.rope_qkv(qkv, batch.positions, kv.slots(batch), cos_sin, ref_k, ref_v, H)
    q = rope.rope_qkv(qkv, batch.positions, kv.slots(batch), cos_sin, kv.k[0], kv.v[0], H)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.k[0], ref_k, rtol=1e-5, atol=1e-5)
    assert int((kv.k[0] != before).any(-1).any(-1).sum()) == 3  # one slot per row written
    for row, n in enumerate(LENGTHS):  # the new token's V is the row's last position
        _, v = kv.row_keys(0, row, n + 1)
        want_v = qkv[row, (H + KV) * D :].view(KV, D)
        assert torch.equal(v[n], want_v)
    out = attention.decode_attention(
        q, kv.k[0], kv.v[0], kv.page_table, batch.cache_rows, batch.positions + 1, D**-0.5
    )
    for row, n in enumerate(LENGTHS):
        k, v = kv.row_keys(0, row, n + 1)  # [n + 1, KV, d]
        want = F.scaled_dot_product_attention(
            q[row][None, :, None, :].cpu(),
            k.transpose(0, 1)[None].cpu(),
            v.transpose(0, 1)[None].cpu(),
            scale=D**-0.5,
            enable_gqa=True,
        )[0, :, 0, :]
        torch.testing.assert_close(out[row].cpu(), want, rtol=1e-5, atol=1e-5)
