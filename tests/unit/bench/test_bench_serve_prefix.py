"""`loraplane bench serve --shared-prefix`: the prompts a row sends, through a transport that
records them."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplane.worker.bench.serve import AdapterDraw, GpuBusy, Row, run_row

pytestmark = pytest.mark.unit


def test_a_shared_prefix_starts_every_prompt_of_an_adapter() -> None:
    """``--shared-prefix``: one adapter's prompts share their first ids, another adapter's
    (and the base model's) start otherwise; the rest of each prompt is its own."""
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


def test_a_shared_prefix_sweep_measures_the_rows_without_sharing_first() -> None:
    """``--shared-prefix 0,1024``: every load once without a shared prefix, then once with it,
    each row naming its prefix (a prefix cache warmed by the shared rows would flatter the
    others otherwise)."""
    from loraplane.worker.bench.serve import _rows, parser

    args = parser().parse_args(
        [
            "--fixture",
            "dense",
            "--clients",
            "64,256",
            "--adapters",
            "4",
            "--shared-prefix",
            "0,1024",
        ]
    )
    rows = _rows(args, "http")
    assert [(r.clients, r.shared_prefix) for r in rows] == [
        (64, 0),
        (256, 0),
        (64, 1024),
        (256, 1024),
    ]


def test_a_shared_prefix_as_long_as_the_prompt_is_refused() -> None:
    from loraplane.worker.bench.serve import main

    assert main(["--fixture", "dense", "--prompt-len", "16", "--shared-prefix", "0,16"]) == 2
