"""GPU tier: the single-launch LoRA kernel (kernels/fused.py) against the two-launch one.

Same tiles and the same order of sums, so every case must be bitwise equal to ``lora_apply``:
stacked and plain projections, one to many segments, uneven segments, a rank-0 segment, a
permuted row order, repeated launches on one barrier, and replays from a CUDA graph. Runs
through the device tool (scripts/gpu-numerics.sh); there is no GPU on the CI machine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

DEV = "cuda"
SLOTS, RANK = 4, 16


def _case(widths: list[int], hidden: int, seg_lens: list[int], ranks: list[int], permute: bool):
    g = torch.Generator(device="cpu").manual_seed(sum(seg_lens) * 7 + len(widths))
    t = sum(seg_lens)
    x = torch.randn(t, hidden, generator=g).to(DEV, torch.bfloat16)
    a = (torch.randn(SLOTS, len(widths) * RANK, hidden, generator=g) * 0.05).to(DEV, torch.bfloat16)
    b = (torch.randn(SLOTS, sum(widths), RANK, generator=g) * 0.05).to(DEV, torch.bfloat16)
    out = torch.randn(t, sum(widths), generator=g).to(DEV, torch.bfloat16)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    indptr = [0]
    for n in seg_lens:
        indptr.append(indptr[-1] + n)
    seg_slots = [i % SLOTS for i in range(len(seg_lens))]
    slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    slot_scalings = torch.tensor([2.0, 0.5, 1.0, 4.0], dtype=torch.float32, device=DEV)
    seg_slots_t = torch.tensor(seg_slots, dtype=torch.int32, device=DEV)
    row_order = torch.randperm(t, generator=g).to(DEV) if permute else None
    return {
        "x": x,
        "lora_a": a,
        "lora_b": b,
        "seg_indptr": torch.tensor(indptr, dtype=torch.int32, device=DEV),
        "seg_slots": seg_slots_t,
        "slot_ranks": slot_ranks,
        "slot_scalings": slot_scalings,
        "row_order": row_order,
        "slice_offsets": torch.tensor(offsets, dtype=torch.int32, device=DEV),
        "out": out,
        "max_seg_len": max(seg_lens),
        "seg_ranks": slot_ranks[seg_slots_t.long()].contiguous(),
        "seg_scalings": slot_scalings[seg_slots_t.long()].contiguous(),
    }


CASES = {
    "qkv-1seg-16": ([512, 128, 128], 256, [16], [16, 16, 16, 16], False),
    "qkv-4seg-64": ([512, 128, 128], 256, [16, 16, 16, 16], [16, 8, 16, 4], False),
    "gate_up-uneven": ([384, 384], 256, [100, 3, 1, 40], [16, 16, 16, 16], False),
    "o-rank0-segment": ([256], 512, [8, 8, 8], [16, 0, 12, 16], False),
    "down-permuted-200": ([256], 1024, [50, 50, 100], [16, 16, 16, 16], True),
    "one-row": ([256, 64, 64], 256, [1], [16, 16, 16, 16], False),
}


def _two_launch(case: dict) -> torch.Tensor:
    from loraplane.worker import kernels

    out = case["out"].clone()
    args = {k: v for k, v in case.items() if k != "out"}
    kernels.lora_apply(**args, out=out)
    return out


def _fused(case: dict, barrier: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    from loraplane.worker import kernels

    out = case["out"].clone() if out is None else out
    args = {k: v for k, v in case.items() if k != "out"}
    kernels.lora_apply_fused(**args, out=out, barrier=barrier)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_equals_two_launches(name: str) -> None:
    case = _case(*CASES[name])
    barrier = torch.zeros(2, dtype=torch.int32, device=DEV)
    want = _two_launch(case)
    for _ in range(3):  # the barrier is reused: it must be back at zero after each launch
        got = _fused(case, barrier)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (
            f"{name}: max diff {(got.float() - want.float()).abs().max()}"
        )
        assert barrier.tolist() == [0, 0]
    assert not torch.equal(want, case["out"]), "the LoRA must change the output"


def test_fused_replays_from_a_cuda_graph() -> None:
    case = _case(*CASES["qkv-4seg-64"])
    barrier = torch.zeros(2, dtype=torch.int32, device=DEV)
    want = _two_launch(case)
    out = case["out"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fused(case, barrier, out.copy_(case["out"]))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(case["out"])
        _fused(case, barrier, out)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert barrier.tolist() == [0, 0]


def test_fused_rejects_a_bad_barrier() -> None:
    case = _case(*CASES["one-row"])
    with pytest.raises(ValueError, match="barrier"):
        _fused(case, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="barrier"):
        _fused(case, torch.zeros(2, dtype=torch.int64, device=DEV))
