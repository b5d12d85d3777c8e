"""The o/down LoRA folded into the residual (RowLoRA.forward_add) on a single-rank worker.

Folding changes only where the LoRA term is added: ``(residual + lora) + base`` instead of
``residual + (base + lora)``. A user sees the same logits (fp32, to rounding), and rows
without an adapter get exactly the base model's logits either way.
"""

from __future__ import annotations

import pytest
import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, prefill_batch
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.lora.layers import RowLoRA

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8]]


@pytest.fixture(scope="module", params=["torch", "triton"])
def runner(request, suite) -> ModelRunner:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    cfg = RunnerConfig(str(model_dir), lora_backend=request.param, max_seqs=4, max_len=32)
    r = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    )
    for slot, (name, path) in enumerate(adapters[:2]):
        r.lora.load_slot(slot, r.read_adapter(name, path))  # type: ignore[union-attr]
    return r


def _logits(r: ModelRunner, slots: list[int], fold: bool, monkeypatch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(RowLoRA, "fold_residual", fold)
    rows = list(range(len(PROMPTS)))
    tokens = [s for p, s in zip(PROMPTS, slots, strict=True) for _ in p]
    return r.forward(prefill_batch(PROMPTS, rows, all_logits=True, device="cpu"), tokens)


def test_folded_lora_gives_the_unfolded_logits(runner: ModelRunner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    slots = [0, NO_ADAPTER, 1]
    folded = _logits(runner, slots, True, monkeypatch)
    unfolded = _logits(runner, slots, False, monkeypatch)
    base = _logits(runner, [NO_ADAPTER] * 3, True, monkeypatch)
    torch.testing.assert_close(folded, unfolded, rtol=1e-5, atol=1e-5)
    # the adapters change their own rows and nothing else
    n0, n1 = len(PROMPTS[0]), len(PROMPTS[1])
    assert not torch.allclose(folded[:n0], base[:n0], atol=1e-3)
    assert torch.equal(folded[n0 : n0 + n1], base[n0 : n0 + n1])
    assert torch.equal(unfolded[n0 : n0 + n1], base[n0 : n0 + n1])


def test_forward_add_without_lora_is_the_plain_residual_add(runner: ModelRunner) -> None:
    o_proj = runner.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, RowLoRA)
    x = torch.randn(3, o_proj.base_layer.in_local)
    residual = torch.randn(3, o_proj.base_layer.out_features)
    keep = residual.clone()
    runner.lora.ctx.reset_batch_state()  # type: ignore[union-attr]
    got = o_proj.forward_add(x, residual)
    assert torch.equal(residual, keep), "with no batch info the residual is not touched"
    assert torch.equal(got, keep + o_proj.base_layer(x))
