"""Overlapped steps (ADR 0014) on a multi-rank worker: ``MultiRankExecutor.launch`` sends a
step before the last one's tokens are read, and every rank feeds its group's carried rows
from its own previous step's ids on its device. A user gets the tokens, logprobs and ends of
steps taken in turn, at tp=2 dp=2 with DP attention and at tp=2 (plain TP); a rank that
raises or dies while steps are in flight fails the step that is read as ``ExecutorFailed``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tests.unit.runtime.test_overlapped_steps import ADAPTERS, PROMPTS, Request, run

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.executor import ExecutorFailed, SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.multirank

TOKENS = 10


def executor_for(model_dir: Path, pconf: ParallelConfig, **runner: Any) -> MultiRankExecutor:
    """Ranks of the llama fixture (``runner``: RunnerConfig fields over the CPU's)."""
    return MultiRankExecutor(
        pconf,
        RunnerConfig(
            str(model_dir), max_seqs=4, max_len=64, **({"lora_backend": "torch"} | runner)
        ),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )


def logprobs_of(r: Request) -> list[Any]:
    return [lp for e in r.events for lp in e.logprobs]


def serve(
    executor: MultiRankExecutor,
    model_dir: Path,
    adapters: dict[str, Path],
    requests: list[Request],
    overlap: bool,
    eos: int | None = None,
) -> Engine:
    """An engine over ``executor`` (left running for the next) serving ``requests``
    together (one step admits them all), each ending on ``eos`` where given."""
    engine = Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_running=len(requests),
        max_model_len=64,
        overlap=overlap,
    )
    if eos is not None:
        engine.tokenizer.eos_token_ids = frozenset({eos})
    engine.start()
    try:
        for name in ("a8", "a16"):
            assert engine.load_adapter(name, str(adapters[name])).result(60).success
        run(engine, requests)
    finally:
        engine.stop(shutdown_executor=False)
    return engine


def greedy(tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, temperature=0.0, **kw)


def mix(ref: list[list[int]]) -> tuple[list[Request], int]:
    """Requests of different lengths ending every way (length, a stop id, EOS, an abort),
    with and without adapters and logprobs, one seeded; and the EOS id they end on."""
    eos = ref[2][5]
    return [
        Request(PROMPTS[0], None, greedy(3, ignore_eos=True, logprobs=2)),
        Request(PROMPTS[1], "a8", greedy(9, stop_token_ids=(ref[1][4],), logprobs=0)),
        Request(PROMPTS[2], "a16", greedy(TOKENS)),  # ends on EOS
        Request(PROMPTS[3], None, greedy(TOKENS, ignore_eos=True), abort_after=2),
        Request(PROMPTS[4], "a8", greedy(1, logprobs=1)),
        Request(
            PROMPTS[5],
            "a16",
            SamplingParams(max_new_tokens=7, temperature=0.9, seed=11, ignore_eos=True),
        ),
        # unseeded: a group's ranks take their leader's draw (its tokens differ run to run)
        Request(PROMPTS[0], "a8", SamplingParams(max_new_tokens=5, top_k=4, ignore_eos=True)),
    ], eos


def close(a: list[Any], b: list[Any], tolerance: float) -> bool:
    """Logprobs equal in tokens and alternatives, values within ``tolerance`` (the batches
    differ: an overlapped step may carry a lagged row)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.token != y.token or [t for t, _ in x.top] != [t for t, _ in y.top]:
            return False
        values = [(x.logprob, y.logprob)] + [
            (p, q) for (_, p), (_, q) in zip(x.top, y.top, strict=True)
        ]
        if not all(math.isclose(p, q, abs_tol=tolerance) for p, q in values):
            return False
    return True


# tp=2 dp=2 with DP attention, and plain TP
each_layout = pytest.mark.parametrize(
    "pconf",
    [ParallelConfig(tp=2, dp=2, dp_attention=True), ParallelConfig(tp=2, dp=1)],
    ids=["tp2-dp2-dp_attention", "tp2"],
)


@each_layout
def test_overlapped_ranks_give_the_tokens_logprobs_and_ends_of_steps_in_turn(
    suite: dict[str, tuple[Path, list[tuple[str, Path]]]], pconf: ParallelConfig
) -> None:
    check_overlapped_ranks(suite, pconf)


def check_overlapped_ranks(
    suite: dict[str, tuple[Path, list[tuple[str, Path]]]],
    pconf: ParallelConfig,
    tolerance: float = 1e-5,
    **runner: Any,
) -> None:
    """The mix served overlapped on ``pconf``'s ranks gives what it gets in turn there."""
    model_dir, adapter_list = suite["llama"]
    adapters = dict(adapter_list)
    executor = executor_for(model_dir, pconf, **runner)
    try:
        reference = [
            Request(p, a, greedy(TOKENS, ignore_eos=True))
            for p, a in zip(PROMPTS, ADAPTERS, strict=True)
        ]
        serve(executor, model_dir, adapters, reference, overlap=False)
        ref = [r.tokens for r in reference]
        in_turn, eos = mix(ref)
        serve(executor, model_dir, adapters, in_turn, overlap=False, eos=eos)
        overlapped, _ = mix(ref)
        engine = serve(executor, model_dir, adapters, overlapped, overlap=True, eos=eos)
    finally:
        executor.shutdown()
    assert engine.overlap
    assert [r.outcome for r in overlapped[:6]] == [r.outcome for r in in_turn[:6]]
    assert overlapped[6].outcome[1:] == ("length", None, 5)
    stop_at = ref[1].index(ref[1][4])
    eos_at = ref[2].index(eos)
    assert [r.outcome for r in overlapped][:5] == [
        (ref[0][:3], "length", None, 3),
        (ref[1][:stop_at], "stop", ref[1][4], stop_at + 1),
        (ref[2][:eos_at], "stop", eos, eos_at + 1),
        (ref[3][:2], "abort", None, 2),
        (ref[4][:1], "length", None, 1),
    ]
    assert len(overlapped[5].tokens) == 7
    for a, b in zip(overlapped[:6], in_turn[:6], strict=True):
        assert close(logprobs_of(a), logprobs_of(b), tolerance), (logprobs_of(a), logprobs_of(b))
    assert [len(logprobs_of(r)) for r in overlapped[:2]] == [3, stop_at]  # (none for a stop id)
    assert [len(logprobs_of(r)[0].top) for r in (overlapped[0], overlapped[4])] == [2, 1]
    assert [p.exitcode for p in executor._procs] == [0, 0]


def test_a_rank_that_raises_or_dies_in_flight_fails_the_step_read(
    suite: dict[str, tuple[Path, list[tuple[str, Path]]]],
) -> None:
    """Launched steps are read in order: the step before a failing launch still gives its
    tokens; the failing one raises ``ExecutorFailed`` naming the rank, as a step in turn
    does. A killed rank fails the next read too."""
    model_dir, _ = suite["llama"]
    executor = executor_for(model_dir, ParallelConfig(tp=2, dp=2, dp_attention=True))
    try:
        first = executor.launch([[SeqWork(0, 0, (5, 9, 200))], [SeqWork(0, 0, (7, 7))]], None)
        # carried rows read the step before on their ranks' devices
        second = executor.launch(
            [[SeqWork(0, 3, (0,), carry=0)], [SeqWork(0, 2, (0,), carry=0)]], first
        )
        with pytest.raises(ValueError, match=r"work\[1\]\[0\]\.carry is 1; DP group 1"):
            executor.launch([[], [SeqWork(0, 3, (0,), carry=1)]], second)
        # group 1's ranks cannot write a row past their page table
        broken = executor.launch([[SeqWork(1, 0, (4,))], [SeqWork(99, 0, (4,))]], second)
        assert len(first.tokens()) == 2 and len(second.tokens()) == 2
        with pytest.raises(ExecutorFailed, match=r"rank \d failed during 'launch'"):
            broken.tokens()
    finally:
        executor.shutdown()
    executor = executor_for(model_dir, ParallelConfig(tp=2, dp=1))
    try:
        step = executor.launch([[SeqWork(0, 0, (5, 9, 200))]], None)
        executor._procs[1].kill()
        after = executor.launch([[SeqWork(0, 3, (0,), carry=0)]], step)
        with pytest.raises(ExecutorFailed, match=r"rank"):
            step.tokens()
            after.tokens()
    finally:
        executor.shutdown()
