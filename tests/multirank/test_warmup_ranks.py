"""The warm-up on a multi-rank worker (``engine.warmup`` through ``MultiRankExecutor``): every
rank holds the blank adapter, takes its steps and collectives in step, watches its Triton
compiles after it (``engine.compile_watch``), and serves after it the tokens that a worker
without the warm-up serves."""

from __future__ import annotations

import pytest

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.executor import SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.warmup import plan_for, warm_up
from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.multirank


def _tokens(suite, warmup: bool) -> list[list[int]]:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    executor = MultiRankExecutor(
        ParallelConfig(tp=2, dp=2, dp_attention=True),
        RunnerConfig(str(model_dir), max_seqs=2, max_len=32, lora_backend="torch"),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )
    try:
        if warmup:
            report = warm_up(executor, plan_for(2, 32, 2, 16))
            assert report.steps > 0 and any(p.startswith("LoRA") for p in report.phases)
            # what the worker does next: every rank logs the kernels it compiles from now on
            assert executor.after_warmup()
        for group in (0, 1):
            executor.read_adapter(group, "a8", str(dict(adapters)["a8"]))
        executor.load_slot(1, "a8")
        work = [
            [SeqWork(0, 0, (5, 9, 200), slot=1), SeqWork(1, 0, (44, 2), slot=-1)],
            [SeqWork(0, 0, (7, 7, 8), slot=1)],
        ]
        first = executor.step(work)
        decode = [
            [SeqWork(0, 3, (first[0].tokens[0],), slot=1), SeqWork(1, 2, (first[0].tokens[1],))],
            [SeqWork(0, 3, (first[1].tokens[0],), slot=1)],
        ]
        second = executor.step(decode)
        return [first[0].tokens + second[0].tokens, first[1].tokens + second[1].tokens]
    finally:
        executor.shutdown()


def test_a_warmed_multirank_worker_serves_the_same_tokens(suite) -> None:  # type: ignore[no-untyped-def]
    assert _tokens(suite, warmup=True) == _tokens(suite, warmup=False)
