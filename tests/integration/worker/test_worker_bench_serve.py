"""`loraplane bench serve` against a real worker process: every row measured, adapters drawn
as asked, nothing failed. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _generated(metrics: str, adapter: str) -> float:
    prefix = f'loraplane_worker_generated_tokens_total{{adapter="{adapter}"}} '
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_bench_serve_streams_base_and_adapter_rows_over_http(
    endpoint: str,
    worker_factory: Callable[..., object],
    make_adapter_dir: Callable[..., Path],
    tmp_path: Path,
) -> None:
    a, b = make_adapter_dir("bench-a", seed=1), make_adapter_dir("bench-b", seed=2)
    worker = worker_factory("--lora", f"a={a}", "--lora", f"b={b}", "--max-loras-per-batch", "2")
    out = tmp_path / "serve.json"
    args = (
        f"--url {worker.url} --adapter-names a,b --device cpu --clients 3 --adapters 0,2 "
        f"--prompt-len 8 --output-len 6 --warmup 0.5 --duration 2 --vocab 500 --out {out} "
        f"--endpoint {endpoint}"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane.worker.bench.serve", *args.split()],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert [(r["transport"], r["adapters"], r["clients"]) for r in rows] == [
        ("http", 0, 3),
        ("http", 2, 3),
    ]
    for r in rows:
        assert r["errors"] == 0
        assert r["out_tok_s"] > 0 and r["requests"] > 0
        assert r["ttft_ms_p50"] is not None and r["itl_ms_p50"] is not None
        assert r["gpu_busy"] is None  # no GPU here: said, not guessed
    metrics = worker.client.get("/metrics").text  # type: ignore[attr-defined]
    assert _generated(metrics, "a") > 0 and _generated(metrics, "b") > 0
