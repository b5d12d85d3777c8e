"""Chunked prefill (ADR 0017) on one CPU rank: prompts fed a few tokens a step give the tokens
and ends of whole-prompt prefills, running requests keep decoding while a long prompt is
fed, and a step never feeds more prompt tokens than its budget."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from tests.unit.runtime.test_overlapped_steps import (
    ADAPTERS,
    PROMPTS,
    Model,
    Request,
    _sink,
    mix,
    run,
    serve_on,
)
from tests.unit.runtime.test_overlapped_steps import (
    make_engine as overlapped_engine,
)

from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import Sequence

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(suite: dict[str, tuple[Path, list[tuple[str, Path]]]]) -> Model:
    model_dir, adapters = suite["llama"]
    return model_dir, dict(adapters)


LONG = [(i * 37 + 11) % 250 + 3 for i in range(29)]  # a prompt of 29 tokens


class RecordingEngine(Engine):
    """The engine, keeping each step's plan: who steps, fed how many prompt tokens."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.plans: list[list[tuple[str, int | None]]] = []

    def _plan(self, running: list[Sequence]) -> list[tuple[Sequence, int | None]]:
        plan = super()._plan(running)
        self.plans.append([(seq.request_id, take) for seq, take in plan])
        return plan


def make_engine(
    model_dir: Path, *, chunk: int, overlap: bool = False, step_tokens: int = 0
) -> RecordingEngine:
    engine = overlapped_engine(
        model_dir,
        overlap,
        engine_cls=RecordingEngine,
        chunked_prefill_size=chunk,
        step_tokens=step_tokens,
    )
    assert isinstance(engine, RecordingEngine)
    return engine


def serve(
    model: Model,
    requests: list[Request],
    *,
    chunk: int,
    overlap: bool = False,
    eos: int | None = None,
    step_tokens: int = 0,
) -> RecordingEngine:
    engine = make_engine(model[0], chunk=chunk, overlap=overlap, step_tokens=step_tokens)
    serve_on(engine, model, requests, eos)
    return engine


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)


def fed_prompt_tokens(engine: RecordingEngine) -> list[int]:
    """The prompt tokens each step fed."""
    return [sum(take or 0 for _, take in plan) for plan in engine.plans]


@pytest.fixture(scope="module")
def whole(model: Model) -> list[list[int]]:
    """Greedy tokens of the prompts and LONG, whole prompts in one step each."""
    requests = [Request(p, a, greedy(10)) for p, a in zip(PROMPTS, ADAPTERS, strict=True)]
    requests.append(Request(LONG, "a8", greedy(10)))
    serve(model, requests, chunk=0)
    return [r.tokens for r in requests]


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prompts_give_the_tokens_of_whole_prompts(
    model: Model, whole: list[list[int]], chunk: int, overlap: bool
) -> None:
    requests = [Request(p, a, greedy(10)) for p, a in zip(PROMPTS, ADAPTERS, strict=True)]
    requests.append(Request(LONG, "a8", greedy(10)))
    engine = serve(model, requests, chunk=chunk, overlap=overlap)
    assert [r.tokens for r in requests] == whole
    assert all(r.events[-1].finish_reason == "length" for r in requests)
    fed = fed_prompt_tokens(engine)
    assert max(fed) <= chunk, f"a step fed {max(fed)} prompt tokens with a budget of {chunk}"
    # each event carries real tokens only: no event before the prompt is fed
    assert all(e.token_ids or e.finished for r in requests for e in r.events)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_chunked_prefill_keeps_every_way_a_request_ends(
    model: Model, whole: list[list[int]], overlap: bool
) -> None:
    """Length, stop ids, EOS, aborts and one-token requests end as with whole prompts."""
    reference, _ = mix(whole)
    _, eos = mix(whole)
    serve(model, reference, chunk=0, eos=eos)
    chunked, _ = mix(whole)
    serve(model, chunked, chunk=2, overlap=overlap, eos=eos)
    assert [r.outcome for r in chunked] == [r.outcome for r in reference]


def test_running_requests_decode_while_a_long_prompt_is_fed(
    model: Model, whole: list[list[int]]
) -> None:
    """A request already decoding gets a token on each step that feeds a chunk of LONG."""
    engine = make_engine(model[0], chunk=4)
    for name in ("a8", "a16"):
        assert engine.load_adapter(name, str(model[1][name])).result(60).success
    # (64 tokens: it must still be decoding through LONG's 8 chunks however late the test's
    # thread submits LONG on a loaded machine)
    first = Request(PROMPTS[0], None, greedy(64))
    try:
        first.seq = engine.submit(
            "first", first.prompt, first.params, None, partial(_sink, engine, first)
        )
        while len(first.tokens) < 2:  # decoding now
            assert not first.done.wait(0.01), "the first request ended before LONG came"
        second = Request(LONG, "a8", greedy(4))
        run(engine, [second])
        assert first.done.wait(120)
    finally:
        engine.stop()
    assert second.tokens == whole[-1][:4]
    beside = [
        plan
        for plan in engine.plans
        if any(rid == "r0" and take for rid, take in plan)
        and any(rid == "first" and take is None for rid, take in plan)
    ]
    # LONG (29 tokens) goes in 8 chunks of at most 4, each beside a decode of the first
    assert len(beside) == 8, engine.plans


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_a_step_cap_keeps_decode_rows_and_chunks_under_it(
    model: Model, whole: list[list[int]], overlap: bool
) -> None:
    """With ``step_tokens`` (a step fits the largest prompt graph), the prompt chunks get
    what the decode rows leave of the cap, and at least half of it however many rows
    decode: the same tokens as whole prompts."""
    cap = 7
    requests = [Request(p, a, greedy(10)) for p, a in zip(PROMPTS, ADAPTERS, strict=True)]
    requests.append(Request(LONG, "a8", greedy(10)))
    engine = serve(model, requests, chunk=0, overlap=overlap, step_tokens=cap)
    assert [r.tokens for r in requests] == whole
    for plan in engine.plans:
        decodes = sum(take is None for _, take in plan)
        fed = sum(take or 0 for _, take in plan)
        assert fed <= max(cap - decodes, cap // 2), plan
    # LONG (29 tokens) needed chunks: some step fed it exactly what the decodes left
    assert any(
        take == cap - sum(t is None for _, t in plan)
        for plan in engine.plans
        for rid, take in plan
        if take and rid == f"r{len(requests) - 1}"
    ), engine.plans
    assert engine.prompt_budget(0) == cap
    assert engine.prompt_budget(2) == cap - 2
    assert engine.prompt_budget(6) == cap // 2


def test_serve_config_chunked_prefill_reaches_the_engine(model: Model) -> None:
    from loraplane.worker.config import ConfigError
    from loraplane.worker.server.factory import DEFAULT_CHUNK, ServeConfig, build_engine

    config = ServeConfig(model=str(model[0]), lora_backend="torch", max_running=2)
    # by default a step fits the largest prompt graph where there are any, else 4096 tokens
    assert config.chunked_prefill_size is None
    assert config.step_budget((64, 512, 1024)) == (0, 1023)
    assert config.step_budget(()) == (DEFAULT_CHUNK, 0) == (4096, 0)
    assert replace(config, chunked_prefill_size=960).step_budget((64, 1024)) == (960, 0)
    default = build_engine(config)  # (no prompt graphs on a CPU)
    assert (default.chunked_prefill_size, default.step_tokens) == (4096, 0)
    engine = build_engine(replace(config, chunked_prefill_size=3))
    engine.start()
    try:
        assert engine.chunked_prefill_size == 3
        request = Request(LONG, None, greedy(2))
        run(engine, [request])
        assert len(request.tokens) == 2
    finally:
        engine.stop()
    with pytest.raises(ConfigError, match="--chunked-prefill-size must be >= 0"):
        replace(config, chunked_prefill_size=-1)


def test_a_prompt_scored_for_its_logprobs_is_fed_whole(model: Model) -> None:
    """Prompt log probabilities come from one prefill's logits, so a request asking for
    them is fed its prompt in one piece whatever the budget: the same values as without
    chunking."""
    scored = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    got = []
    for chunk in (0, 4):
        request = Request(LONG, "a8", scored)
        engine = serve(model, [request], chunk=chunk)
        prompt = [lp for e in request.events for lp in e.prompt_logprobs or ()]
        assert len(prompt) == len(LONG) - 1  # (the first token has none)
        got.append((request.tokens, [(lp.token, round(lp.logprob, 5)) for lp in prompt]))
        assert [take for plan in engine.plans for _, take in plan if take] == [len(LONG)]
    assert got[0] == got[1]


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_the_worker_metrics_split_steps_by_kind_and_time_each_request(
    model: Model, overlap: bool
) -> None:
    """What /metrics tells an operator about latency inside the engine: every loop pass that
    launched a step is counted under the kind of its plan (mixed: it fed prompt tokens), and
    every request gets one queue wait and one time to first token, the one admitted after
    the other finished included."""
    from loraplane.worker.server.metrics import WorkerMetrics

    metrics = WorkerMetrics(dp_size=1, max_loras_per_batch=2, max_loaded_loras=4)
    engine = overlapped_engine(
        model[0],
        overlap,
        max_running=1,
        engine_cls=RecordingEngine,
        chunked_prefill_size=8,
        observer=metrics,
    )
    assert isinstance(engine, RecordingEngine)
    requests = [Request(LONG, None, greedy(5)), Request(LONG[:20], "a8", greedy(4))]
    serve_on(engine, model, requests, None)
    assert [len([t for e in r.events for t in e.token_ids]) for r in requests] == [5, 4]

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, f"{name}{labels} is not exported"
        return value

    mixed = sum(1 for plan in engine.plans if any(take is not None for _, take in plan))
    assert mixed == 4 + 3  # 29 prompt tokens in chunks of 8, then 20
    assert sample("loraplane_worker_step_seconds_count", kind="mixed") == mixed
    assert sample("loraplane_worker_step_seconds_count", kind="decode") == len(engine.plans) - mixed
    assert sample("loraplane_worker_step_seconds_sum", kind="mixed") > 0
    assert sample("loraplane_worker_queue_seconds_count") == 2
    assert sample("loraplane_worker_first_token_seconds_count") == 2
    assert sample("loraplane_worker_first_token_seconds_sum") > 0
