"""Helpers for worker integration tests: start `loraplane worker serve` on 127.0.0.1 and talk to it."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tests.procs import stop_process, worker_serve_command

from loraplane.devcluster.processes import free_port

REPO = Path(__file__).resolve().parents[3]
LORAPLANE = REPO / ".venv" / "bin" / "loraplane"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc, timeout=15)


def start_worker(
    model: Path,
    tmp: Path,
    *args: str,
    env: dict[str, str | None] | None = None,
    timeout: float = 120,
) -> WorkerProcess:
    """A worker serving ``model`` with ``args``; ``env`` is added to this process's
    environment (a ``None`` value removes that variable)."""
    port = free_port()
    log_path = tmp / f"worker-{port}.log"
    cmd = worker_serve_command(LORAPLANE, model, port, *args)
    if "--lora-backend" not in args:
        cmd += ["--lora-backend", "torch"]
    merged = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {k: v for k, v in merged.items() if v is not None}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    worker = WorkerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{worker.log()}")
        try:
            if worker.client.get("/health", timeout=2).status_code == 200:
                return worker
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    worker.stop()
    raise RuntimeError(f"worker did not become healthy in {timeout}s:\n{worker.log()}")


def generate(
    worker: WorkerProcess, prompt: str, adapter: str | None, max_tokens: int = 6, **sampling: object
) -> dict:
    body = {
        "model": f"tiny-llama:{adapter}" if adapter else "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **sampling,
    }
    r = worker.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()
