"""Issue 2 acceptance with the Triton backend (interpreter on CPU): same mixed-batch check."""

from __future__ import annotations

import pytest
from tests.unit.runtime.test_parity import ARCHS, assert_parity

from loraplane.worker.check.parity import check_parity

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_peft_and_merged_triton_backend(suite, arch: str) -> None:
    model_dir, adapters = suite[arch]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="triton")
    assert_parity(report)


def test_moe_lora_inside_the_experts_kernels_matches_peft(suite, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the Triton backend computes the experts' LoRA inside the base experts'
    kernels (``kernels.moe_experts_lora``); here the CPU takes the same path through the
    interpreter, base experts included. The same parity figures, base rows bit for bit."""
    from loraplane.worker.kernels import experts
    from loraplane.worker.models.model import Experts

    calls: list[int] = []
    fused = experts.moe_experts_lora

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(Experts, "device_kernels", True)
    monkeypatch.setattr(experts, "moe_experts_lora", counted)
    model_dir, adapters = suite["qwen3-moe"]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="triton")
    assert calls, "the fused experts' path never ran"
    assert_parity(report)
