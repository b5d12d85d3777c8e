"""The worker's multi-rank executor: its rank processes serve a step, then exit 0 on shutdown.

`MultiRankExecutor` (a worker with `--tp` > 1) drives one process per rank. On `shutdown`
every rank gets `stop` between steps and leaves without interpreter teardown (whose C++
destructors of gloo's state can abort the process); a rank killed after the join timeout, or
one that aborted, would show a non-zero exit code here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.executor import SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.multirank


def test_ranks_serve_a_step_then_exit_zero_on_shutdown(suite) -> None:
    model_dir, _ = suite["llama"]
    executor = MultiRankExecutor(
        ParallelConfig(tp=2, dp=2, dp_attention=True),
        RunnerConfig(str(model_dir), max_seqs=2, max_len=32, lora_backend="torch"),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )
    try:
        seeded = SamplingParams(temperature=1.0, seed=3)
        work = [
            [
                SeqWork(cache_row=0, start=0, tokens=(1, 2, 3), slot=NO_ADAPTER, params=seeded),
                SeqWork(cache_row=1, start=0, tokens=(4, 5), slot=NO_ADAPTER),
            ],
            [],
        ]
        results = executor.step(work)  # DP group 1 is idle and still joins every collective
        # a token per sequence, picked on its group's leader; none for the idle group
        assert len(results[0].tokens) == 2 and results[1].tokens == []
        # the same prefill again: the greedy row and the seeded row (same seed, same index)
        # give the same tokens; the seeded row's next index draws again
        assert executor.step(work)[0].tokens == results[0].tokens
        draws = {executor.step([[replace(work[0][0], index=i)], []])[0].tokens[0] for i in range(8)}
        assert len(draws) > 1
    finally:
        executor.shutdown()
    assert [p.exitcode for p in executor._procs] == [0, 0]
