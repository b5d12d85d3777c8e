"""`loraplane bench serve`'s arithmetic: what a window counts, on records made by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplane.worker.bench.serve import RequestRecord, percentile, summarise

pytestmark = pytest.mark.unit


def test_a_window_counts_the_tokens_that_arrived_in_it() -> None:
    # 4 tokens in 4 chunks, two of them inside [1, 2)
    r = RequestRecord("a", start=0.5, chunks=[0.9, 1.2, 1.8, 2.5], tokens=4)
    s = summarise([r], 1.0, 2.0)
    assert s["out_tok_s"] == 2.0
    assert s["ttft_ms_p50"] is None  # started before the window
    assert s["itl_ms_p50"] == pytest.approx(450.0)  # gaps ending in it: 300 and 600 ms
    assert s["requests"] == 0  # it ended after the window


def test_a_chunk_of_held_back_text_carries_all_its_tokens() -> None:
    r = RequestRecord(None, start=0.0, chunks=[0.1, 0.2], tokens=5)
    assert r.token_times() == [0.1, 0.1, 0.2, 0.2, 0.2]
    assert summarise([r], 0.0, 1.0)["out_tok_s"] == 5.0


def test_ttft_counts_requests_started_in_the_window_and_errors_are_counted() -> None:
    ok = RequestRecord("a", start=1.1, chunks=[1.3, 1.4], tokens=2)
    failed = RequestRecord("b", start=1.2, error="HTTP 500: boom")
    s = summarise([ok, failed], 1.0, 2.0)
    assert s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["errors"] == 1
    assert s["requests"] == 1
    assert s["req_s"] == 1.0


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_without_a_target_it_says_what_to_give() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane.worker.bench.serve", "--transports", "http"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: give --url, --model or --fixture"
