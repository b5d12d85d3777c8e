"""How a multi-rank worker sorts its ranks' answers to launched steps (ADR 0014): every rank
answers its steps in order into one queue, so one rank's answers to later steps, its failure
included, can come before another rank's answer to the step being read."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest

from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.launch import RankFailed

pytestmark = pytest.mark.unit


def _collector(answers: list[tuple[str, int, tuple[int, Any]]]) -> tuple[Any, Any]:
    outbox: queue.Queue[Any] = queue.Queue()
    for answer in answers:
        outbox.put(answer)
    alive = SimpleNamespace(is_alive=lambda: True)
    return SimpleNamespace(_procs=[alive, alive]), outbox


def test_a_later_steps_failure_waits_for_its_turn() -> None:
    # rank 1 is ahead: step 0, step 1, then its failure on step 2; rank 0 answers after it
    owner, outbox = _collector(
        [
            ("ok", 1, (0, "r1s0")),
            ("ok", 1, (1, "r1s1")),
            ("error", 1, (2, "Traceback: IndexError")),
            ("ok", 0, (0, "r0s0")),
            ("ok", 0, (1, "r0s1")),
            ("ok", 0, (2, "r0s2")),
        ]
    )
    later: dict[int, list[Any]] = {}
    collect = MultiRankExecutor._collect
    assert collect(owner, "launch", outbox, 0, later) == [("ok", "r0s0"), ("ok", "r1s0")]
    assert collect(owner, "launch", outbox, 1, later) == [("ok", "r0s1"), ("ok", "r1s1")]
    with pytest.raises(RankFailed, match="rank 1 failed during 'launch':\nTraceback: IndexError"):
        collect(owner, "launch", outbox, 2, later)
