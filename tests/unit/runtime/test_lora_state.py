"""Per-batch LoRA state (seed 004): no forward can run on another batch's metadata."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, prefill_batch
from loraplane.worker.lora.adapter import ExpertStack
from loraplane.worker.lora.batch_info import NO_ADAPTER, LoRABatchInfo

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def runners(suite) -> tuple[ModelRunner, ModelRunner]:
    model_dir, adapters = suite["qwen3-moe"]
    cfg = RunnerConfig(str(model_dir), lora_backend="torch", max_seqs=4, max_len=64)
    lora = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    )
    for slot, (name, path) in enumerate(adapters):
        lora.lora.load_slot(slot, lora.read_adapter(name, path))  # type: ignore[union-attr]
    return lora, ModelRunner(cfg, None)


PROMPTS = [[5, 9, 200, 31, 7], [44, 2, 2, 90]]


def run(r: ModelRunner, slots: list[int]) -> torch.Tensor:
    batch = prefill_batch(PROMPTS, [0, 1], all_logits=True, device="cpu")
    tokens = [s for p, s in zip(PROMPTS, slots, strict=True) for _ in p]
    return r.forward(batch, tokens)


def test_batch_state_is_cleared_after_every_forward(runners) -> None:
    lora, _ = runners
    run(lora, [0, 2])
    assert lora.lora.ctx.local is None and lora.lora.ctx.global_ is None  # type: ignore[union-attr]
    assert not any(w.lora_active for ws in lora.lora.layers for w in ws)  # type: ignore[union-attr]


def test_stale_metadata_cannot_reach_a_base_only_batch(runners) -> None:
    """The bug of seed 004: a forward that skips batch preparation runs on the last batch's
    segments. Plant such stale metadata and run a base-only batch: it must equal the model
    without LoRA bit for bit."""
    lora, plain = runners
    stale = LoRABatchInfo.build([3] * 9, lora.lora.slot_ranks, lora.lora.slot_scalings, "cpu")  # type: ignore[union-attr]
    lora.lora.ctx.local = lora.lora.ctx.global_ = stale  # type: ignore[union-attr]
    got = run(lora, [NO_ADAPTER, NO_ADAPTER])
    assert torch.equal(got, run(plain, [NO_ADAPTER, NO_ADAPTER]))


def test_adapter_rows_change_and_base_rows_do_not(runners) -> None:
    lora, plain = runners
    mixed = run(lora, [1, NO_ADAPTER])
    base = run(plain, [NO_ADAPTER, NO_ADAPTER])
    n0 = len(PROMPTS[0])
    assert (mixed[:n0] - base[:n0]).abs().max() > 1e-3  # the adapter matters
    assert torch.equal(mixed[n0:], base[n0:])  # a base row gets no LoRA work at all


def test_each_slot_gives_its_own_result(runners) -> None:
    """Four adapters in one batch: each row equals that adapter alone (no cross-slot reads)."""
    lora, _ = runners
    together = run(lora, [2, 3])
    alone_2 = run(lora, [2, 2])
    alone_3 = run(lora, [3, 3])
    n0 = len(PROMPTS[0])
    torch.testing.assert_close(together[:n0], alone_2[:n0], rtol=0, atol=1e-5)
    torch.testing.assert_close(together[n0:], alone_3[n0:], rtol=0, atol=1e-5)
    assert (alone_2[n0:] - alone_3[n0:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="no CUDA GPU here (run on the device)"
            ),
        ),
    ],
)
def test_a_slot_holds_exactly_the_experts_its_adapter_has(suite, device: str) -> None:
    """An adapter with some experts' weights, loaded over one with all of them, leaves no
    stale expert behind: its experts hold its weights, the others zero, as in a new slot."""
    model_dir, adapters = suite["qwen3-moe"]
    cfg = RunnerConfig(str(model_dir), device=device, lora_backend="torch", max_seqs=2, max_len=32)
    runner = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32)
    )
    manager = runner.lora
    assert manager is not None
    full = runner.read_adapter(*adapters[0])
    assert full.expert_stacks, "the fixture adapter targets the experts"
    # A CUDA worker holds what it reads page-locked (its slot copies do not hold the host).
    host = [t for s in full.expert_stacks.values() for t in (s.experts, s.a, s.b)]
    host += [t for pair in full.dense.values() for t in pair]
    assert all(t.is_pinned() == (device == "cuda") for t in host)
    # Even experts' gate and down only (up_proj left out).
    stacks = {}
    for (layer, module), stack in full.expert_stacks.items():
        even = stack.experts % 2 == 0
        if module != "up_proj":
            stacks[(layer, module)] = ExpertStack(stack.experts[even], stack.a[even], stack.b[even])
    partial = replace(full, expert_stacks=stacks)
    # (layer, expert, module) -> (A, B), one expert at a time: what the slot must hold
    kept = {
        (layer, int(e), module): (stack.a[j], stack.b[j])
        for (layer, module), stack in stacks.items()
        for j, e in enumerate(stack.experts.tolist())
    }
    assert kept
    manager.load_slot(0, full)
    manager.load_slot(0, partial)  # over the full adapter
    manager.load_slot(1, partial)  # into an empty slot
    rank = partial.rank
    for layer, experts in enumerate(manager.experts):
        assert experts is not None
        buffers = (experts.a_gate_up, experts.b_gate_up, experts.a_down, experts.b_down)
        for buf in buffers:
            assert torch.equal(buf[0], buf[1])
        i = experts.base_layer.intermediate
        expected = [torch.zeros_like(buf[1]) for buf in buffers]  # (on the device)
        for (li, e, module), (a, b) in kept.items():
            if li != layer:
                continue
            if module == "down_proj":
                expected[2][e, :rank] = a
                expected[3][e, :, :rank] = b
            else:
                expected[0][e, :rank] = a  # gate_proj's rows first (up_proj is left out)
                expected[1][e, :i, :rank] = b
        for buf, want in zip(buffers, expected, strict=True):
            assert torch.equal(buf[1], want)


def _llama_runner_and_adapter(suite):  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    cfg = RunnerConfig(str(model_dir), device="cpu", lora_backend="torch", max_seqs=2, max_len=32)
    runner = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32)
    )
    return runner.read_adapter(*adapters[0])


def test_an_adapter_whose_memory_cannot_be_locked_stays_pageable_with_a_warning(
    suite, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where host memory cannot be locked (here: no NVIDIA driver; on a GPU machine, a
    refusal injected as CUDA would raise it), a worker told to use CUDA keeps the adapter as
    read, pageable, and says what that costs; the weights are the same."""
    from loraplane.worker.lora.adapter import page_locked

    read = _llama_runner_and_adapter(suite)
    if torch.cuda.is_available():  # (this machine can lock memory: make it refuse)

        def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("CUDA error: out of memory")

        monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    with caplog.at_level(logging.WARNING, logger="loraplane.worker.lora.adapter"):
        kept = page_locked(read, torch.device("cuda"))
    assert kept is read and not any(a.is_pinned() or b.is_pinned() for a, b in kept.dense.values())
    (record,) = caplog.records
    assert f"adapter {read.name!r} stays in pageable host memory" in record.getMessage()
    assert "lockable host memory" in record.getMessage()


def test_page_locking_waits_while_a_cuda_graph_is_captured(suite) -> None:  # type: ignore[no-untyped-def]
    """CUDA refuses to allocate page-locked memory from another thread during a graph
    capture: the adapter thread's pinning waits while the engine holds the capture lock,
    and goes on when it is released (tests/gpu captures while pinning, on a GPU)."""
    import threading

    from loraplane.worker.lora.adapter import CUDA_CAPTURE_LOCK, page_locked

    read = _llama_runner_and_adapter(suite)
    done = threading.Event()
    with CUDA_CAPTURE_LOCK:  # (what DecodeGraphs holds around a capture)
        worker = threading.Thread(
            target=lambda: (page_locked(read, torch.device("cuda")), done.set())
        )
        worker.start()
        assert not done.wait(0.3), "pinned during a capture"
    assert done.wait(30), "the pinning never went on after the capture"
    worker.join()
