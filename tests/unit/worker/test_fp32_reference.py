"""`check parity --fp32-reference`: our run and HF + PEFT, both in the run's dtype, each
against HF + PEFT in fp32 on the same tokens (torch backend: bf16 runs on the CPU)."""

from __future__ import annotations

import math

import pytest

from loraplane.worker.check.parity import check_parity

pytestmark = pytest.mark.unit

FIGURES = ("mean_abs", "max_abs", "delta_corr", "greedy")


def test_fp32_run_against_fp32_reference_is_parity(suite) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    report = check_parity(
        model_dir, adapters[:2], prompts=4, max_new_tokens=3, backend="torch", fp32_reference=True
    )
    figures = report.extra["fp32_reference"]
    assert figures["ours_vs_fp32_max_abs"] <= 1e-4, figures
    assert figures["ours_vs_fp32_greedy"] == "4/4", figures
    assert figures["ours_vs_fp32_delta_corr"] >= 0.9999, figures
    assert figures["hf_vs_fp32_max_abs"] == 0.0, figures  # the same model, the same dtype


def test_bf16_run_reports_ours_and_hf_against_fp32(suite) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    report = check_parity(
        model_dir,
        adapters[:2],
        prompts=4,
        max_new_tokens=3,
        backend="torch",
        dtype="bfloat16",
        fp32_reference=True,
    )
    assert report.dtype == "bfloat16"
    figures = report.extra["fp32_reference"]
    assert {f"{who}_vs_fp32_{f}" for who in ("ours", "hf") for f in FIGURES} | {
        "mean_ratio"
    } == set(figures)
    # bf16 rounding moves both away from fp32, by amounts of the same order
    assert 0 < figures["hf_vs_fp32_mean_abs"] < 0.1, figures
    assert 0 < figures["ours_vs_fp32_mean_abs"] < 0.1, figures
    assert math.isfinite(figures["mean_ratio"]) and 0.1 < figures["mean_ratio"] < 10, figures
    assert figures["ours_vs_fp32_delta_corr"] > 0.9, figures
