"""GPU tier, two GPUs: per-rank decode graphs captured with their NCCL collectives (ADR 0018).

The multirank tier's cases (tests/multirank/test_decode_graphs_ranks.py: dense and MoE,
tp=2 dp=2 with DP attention with both groups busy and with one idle, and tp=2), with every
rank's graphs captured over NCCL: each rank replays every decode step, and the tokens and
logprobs are those of the eager ranks and of one GPU (fp32, the tolerance of the one-GPU
graph test). Runs through the device tool on a machine of two GPUs (bench/run_gpu_x2.sh, step
rank_graphs); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from tests.multirank.test_decode_graphs_ranks import check_graph_steps, each_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs: run bench/run_gpu_x2.sh through the device tool",
    ),
]


@each_case
def test_captured_rank_graphs_give_the_eager_and_the_one_gpu_tokens(
    suite, arch: str, tp: int, dp: int, name: str
) -> None:  # type: ignore[no-untyped-def]
    check_graph_steps(suite, arch, tp, dp, name, "cuda", tolerance=1e-4)
