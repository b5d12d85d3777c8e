"""How rank processes end: every rank's result arrives, and a rank's error reaches the caller.

`spawn_ranks` runs each rank in its own process over gloo. A rank that finishes waits for the
others before tearing down and exits 0; a rank that raises ends the run with its traceback,
while the ranks that finished are stopped instead of waiting for it forever.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loraplane.worker.parallel.launch import RankFailed, spawn_ranks
from loraplane.worker.parallel.state import ParallelConfig, ParallelState

pytestmark = pytest.mark.multirank


def _sum_ranks(rank: int, ps: ParallelState, device: torch.device, out_dir: str) -> None:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    if rank == 0:
        # The slow writer: its peers are done long before it, and must not tear down under it.
        torch.save(torch.arange(1_000_000), Path(out_dir) / "big.pt")
    (Path(out_dir) / f"rank{rank}.txt").write_text(str(int(t.item())))


def _rank1_fails(rank: int, ps: ParallelState, device: torch.device) -> None:
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        raise RuntimeError("rank 1 cannot read its shard")


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_reports_and_the_run_returns(tmp_path: Path, tp: int) -> None:
    spawn_ranks(_sum_ranks, ParallelConfig(tp=tp), "cpu", str(tmp_path))
    want = str(tp * (tp + 1) // 2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(tp)] == [want] * tp
    assert torch.load(tmp_path / "big.pt").numel() == 1_000_000


def test_a_rank_error_reaches_the_caller() -> None:
    """Rank 0 then fails too, on the connection rank 1 closed; the error names rank 1's."""
    with pytest.raises(RankFailed, match=r"(?s)^rank 1 failed:.*rank 1 cannot read its shard"):
        spawn_ranks(_rank1_fails, ParallelConfig(tp=2), "cpu")
