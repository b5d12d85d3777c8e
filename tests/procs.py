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


def redis_of_this_process(url: str) -> str:
    """The shared test Redis at a database of this pytest-xdist process's own (``gw1``: 1).

    The integration tier runs its modules on two processes at once, and a control plane's
    reconciler leads through a Redis key (``loraplane:leader:reconciler``): on one database a
    test's replicas would hold the lock that another process's control plane waits for (its
    drift repair stalls), or take it from a test that checks who leads. Keys are per database;
    pub/sub channels are not, so events still cross (they only empty the routers' caches)."""
    import os
    import re

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    return re.sub(r"(/\d+)?$", f"/{index % 16}", url.rstrip("/"), count=1)
