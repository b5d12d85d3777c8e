"""GPU tier, two GPUs: overlapped steps (ADR 0014) on a worker's ranks over NCCL.

The multirank tier's mix (tests/multirank/test_overlapped_steps_ranks.py: requests ending by
length, a stop id, EOS and an abort, with adapters, logprobs, a seeded and an unseeded one)
served by a tp=2 dp=2 DP-attention worker and a tp=2 worker on CUDA, with the Triton LoRA
backend and per-rank decode graphs captured (ADR 0018): launched steps take their carried
input tokens on each rank's device, into the graphs' static inputs, and the tokens, ends and
logprobs are those of steps in turn. Not in bench/run_gpu_x2.sh; run it by hand on a
machine of two GPUs (``pytest tests/gpu/test_overlap_ranks_nccl.py``); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from tests.multirank.test_overlapped_steps_ranks import check_overlapped_ranks, each_layout

from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs: the gpu tier on nvidia-h200-x2 through the device tool",
)
@each_layout
def test_overlapped_steps_over_nccl_give_the_tokens_of_steps_in_turn(
    suite, pconf: ParallelConfig
) -> None:  # type: ignore[no-untyped-def]
    check_overlapped_ranks(suite, pconf, tolerance=1e-4, device="cuda", lora_backend="triton")
