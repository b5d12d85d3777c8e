"""The fused shrink+expand kernel computes what the two-step references compute, segment by
segment with each segment's own slot, rank and scaling (rows beyond a rank poisoned with NaN)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.kernels


def _case(seed: int, sizes: list[int], k: int, rank_max: int, ranks: list[int], token_slots: list[int], dtype: torch.dtype):
    from loraplane.worker.lora.batch_info import LoRABatchInfo

    g = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    n = len(sizes)
    t = len(token_slots)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(slots, n * rank_max, k, generator=g).to(dtype) / math.sqrt(k)
    b = torch.randn(slots, sum(sizes), rank_max, generator=g).to(dtype)
    for w, r in enumerate(ranks):  # poison what no segment may read
        for i in range(n):
            a[w, i * rank_max + r : (i + 1) * rank_max] = float("nan")
        b[w, :, r:] = float("nan")
    slot_ranks = torch.tensor(ranks, dtype=torch.int32)
    scalings = torch.tensor([0.5 + w for w in range(slots)], dtype=torch.float32)
    info = LoRABatchInfo.build(token_slots, slot_ranks, scalings, "cpu")
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.randn(t, sum(sizes), generator=g).to(dtype)
    return x, a, b, info, offsets, out


@pytest.mark.parametrize("n_sub", [None, 2, 4])
@pytest.mark.parametrize(
    ("sizes", "token_slots"),
    [
        ([160, 64, 64], [0, 2, -1, 1, 1, 0, 2, -1, 3]),  # several column blocks: chunks span slices
        ([48, 16, 16], [0, 2, -1, 1, 1, 0, 2, -1, 3]),  # qkv with GQA widths, shuffled adapters, base rows
        ([32, 32], [1] * 5 + [-1] * 3 + [0] * 20),  # gate_up, contiguous segments, one longer than a block
        ([40], [3]),  # one token, one slot
    ],
)
def test_fused_equals_two_step_reference(sizes: list[int], token_slots: list[int], n_sub: int | None) -> None:
    from loraplane.worker.kernels import reference
    from loraplane.worker.kernels.fused import lora_shrink_expand

    x, a, b, info, offsets, out = _case(7, sizes, 64, 16, [4, 16, 8, 2], token_slots, torch.float32)
    assert info is not None
    expected = out.clone()
    y = reference.lora_shrink(x, a, info.seg_indptr, info.seg_slots, info.slot_ranks, info.row_order, len(sizes), info.max_seg_len)
    reference.lora_expand(
        y, b, info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings, info.row_order, offsets, expected, info.max_seg_len
    )
    before = out.clone()
    lora_shrink_expand(
        x, a, b, info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings, info.row_order, offsets, out, info.max_seg_len, n_sub=n_sub
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(out[base_rows], before[base_rows])  # rows with no adapter untouched


def test_fused_rejects_mismatched_a() -> None:
    from loraplane.worker.kernels.fused import lora_shrink_expand

    x, a, b, info, offsets, out = _case(1, [16], 32, 16, [4], [0, 0], torch.float32)
    assert info is not None
    with pytest.raises(ValueError, match="lora_a must have shape"):
        lora_shrink_expand(
            x, a[:, :8], b, info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings, info.row_order, offsets, out, 2
        )
