"""`--dp-attention` with one DP group (dp = 1) is plain TP: attention TP = TP, nothing gathered.

The CRD, ServeConfig and ParallelConfig all accept dp = 1 with DP attention on (the operator
passes `--dp-attention` whenever `enableDPAttention` is set). Such a worker used to fail
every forward, base-only ones included: the LoRA manager expected all-gathered adapter slots
that the runner, rightly, never gathers for one group.
"""

from __future__ import annotations

import pytest
import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, prefill_batch
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.parallel.state import ParallelConfig, ParallelState

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [44, 2, 2]]


def _runner(suite, dp_attention: bool) -> ModelRunner:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    ps = ParallelState(ParallelConfig(tp=1, dp=1, dp_attention=dp_attention))
    r = ModelRunner(
        RunnerConfig(str(model_dir), lora_backend="torch", max_seqs=2, max_len=32),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32),
        ps,
    )
    name, path = adapters[0]
    r.lora.load_slot(0, r.read_adapter(name, path))  # type: ignore[union-attr]
    return r


@pytest.fixture(scope="module")
def runners(suite) -> tuple[ModelRunner, ModelRunner]:  # type: ignore[no-untyped-def]
    return _runner(suite, dp_attention=True), _runner(suite, dp_attention=False)


def _logits(r: ModelRunner, slots: list[int]) -> torch.Tensor:
    batch = prefill_batch(PROMPTS, [0, 1], all_logits=True, device="cpu")
    tokens = [s for p, s in zip(PROMPTS, slots, strict=True) for _ in p]
    return r.forward(batch, tokens)


def test_one_group_is_not_dp_attention() -> None:
    ps = ParallelState(ParallelConfig(tp=1, dp=1, dp_attention=True))
    assert not ps.dp_attention
    assert ps.attn_tp_size == ps.tp_size


def test_forward_equals_plain_tp(runners) -> None:  # type: ignore[no-untyped-def]
    """Base-only and mixed batches give the plain-TP logits bit for bit, adapter applied."""
    dp_attn, plain = runners
    base = _logits(dp_attn, [NO_ADAPTER, NO_ADAPTER])
    mixed = _logits(dp_attn, [0, NO_ADAPTER])
    assert torch.equal(base, _logits(plain, [NO_ADAPTER, NO_ADAPTER]))
    assert torch.equal(mixed, _logits(plain, [0, NO_ADAPTER]))
    n0 = len(PROMPTS[0])
    assert (mixed[:n0] - base[:n0]).abs().max() > 1e-3  # the adapter's rows got its LoRA
