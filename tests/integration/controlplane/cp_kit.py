"""Helpers shared by the control-plane integration tests (imported by name: no conftest clash)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from tests.procs import stop_process

from loraplane.devcluster.processes import free_port

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


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name` in Prometheus text whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


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


class WorkerProc:
    """A real `loraplane worker serve` process on a fixed loopback port (so it can be restarted
    at the same endpoint, like a StatefulSet pod)."""

    def __init__(
        self,
        model: Path,
        tmp: Path,
        *,
        tp: int = 1,
        dp: int = 1,
        port: int | None = None,
        k: int = 3,
        m: int = 4,
        rank: int = 16,
        roots: tuple[Path, ...] = (),
    ) -> None:
        self.model, self.tmp, self.tp, self.dp = model, tmp, tp, dp
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "--max-loras-per-batch",
            str(k),
            "--max-loaded-loras",
            str(m),
            "--max-lora-rank",
            str(rank),
            "--enable-fault-injection",
            "--lora-backend",
            "torch",
        ]
        if tp > 1 or dp > 1:
            self.args += ["--tp", str(tp), "--dp", str(dp), "--dp-attention"]
        for root in roots:
            self.args += ["--allowed-lora-root", str(root)]
        self.process: subprocess.Popen[bytes] | None = None
        self.log = tmp / f"worker-{self.port}.log"

    def start(self, timeout: float = 240) -> WorkerProc:
        command = worker_command()
        if command is None:
            pytest.skip(
                "`loraplane worker serve` does not exist yet (worker/src/loraplane/worker/server)"
            )
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *command,
                    "--model",
                    str(self.model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = self.log.read_text(errors="replace")
                if "is not available yet" in text:
                    pytest.skip(
                        f"worker topology tp={self.tp} dp={self.dp} not available yet: {text.strip()[-300:]}"
                    )
                raise AssertionError(
                    f"worker exited with {self.process.returncode}:\n{text[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(
            f"worker did not become healthy in {timeout}s:\n{self.log.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def models(self) -> set[str] | None:
        """Adapter names /v1/models lists, or None if the worker does not answer."""
        import httpx

        try:
            data = httpx.get(self.url + "/v1/models", timeout=30).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return {m["id"] for m in data if m.get("parent") is not None}

    def fault(self, op: str, dp_group: int, message: str, count: int = 1) -> None:
        import httpx

        response = httpx.post(
            self.url + "/debug/fault",
            json={"op": op, "dp_group": dp_group, "count": count, "message": message},
            timeout=10,
        )
        assert response.status_code == 200, response.text


class ControlPlane:
    def __init__(self, db_url: str, root: Path, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "LORAPLANE_DB_URL": db_url,
            "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
            "LORAPLANE_SOURCES__ALLOWED_ROOTS": f'["{root}"]',
            "LORAPLANE_SOURCES__CACHE_DIR": str(tmp / "cache"),
            "LORAPLANE_RECONCILER__INTERVAL_S": "3600",
            "LORAPLANE_WORKERS__LOAD_TIMEOUT_S": "120",
            "LORAPLANE_WORKERS__PROBE_TIMEOUT_S": "1",
            # a restarted process settles what the killed one left once it missed a renewal
            # (half a lease): short here, so the tests do not wait 15 s for it
            "LORAPLANE_OPERATIONS__LEASE_S": "2",
        }
        self.env.pop("LORAPLANE_REDIS_URL", None)
        self.log = tmp / f"controlplane-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = Path(sys.executable).with_name("loraplane")
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(exe),
                    "controlplane",
                    "serve",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "warning",
                ],
                env=self.env,
                stdout=log,
                stderr=log,
            )
        wait_for(self._ready, timeout=60, what=f"the control plane to serve (log: {self.log})")

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"control plane exited: {self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)


class PrivateRedis:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(
                "redis-server is not installed: run scripts/services.sh start", pytrace=False
            )
        self.process = subprocess.Popen(
            [
                exe,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._ping, timeout=10, what="redis-server to answer")

    def _ping(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


class HungWorker:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def join_hung_worker(client: Any, worker: HungWorker, db_url: str) -> None:
    """Pool `tiny` and worker `w0` at ``worker``, marked ready in the registry as if it had
    answered its probe (it never answers anything)."""
    assert client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN).status_code == 200
    endpoint = f"http://127.0.0.1:{worker.port}"
    body = {"name": "w0", "pool": "tiny", "endpoint": endpoint, "dp_size": 2}
    assert client.post("/v1/workers", json=body, headers=ADMIN).status_code == 201
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE workers SET state = 'ready' WHERE name = 'w0'"))
    finally:
        engine.dispose()
