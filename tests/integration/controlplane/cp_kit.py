"""Helpers shared by the control-plane integration tests (imported by name: no conftest clash)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

ADMIN_TOKEN = "integration-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TABLES = ("pools", "workers", "adapters", "placements", "operations", "tokens")
START_HINT = 'run `eval "$(scripts/services.sh start)"` (or `make test-integration`, which does it)'


def required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(
            f"{name} is not set: the integration tier needs the real service; {START_HINT}",
            pytrace=False,
        )
    return value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every registry table, to assert that a rejected call changed nothing."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return {
                t: sorted(map(tuple, conn.execute(sa.text(f"SELECT * FROM {t}")).all()), key=repr)
                for t in TABLES
            }
    finally:
        engine.dispose()


POOL = {
    "model": "/models/tiny-llama",
    "tp": 2,
    "dp": 2,
    "max_loras_per_batch": 3,
    "max_loaded_loras": 4,
    "max_lora_rank": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def worker_command() -> list[str] | None:
    """`loraplane worker serve`, or None while the worker server does not exist yet."""
    exe = shutil.which("loraplane") or str(Path(sys.executable).with_name("loraplane"))
    if not Path(exe).exists():
        return None
    probe = subprocess.run(
        [exe, "worker", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        return None
    return [exe, "worker", "serve"]
