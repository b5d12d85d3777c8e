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


def test_a_shared_prefix_starts_every_prompt_of_an_adapter() -> None:
    """``--shared-prefix``: one adapter's prompts share their first ids, another adapter's
    (and the base model's) start otherwise; the rest of each prompt is its own."""
    import asyncio
    import random

    from loraplane.worker.bench.serve import AdapterDraw, GpuBusy, Row, run_row

    prompts: dict[str | None, list[list[int]]] = {}

    class Recorder:
        name = "fake"

        async def stream(self, prompt, adapter, output_len, record):  # type: ignore[no-untyped-def]
            prompts.setdefault(adapter, []).append(prompt)
            await asyncio.sleep(0)
            record.chunks.append(record.start)
            record.tokens = 1

        async def close(self) -> None:
            pass

    draw = AdapterDraw(["a", "b"], "uniform", random.Random(0))
    asyncio.run(
        run_row(
            Recorder(),
            Row("fake", 2, 2, None),
            draw,
            prompt_len=12,
            output_len=1,
            vocab=1000,
            warmup=0.0,
            duration=0.05,
            windows=1,
            seed=0,
            busy=GpuBusy(0),
            progress=lambda _: None,
            shared_prefix=8,
        )
    )
    assert all(len(prompts[a]) >= 2 for a in ("a", "b"))
    for seen in prompts.values():
        assert all(len(p) == 12 and p[:8] == seen[0][:8] for p in seen)
        assert len({tuple(p[8:]) for p in seen}) == len(seen)
    assert prompts["a"][0][:8] != prompts["b"][0][:8]
