"""Overlapped steps (ADR 0014) on one CPU rank: the tokens a user gets, their finish reasons,
and the KV rows of finished requests are those of steps taken in turn, though every token is
read one step late and a request that ended may have run one more step."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.executor import LocalExecutor, PendingStep, SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import SeqEvent, Sequence
from loraplane.worker.engine.tokenizer import TextTokenizer

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [17, 4, 88], [250, 3, 3, 61, 7], [12, 140], [99, 98, 97], [7]]


class RecordingExecutor(LocalExecutor):
    """The real one-rank executor, keeping each launch's work and the step it carried from."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.launches: list[tuple[list[SeqWork], list[SeqWork] | None]] = []
        self._work_of: dict[int, list[SeqWork]] = {}

    def launch(self, work: list[list[SeqWork]], after: PendingStep | None) -> PendingStep:
        step = super().launch(work, after)
        self.launches.append((work[0], self._work_of.get(id(after)) if after else None))
        self._work_of = {id(step): work[0]}  # (only the last step can be carried from)
        return step


def make_engine(
    model_dir: Path,
    overlap: bool,
    max_running: int = 4,
    *,
    engine_cls: type[Engine] = Engine,
    executor_cls: type[LocalExecutor] | None = None,
    max_seqs: int = 4,
    runner_kw: dict[str, Any] | None = None,
    **engine_kw: Any,
) -> Engine:
    """A started engine over the llama fixture on a recording one-rank executor
    (``RecordingExecutor`` unless ``executor_cls``); ``runner_kw`` adds RunnerConfig fields."""
    executor = (executor_cls or RecordingExecutor)(
        RunnerConfig(
            str(model_dir), lora_backend="torch", max_seqs=max_seqs, max_len=64, **(runner_kw or {})
        ),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=4, max_lora_rank=16),
    )
    engine = engine_cls(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=4,
        max_running=max_running,
        max_model_len=64,
        overlap=overlap,
        **engine_kw,
    )
    engine.start()
    return engine


@dataclass
class Request:
    prompt: list[int]
    adapter: str | None
    params: SamplingParams
    abort_after: int | None = None  # the sink aborts the request once it has this many tokens
    events: list[SeqEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def outcome(self) -> tuple[list[int], str | None, int | str | None, int]:
        last = self.events[-1]
        return self.tokens, last.finish_reason, last.matched_stop, last.completion_tokens


def _sink(engine: Engine, r: Request, event: SeqEvent) -> None:
    assert event.error is None, event.error
    assert not r.done.is_set(), f"an event after the end: {event}"
    r.events.append(event)
    if r.abort_after is not None and len(r.tokens) >= r.abort_after and not event.finished:
        assert r.seq is not None
        engine.abort(r.seq)
    if event.finished:
        r.done.set()


def run(engine: Engine, requests: list[Request]) -> list[Request]:
    """Submit ``requests`` together (one step admits them all) and wait for them all."""
    with engine._lock:  # (the engine's next step waits for all of them)
        for i, r in enumerate(requests):
            r.seq = engine.submit(f"r{i}", r.prompt, r.params, r.adapter, partial(_sink, engine, r))
    for r in requests:
        assert r.done.wait(120), "a request did not finish"
    return requests


Model = tuple[Path, dict[str, Path]]  # the llama fixture and its adapters by name


@pytest.fixture(scope="module")
def model(suite: dict[str, tuple[Path, list[tuple[str, Path]]]]) -> tuple[Path, dict[str, Path]]:
    model_dir, adapters = suite["llama"]
    return model_dir, dict(adapters)


@pytest.fixture(scope="module")
def reference(model: Model) -> Iterator[list[list[int]]]:
    """Each prompt's 12 greedy tokens (the adapters of ``mix``), steps taken in turn."""
    engine = make_engine(model[0], overlap=False)
    for name in ("a8", "a16"):
        assert engine.load_adapter(name, str(model[1][name])).result(60).success
    requests = [
        Request(p, adapter, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        for p, adapter in zip(PROMPTS, ADAPTERS, strict=True)
    ]
    try:
        yield [r.tokens for r in run(engine, requests)]
    finally:
        engine.stop()


ADAPTERS = [None, "a8", "a16", None, "a8", "a16"]


def mix(ref: list[list[int]]) -> tuple[list[Request], int]:
    """A batch of base and adapter requests ending every way, and the EOS id it uses."""
    eos = ref[2][5]
    return [
        Request(
            PROMPTS[0], None, SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0)
        ),
        Request(
            PROMPTS[1],
            "a8",
            SamplingParams(max_new_tokens=9, stop_token_ids=(ref[1][4],), temperature=0.0),
        ),
        Request(PROMPTS[2], "a16", SamplingParams(max_new_tokens=10, temperature=0.0)),  # EOS
        Request(
            PROMPTS[3],
            None,
            SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0),
            abort_after=2,
        ),
        Request(PROMPTS[4], "a8", SamplingParams(max_new_tokens=1, temperature=0.0)),
        Request(
            PROMPTS[5], "a16", SamplingParams(max_new_tokens=11, ignore_eos=True, temperature=0.0)
        ),
    ], eos


def serve_on(engine: Engine, model: Model, requests: list[Request], eos: int | None) -> None:
    """Load the adapters on a started ``engine``, run ``requests`` (ending on ``eos`` when
    given) and stop it."""
    if eos is not None:
        engine.tokenizer.eos_token_ids = frozenset({eos})
    for name in ("a8", "a16"):
        assert engine.load_adapter(name, str(model[1][name])).result(60).success
    try:
        run(engine, requests)
    finally:
        engine.stop()


def serve_mix(model: Model, ref: list[list[int]], overlap: bool) -> tuple[list[Request], Engine]:
    engine = make_engine(model[0], overlap=overlap)
    requests, eos = mix(ref)
    serve_on(engine, model, requests, eos)
    return requests, engine


def test_overlapped_steps_give_the_tokens_and_ends_of_steps_in_turn(
    model: Model, reference: list[list[int]]
) -> None:
    in_turn, _ = serve_mix(model, reference, overlap=False)
    overlapped, engine = serve_mix(model, reference, overlap=True)
    assert engine.overlap
    assert [r.outcome for r in overlapped] == [r.outcome for r in in_turn]
    ref = reference
    stop_at = ref[1].index(ref[1][4])
    eos_at = ref[2].index(ref[2][5])
    assert [r.outcome for r in overlapped] == [
        (ref[0][:3], "length", None, 3),
        (ref[1][:stop_at], "stop", ref[1][4], stop_at + 1),
        (ref[2][:eos_at], "stop", ref[2][5], eos_at + 1),
        (ref[3][:2], "abort", None, 2),
        (ref[4][:1], "length", None, 1),
        (ref[5][:11], "length", None, 11),
    ]


def test_the_lagged_step_emits_nothing(model: Model, reference: list[list[int]]) -> None:
    """A request that ended on a stop id still ran one more row (its token is dropped); no
    request gets a token past its end, or any event after its last."""
    requests, engine = serve_mix(model, reference, overlap=True)
    executor = engine.executor
    assert isinstance(executor, RecordingExecutor)
    for r in requests:
        assert [e.finished for e in r.events] == [False] * (len(r.events) - 1) + [True]
        assert len(r.tokens) <= r.params.max_new_tokens
    # the stop-id request (a8, PROMPTS[1]) ran in a step after the one that sampled its stop
    stop_request = requests[1]
    assert stop_request.seq is not None
    positions = len(PROMPTS[1]) + stop_request.events[-1].completion_tokens
    rows = [
        w
        for work, _ in executor.launches
        for w in work
        if w.cache_row == stop_request.seq.cache_row and w.carry >= 0 and w.start == positions - 1
    ]
    assert rows, "the lagged row of the stop-id request was never launched"


def test_a_finished_requests_kv_row_waits_for_its_lagged_step(
    model: Model, reference: list[list[int]]
) -> None:
    """With one running request at a time, the request waiting behind one that ends on EOS
    gets its KV row only once no step in flight still runs the finished one there."""
    engine = make_engine(model[0], overlap=True, max_running=1)
    eos = reference[2][5]
    engine.tokenizer.eos_token_ids = frozenset({eos})
    assert engine.load_adapter("a16", str(model[1]["a16"])).result(60).success
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    requests = [Request(PROMPTS[2], "a16", greedy), Request(PROMPTS[2], "a16", greedy)]
    try:
        run(engine, requests)
    finally:
        engine.stop()
    eos_at = reference[2].index(eos)
    for r in requests:
        assert r.outcome == (reference[2][:eos_at], "stop", eos, eos_at + 1)
    executor = engine.executor
    assert isinstance(executor, RecordingExecutor)
    prefills = 0
    for work, in_flight in executor.launches:
        for w in work:
            if w.start == 0 and w.carry < 0:
                prefills += 1
                busy = {x.cache_row for x in in_flight or ()}
                assert w.cache_row not in busy, "a KV row reused while a lagged step runs it"
    assert prefills == 2
    # the first request's lagged row ran (past its EOS), so the check above had work to do
    assert any(w.start == len(PROMPTS[2]) + eos_at for work, _ in executor.launches for w in work)


@pytest.mark.parametrize("overlap", [False, True])
def test_serve_config_overlap_reaches_the_engine(model: Model, overlap: bool) -> None:
    """A one-rank worker's engine overlaps by default, and ``worker serve --no-overlap``
    builds one that steps in turn."""
    from loraplane.worker.server.factory import ServeConfig, build_engine

    config = ServeConfig(model=str(model[0]), lora_backend="torch", max_running=2)
    engine = build_engine(config if overlap else replace(config, overlap=False))
    try:
        assert ServeConfig(model=str(model[0])).overlap
        assert engine.overlap is overlap
        engine.start()
        request = Request(PROMPTS[0], None, SamplingParams(max_new_tokens=4, temperature=0.0))
        run(engine, [request])
        assert request.events[-1].finished and len(request.tokens) <= 4
    finally:
        engine.stop()


def test_seeded_sampling_draws_the_same_tokens_overlapped(model: Model) -> None:
    """A seeded request's draw depends on its token's index, which counts the token still in
    flight when the next step is launched: the same tokens with and without overlap."""
    outcomes = []
    for overlap in (False, True):
        engine = make_engine(model[0], overlap=overlap)
        assert engine.load_adapter("a8", str(model[1]["a8"])).result(60).success
        requests = [
            Request(
                p,
                adapter,
                SamplingParams(max_new_tokens=8, temperature=0.9, seed=7 + i, ignore_eos=True),
            )
            for i, (p, adapter) in enumerate(
                zip(PROMPTS[:4], [None, "a8", "a8", None], strict=True)
            )
        ]
        try:
            run(engine, requests)
        finally:
            engine.stop()
        outcomes.append([r.outcome for r in requests])
    assert outcomes[0] == outcomes[1]
    assert all(len(o[0]) == 8 for o in outcomes[1])
