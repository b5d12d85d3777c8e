"""The engine (one rank, CPU) answers every bad adapter with success=false, rolls it back and
keeps serving; its residency gauges follow retired versions out of their slots."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.engine_requests import start

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.executor import ExecutorFailed, LocalExecutor
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.server import protocol as p
from loraplane.worker.server.app import WorkerServer
from loraplane.worker.server.engine_client import InThreadEngineClient
from loraplane.worker.server.metrics import WorkerMetrics

pytestmark = pytest.mark.unit

KEY_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def make_engine(model_dir: Path, kind: type[LocalExecutor] = LocalExecutor, **kw: Any) -> Engine:
    """An engine over a ``kind`` executor of the llama fixture: K=2, M=4, rank 16 (not started)."""
    executor = kind(
        RunnerConfig(str(model_dir), lora_backend="torch", max_seqs=4, max_len=64),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=4, max_lora_rank=16),
    )
    return Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=4,
        max_running=4,
        max_model_len=64,
        **kw,
    )


@pytest.fixture(scope="module")
def worker(suite) -> Iterator[tuple[Engine, WorkerMetrics]]:
    metrics = WorkerMetrics(1, 2, 4)
    engine = make_engine(suite["llama"][0], observer=metrics)
    engine.start()
    yield engine, metrics
    engine.stop()


def copy_adapter(suite, tmp_path: Path, name: str = "a8") -> Path:
    dst = tmp_path / name
    shutil.copytree(dict(suite["llama"][1])[name], dst)
    return dst


def generate(engine: Engine, adapter: str | None, tokens: int = 4) -> list[int]:
    out, done = start(engine, [5, 9, 200, 31], adapter, tokens)
    assert done.wait(60), "the request did not finish"
    return out


def slots_used(metrics: WorkerMetrics) -> float | None:
    return metrics.registry.get_sample_value("loraplane_worker_lora_slots_used", {"dp_group": "0"})


def assert_rejected_and_serving(
    engine: Engine, name: str, path: Path, *expected: str
) -> dict[str, Any]:
    loaded = dict(engine.group_adapters[0])
    result = engine.load_adapter(name, str(path)).result(timeout=60)
    assert not result.success
    assert all(part in result.error_message for part in expected), result.error_message
    assert result.loaded_adapters == loaded  # the answer reports what is really loaded
    assert engine.group_adapters[0] == loaded and name not in engine.residency.loaded_names
    assert not any(k.split("@")[0] == name for k in engine.executor.host)  # type: ignore[attr-defined]
    assert engine.alive
    assert len(generate(engine, None)) == 4
    return loaded


def test_fp8_tensor_is_a_rejection_not_a_500(worker, suite, tmp_path: Path) -> None:
    engine, _ = worker
    path = copy_adapter(suite, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors[KEY_A] = tensors[KEY_A].to(torch.float8_e4m3fn)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    assert_rejected_and_serving(engine, "fp8", path, "'fp8'", KEY_A, "F8_E4M3")


def test_unreadable_config_is_a_rejection_not_a_500(
    worker, suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = worker
    path = copy_adapter(suite, tmp_path)
    real_read_text = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == "adapter_config.json":  # as root, chmod 000 would not stop the read
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert_rejected_and_serving(
        engine, "locked", path, "'locked'", "adapter_config.json", "Permission denied"
    )


def test_config_not_utf8_is_a_rejection(worker, suite, tmp_path: Path) -> None:
    engine, _ = worker
    path = copy_adapter(suite, tmp_path)
    (path / "adapter_config.json").write_bytes(b'\xff\xfe{"r": 8}')
    assert_rejected_and_serving(engine, "latin", path, "adapter_config.json", "UTF-8")


def test_unexpected_error_while_reading_is_rolled_back(
    worker, suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the reader raises, the adapter is not reported loaded and the engine lives."""
    engine, _ = worker
    runner = engine.executor.runner  # type: ignore[attr-defined]

    def broken(name: str, path: str) -> Any:
        raise KeyError("something nobody foresaw")

    monkeypatch.setattr(runner, "read_adapter", broken)
    assert_rejected_and_serving(
        engine, "odd", copy_adapter(suite, tmp_path), "'odd'", "something nobody foresaw"
    )


def test_adapter_named_like_the_base_model_is_rejected(worker, suite, tmp_path: Path) -> None:
    engine, metrics = worker
    server = WorkerServer(
        InThreadEngineClient(engine, start=False),
        served_model="tiny-llama",
        model_root=str(suite["llama"][0]),
        allowed_lora_roots=(),
        metrics=metrics,
        faults=None,
    )
    body = p.LoadLoRAAdapterRequest(
        lora_name="tiny-llama", lora_path=str(copy_adapter(suite, tmp_path))
    )
    response = asyncio.run(server.load(body))
    answer = json.loads(bytes(response.body))
    assert response.status_code == 400 and not answer["success"]
    assert "lora_name: 'tiny-llama' is the name of the served base model" in answer["error_message"]
    assert "tiny-llama" not in engine.residency.loaded_names
    assert server.adapter_for("tiny-llama", None) is None  # still the base model


def test_slot_gauge_drops_when_a_retired_version_finishes(worker, suite, tmp_path: Path) -> None:
    """Unloading an adapter a request still runs with keeps its slot until the request ends;
    then the slot is freed and the gauge must say so."""
    engine, metrics = worker
    path = copy_adapter(suite, tmp_path)
    assert engine.load_adapter("busy", str(path)).result(timeout=60).success
    before = slots_used(metrics) or 0.0
    done, running = threading.Event(), threading.Event()

    def sink(event: SeqEvent) -> None:
        running.set()
        if event.finished:
            done.set()

    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine.submit("busy-1", [5, 9, 200], params, "busy", sink)
    assert running.wait(60)
    loads = metrics.registry.get_sample_value(
        "loraplane_worker_slot_loads_total", {"adapter": "busy"}
    )
    assert loads == 1  # the request took a slot
    assert engine.unload_adapter("busy").result(timeout=60).success  # retired, still held
    assert done.wait(60)
    with engine._lock:
        assert "busy" not in engine.residency.slots
        assert slots_used(metrics) == before == engine.residency.slots_used


def test_files_rewritten_during_the_read_are_refused(
    worker, suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter rewritten in place (a weight sync to the same path) while the DP groups read
    it could leave them with different weights: the load is refused, nothing stays loaded."""
    engine, _ = worker
    path = copy_adapter(suite, tmp_path)
    read = engine.executor.read_adapter

    def read_then_rewrite(group: int, key: str, lora_path: str) -> Any:
        out = read(group, key, lora_path)
        weights = path / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        tensors[KEY_A] = tensors[KEY_A] * 2
        save_file(tensors, str(weights))
        return out

    monkeypatch.setattr(engine.executor, "read_adapter", read_then_rewrite)
    assert_rejected_and_serving(engine, "moving", path, "changed while adapter 'moving' was read")
    monkeypatch.undo()
    assert engine.load_adapter("moving", str(path)).result(timeout=60).success  # once it is still
    assert engine.unload_adapter("moving").result(timeout=60).success


def test_an_unloaded_adapter_leaves_no_metric_series(worker, suite, tmp_path: Path) -> None:
    """Series per adapter name would otherwise pile up on a worker that churns through
    adapters and versions; a later load of the same name starts them at 0 again."""
    engine, metrics = worker
    path = copy_adapter(suite, tmp_path)

    def requests() -> float | None:
        return metrics.registry.get_sample_value(
            "loraplane_worker_requests_total", {"adapter": "churn"}
        )

    assert engine.load_adapter("churn", str(path)).result(timeout=60).success
    generate(engine, "churn")
    assert requests() == 1.0
    assert engine.unload_adapter("churn").result(timeout=60).success
    assert requests() is None
    assert engine.load_adapter("churn", str(path)).result(timeout=60).success
    assert requests() == 0.0
    assert engine.unload_adapter("churn").result(timeout=60).success


class _MarkedExecutor:
    """An executor whose token for a sequence depends only on that sequence's last input
    token ``t`` and its sampling parameters: ``t + 1`` for a greedy one, ``t + 2`` for one
    that samples. (A fake: the real tokens come from the logits.) A sequence gets its own
    tokens only if the engine pairs each row with its own result; ``seen`` records the
    ``(seed, index)`` each sequence's row carried."""

    dp_size = 1
    max_seqs = 4
    max_len = 64
    kv_pages, page_size = 16, 16

    def __init__(self, model_dir: Path) -> None:
        from loraplane.worker.config import ModelConfig

        self.model_config = ModelConfig.from_dir(model_dir)
        self.seen: dict[int, list[int]] = {}

    def step(self, work):  # type: ignore[no-untyped-def]
        from loraplane.worker.engine.executor import StepResult

        vocab = self.model_config.vocab_size
        for w in work[0]:
            if w.params.seed is not None:
                self.seen.setdefault(w.params.seed, []).append(w.index)
        return [
            StepResult([(w.tokens[-1] + (1 if w.params.greedy else 2)) % vocab for w in work[0]])
        ]

    def shutdown(self) -> None:
        pass


def test_greedy_and_sampling_sequences_in_one_step_each_get_their_own_tokens(suite) -> None:
    model_dir, _ = suite["llama"]
    executor = _MarkedExecutor(model_dir)
    engine = Engine(
        executor,  # type: ignore[arg-type]
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=1,
        max_loaded_loras=1,
        max_running=4,
        max_model_len=64,
    )
    outputs: dict[str, list[int]] = {}
    done = {name: threading.Event() for name in ("s1", "g1", "s2", "g2")}

    def sink_for(name: str) -> Any:
        def sink(event: SeqEvent) -> None:
            outputs.setdefault(name, []).extend(event.token_ids)
            if event.finished:
                done[name].set()

        return sink

    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    # submitted before the loop starts, so the four share every step, in this order
    for name, first, params in (
        ("s1", 10, sampled),
        ("g1", 20, greedy),
        ("s2", 30, replace(sampled, seed=2)),
        ("g2", 40, greedy),
    ):
        engine.submit(name, [3, first], params, None, sink_for(name))
    engine.start()
    try:
        assert all(e.wait(60) for e in done.values()), "a request did not finish"
    finally:
        engine.stop()
    # a greedy sequence follows its argmax (+1 a step), a sampling one its own logits (+2)
    assert outputs == {
        "s1": [12, 14, 16],
        "g1": [21, 22, 23],
        "s2": [32, 34, 36],
        "g2": [41, 42, 43],
    }
    # each step told a seeded sequence how many tokens it had generated (its draw's index)
    assert executor.seen == {1: [0, 1, 2], 2: [0, 1, 2]}


class _SlowReads(LocalExecutor):
    """A LocalExecutor whose adapter reads wait for the test to let them finish."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reading = threading.Event()
        self.finish_read = threading.Event()

    def read_adapter(self, dp_group: int, name: str, path: str):  # type: ignore[no-untyped-def]
        self.reading.set()
        assert self.finish_read.wait(60), "the test never let the read finish"
        return super().read_adapter(dp_group, name, path)


def test_running_requests_keep_generating_while_an_adapter_is_read(suite) -> None:
    """Reading an adapter (seconds for a large one) holds no step: a running request's
    tokens keep coming until the read ends, and the adapter then serves."""
    model_dir, adapters = suite["llama"]
    engine = make_engine(model_dir, _SlowReads)
    executor = cast(_SlowReads, engine.executor)
    engine.start()
    try:
        tokens, done = start(engine, [5, 9, 200, 31], None, 24)
        loading = engine.load_adapter("a8", str(dict(adapters)["a8"]))
        assert executor.reading.wait(60)
        before, waited = len(tokens), time.monotonic() + 30
        while len(tokens) < before + 3 and not done.is_set() and time.monotonic() < waited:
            time.sleep(0.01)
        during = len(tokens) - before
        assert not loading.done()  # the read still waits
        executor.finish_read.set()
        assert during >= 3 or done.is_set(), f"{during} tokens in 30 s while the read waited"
        assert loading.result(timeout=60).success
        assert len(generate(engine, "a8")) == 4
        assert done.wait(60) and len(tokens) == 24
    finally:
        executor.finish_read.set()
        engine.stop()


class _BrokenReads(LocalExecutor):
    def read_adapter(self, dp_group: int, name: str, path: str):  # type: ignore[no-untyped-def]
        raise ExecutorFailed("rank 1 exited during 'read'")


def test_an_executor_failing_during_a_read_is_not_blamed_on_the_adapter(suite) -> None:
    """A broken executor (a dead rank) met while reading is the worker's failure: the load
    fails with it, and the worker stops reporting itself alive (its health check fails)."""
    model_dir, adapters = suite["llama"]
    engine = make_engine(model_dir, _BrokenReads)
    engine.start()
    try:
        with pytest.raises(ExecutorFailed, match="rank 1 exited"):
            engine.load_adapter("a8", str(dict(adapters)["a8"])).result(timeout=60)
        assert not engine.alive
        assert "a8" not in engine.residency.loaded_names
    finally:
        engine.stop()


class _SlowSlotLoads(LocalExecutor):
    """A LocalExecutor whose slot loads report themselves still copying to the first
    ``held`` steps that ask (a GPU's copy stream, slowed down: the CPU copies at once).
    Asked to wait for them, it records that and returns, as a GPU would once the copy ends."""

    held = 3

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loads: list[int] = []
        self.polls = 0
        self.waits = 0

    def load_slot(self, slot: int, name: str) -> None:
        super().load_slot(slot, name)
        self.loads.append(slot)

    def loaded_slots(self, slots: list[int], wait: bool = False) -> set[int]:
        if wait:
            self.waits += 1
            return set(slots)
        self.polls += 1
        return set(slots) if self.polls > self.held else set()


def test_running_requests_keep_generating_while_an_adapter_copies_into_its_slot(suite) -> None:
    """A slot load copies beside the steps (ADR 0011): a base request gets tokens while the
    adapter's slot copies, the adapter's request gets none until the copy is done, and then
    gets the same tokens as without the wait."""
    model_dir, adapters = suite["llama"]
    reference = make_engine(model_dir)
    reference.start()
    try:
        assert reference.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
        expected = generate(reference, "a8", 6)
    finally:
        reference.stop()
    engine = make_engine(model_dir, _SlowSlotLoads)
    executor = cast(_SlowSlotLoads, engine.executor)
    order: list[str] = []  # whose each token was, as the engine emitted them
    tokens: dict[str, list[int]] = {"base": [], "lora": []}
    done = {name: threading.Event() for name in tokens}

    def sink_for(name: str) -> Any:
        def sink(event: SeqEvent) -> None:
            assert event.error is None, event.error
            tokens[name].extend(event.token_ids)
            order.extend([name] * len(event.token_ids))
            if event.finished:
                done[name].set()

        return sink

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    engine.start()
    try:
        assert engine.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
        # submitted together: both are admitted in one step, the adapter's slot load with it
        with engine._wake:
            engine.submit("base", [5, 9, 200, 31], params(10), None, sink_for("base"))
            engine.submit("lora", [5, 9, 200, 31], params(6), "a8", sink_for("lora"))
        assert done["base"].wait(60) and done["lora"].wait(60)
    finally:
        engine.stop()
    assert executor.loads == [0]
    assert order[: _SlowSlotLoads.held] == ["base"] * _SlowSlotLoads.held, order
    assert tokens["lora"] == expected
    assert executor.polls == _SlowSlotLoads.held + 1 and executor.waits == 0


def test_a_step_with_only_copying_adapters_waits_for_their_copy(suite) -> None:
    """When every running request waits for a slot still copying, the step waits for the
    copy instead of spinning, and the requests are served."""
    model_dir, adapters = suite["llama"]
    engine = make_engine(model_dir, _SlowSlotLoads)
    executor = cast(_SlowSlotLoads, engine.executor)
    engine.start()
    try:
        assert engine.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
        assert len(generate(engine, "a8", 5)) == 5
        assert executor.loads == [0] and executor.waits == 1
    finally:
        engine.stop()
