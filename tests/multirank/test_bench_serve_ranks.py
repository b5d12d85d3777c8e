"""`loraplane bench serve --tp 2 --dp 2 --dp-attention` on the CPU: it starts a multi-rank
worker (gloo) and builds the same engine in its own process, and serves base and adapter rows
over both transports without an error. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank


def test_bench_serve_runs_a_dp_attention_worker_over_http_and_in_process(
    suite: dict[str, tuple[Path, list[tuple[str, Path]]]], tmp_path: Path
) -> None:
    model_dir, adapters = suite["llama"]
    loras = [f"--lora={name}={path}" for name, path in adapters[:2]]
    out = tmp_path / "serve.json"
    args = [
        "--model", str(model_dir), *loras, "--device", "cpu", "--lora-backend", "torch",
        "--tp", "2", "--dp", "2", "--dp-attention", "--slots", "2", "--max-running", "4",
        "--clients", "4", "--adapters", "0,2", "--prompt-len", "6", "--output-len", "4",
        "--warmup", "0.5", "--duration", "2", "--transports", "http,in-process",
        "--workdir", str(tmp_path), "--out", str(out), "--worker-log-level", "info",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane.worker.bench.serve", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["settings"]["tp"], result["settings"]["dp"]) == (2, 2)
    assert result["settings"]["dp_attention"] is True
    rows = result["rows"]
    assert [(r["transport"], r["adapters"]) for r in rows] == [
        ("http", 0),
        ("http", 2),
        ("in-process", 0),
        ("in-process", 2),
    ]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] > 0 and r["out_tok_s"] > 0
    # the started worker ran with this layout (its start-up line names it)
    log = (tmp_path / "worker-k2.log").read_text()
    assert "tp=2 dp=2" in log, log[-2000:]
