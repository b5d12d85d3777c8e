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


@pytest.mark.parametrize("max_pairs", [1024, 20], ids=["all-fused", "prefill-separate"])
def test_moe_lora_inside_the_experts_kernels_matches_peft(suite, monkeypatch, max_pairs) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the Triton backend computes the experts' LoRA inside the base experts'
    kernels (``kernels.moe_experts_lora``) up to ``fused_max_pairs`` pairs; here the CPU
    takes the same paths through the interpreter, base experts included. With the bound at
    20 pairs (10 sequences at top-2), prefills take the separate LoRA kernels and decode
    steps the fused ones. The same parity figures, base rows bit for bit."""
    from loraplane.worker.kernels import experts
    from loraplane.worker.lora.layers import ExpertsLoRA
    from loraplane.worker.models.model import Experts

    sizes: list[int] = []
    fused = experts.moe_experts_lora

    def counted(x, w_gate_up, w_down, pair_expert, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(pair_expert.shape[0])
        return fused(x, w_gate_up, w_down, pair_expert, *args, **kwargs)

    monkeypatch.setattr(Experts, "device_kernels", True)
    monkeypatch.setattr(ExpertsLoRA, "fused_max_pairs", max_pairs)
    monkeypatch.setattr(experts, "moe_experts_lora", counted)
    model_dir, adapters = suite["qwen3-moe"]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="triton")
    assert sizes, "the fused experts' path never ran"
    assert max(sizes) <= max_pairs
    if max_pairs == 1024:
        assert max(sizes) > 20, "the prefill should have taken the fused path too"
    assert_parity(report)


def test_prompt_chunks_through_the_attention_kernel_match_peft(suite, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The prefill's prompt chunks through ``extend_attention`` (the CUDA path), here through
    the interpreter: the same parity figures against HF + PEFT."""
    from loraplane.worker.kernels import attention
    from loraplane.worker.models.model import Attention

    launches: list[int] = []
    kernel = attention.extend_attention

    def counted(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(q.shape[0])
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(Attention, "prompt_kernel", True)
    monkeypatch.setattr(attention, "extend_attention", counted)
    model_dir, adapters = suite["llama"]
    report = check_parity(model_dir, adapters, prompts=4, max_new_tokens=2, backend="triton")
    assert launches, "the prompt attention kernel never ran"
    assert_parity(report)
