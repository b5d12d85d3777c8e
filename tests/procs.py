"""Process helpers shared by the integration kits (workerkit, obskit, cp_kit)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM, wait up to `timeout` s for a clean shutdown, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_serve_command(exe: Path, model: Path, port: int, *args: str) -> list[str]:
    """`loraplane worker serve` for `model` on 127.0.0.1:`port`, on the CPU, plus `args`."""
    return [
        str(exe), "worker", "serve", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *args,
    ]  # fmt: skip
