"""Issue 2 acceptance: each architecture, fp32, 4 adapters of ranks 4/8/16/32 with different
alphas plus base rows in one mixed batch, against HF transformers + PEFT and merged weights.

The torch backend runs here (unit tier); the Triton backend runs the same check under the
interpreter in tests/kernels/test_parity_triton.py.
"""

from __future__ import annotations

import pytest

from loraplane.worker.check.parity import ParityReport, check_parity

pytestmark = pytest.mark.unit

ARCHS = ["llama", "qwen2", "qwen3", "qwen3-moe"]


def assert_parity(report: ParityReport) -> None:
    assert report.max_abs_logprob_diff <= 1e-4, report
    assert report.max_abs_logprob_diff_merged <= 1e-4, report
    assert report.delta_corr >= 0.9999, report
    assert report.greedy_identical_count == report.prompts, report
    assert report.base_rows_bitwise_equal, report
    # The adapters must matter, or every figure above would pass trivially.
    assert report.lora_effect > 0.01, report


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_peft_and_merged_torch_backend(suite, arch: str) -> None:
    model_dir, adapters = suite[arch]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="torch")
    assert set(report.adapters) == {"a4", "a8", "a16", "a32", "<base>"}
    assert_parity(report)


def test_moe_lora_added_by_the_swiglu_and_combine_matches_peft(suite, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A captured CUDA graph computes the experts' LoRA into buffers beside the grouped GEMMs
    and the SwiGLU / top-k combine add them; the CPU takes that path only when told to. The
    same parity figures, base rows bit for bit."""
    from loraplane.worker.lora.layers import ExpertsLoRA

    used: list[bool] = []

    def use_deltas(self: ExpertsLoRA, x: object) -> bool:
        used.append(True)
        return True

    monkeypatch.setattr(ExpertsLoRA, "_use_deltas", use_deltas)
    model_dir, adapters = suite["qwen3-moe"]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="torch")
    assert used, "the experts' LoRA never ran"
    assert_parity(report)
