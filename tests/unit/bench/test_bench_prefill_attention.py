"""CPU smoke test of `loraplane bench prefill-attention` (Triton interpreter, tiny shapes):
the fields the report relies on, the two paths agreeing, and the refusal off CUDA. No timing
assertions."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytestmark = pytest.mark.unit


def test_a_tiny_step_through_both_paths() -> None:
    from loraplane.worker.bench.prefill_attention import measure_step

    args = argparse.Namespace(
        chunks=2, new=5, decodes=3, heads=4, kv_heads=2, head_dim=16, page_size=4,
        dtype="float32", layers=2, rep_ms=1.0,
    )  # fmt: skip
    case = measure_step(args, 7, torch.device("cpu"))
    assert case["tokens"] == 2 * 5 + 3 and case["tiles"] == 2
    assert case["max_abs_diff"] < 1e-5  # fp32: the kernel and SDPA per chunk agree
    for key in ("kernel_us", "sdpa_us", "extend_us", "tiles_host_us"):
        assert case[key] > 0, key
    assert case["speedup"] == pytest.approx(case["sdpa_us"] / case["kernel_us"], rel=0.05)


def test_refuses_a_cpu_device(capsys: pytest.CaptureFixture[str]) -> None:
    from loraplane.worker.bench.prefill_attention import main

    assert main(["--device", "cpu"]) == 2
    assert "--device must be a CUDA device" in capsys.readouterr().err
