"""Helpers for the router's tests: the stub upstream of ``bench/router_bench.py`` in its own
process, a control plane routing to it, and a TCP proxy that delays a database's round trips."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from cp_kit import ControlPlane, wait_for
from tests.procs import stop_process

from loraplane.devcluster.processes import free_port

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
import router_bench  # noqa: E402  (bench/ is a folder of scripts, not a package)
from controlplane_bench import write_adapter  # noqa: E402

ADMIN = router_bench.ADMIN


class Stub:
    """``StubWorker`` under uvicorn: ``tokens`` SSE tokens ``gap_ms`` apart per stream."""

    def __init__(self, tmp: Path, tokens: int = 4, gap_ms: float = 10.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"stub-{self.port}.log"
        args = ["--serve-stub", str(self.port), "--tokens", str(tokens), "--gap-ms", str(gap_ms)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO / "bench" / "router_bench.py"), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )

    def stats(self) -> dict[str, Any]:
        """Requests open now, those whose client left before the end, loads received and
        answers held (by kind)."""
        stats: dict[str, Any] = httpx.get(self.url + "/stub/stats", timeout=5).json()
        return stats

    def unload(self, name: str) -> None:
        """Drop an adapter behind the control plane's back (a restarted worker)."""
        response = httpx.post(self.url + "/unload_lora_adapter", json={"lora_name": name})
        assert response.status_code == 200, response.text

    def hold(self, *what: str) -> None:
        """Hold the stub's answers of these kinds ("models", "loads", "unloads") until
        ``release``."""
        response = httpx.post(self.url + "/stub/hold", json={"what": list(what)})
        assert response.status_code == 200, response.text

    def release(self, *what: str) -> None:
        response = httpx.post(self.url + "/stub/release", json={"what": list(what)})
        assert response.status_code == 200, response.text

    def load(self, name: str) -> None:
        """Load an adapter behind the control plane's back (a leftover, a stray)."""
        body = {"lora_name": name, "lora_path": f"/stub/{name}"}
        response = httpx.post(self.url + "/load_lora_adapter", json=body)
        assert response.status_code == 200, response.text

    def models(self) -> list[str]:
        """The adapters the stub holds."""
        data = httpx.get(self.url + "/v1/models").json()["data"]
        return sorted(m["id"] for m in data if m["parent"] is not None)

    def stop(self) -> None:
        stop_process(self.process)


def routed_control_plane(
    db_url: str, tmp: Path, stub: Stub, *, explicit: bool = False, **env: str
) -> ControlPlane:
    """A control plane (its own process) with pool ``bench``, the stub as ready worker ``w0``
    and adapter ``a0`` loaded on it. ``env``: extra ``LORAPLANE_*`` settings."""
    root = tmp / "adapters"
    root.mkdir(exist_ok=True)
    cp = ControlPlane(db_url, root.resolve(), tmp)
    cp.env.update({"LORAPLANE_ADMIN_TOKEN": router_bench.ADMIN_TOKEN, **env})
    cp.start()
    adapter_dir = write_adapter(root.resolve() / "a0")

    async def set_up() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await router_bench.set_up(client, cp.url, stub.url, adapter_dir)

    asyncio.run(set_up())
    if explicit:
        policy = httpx.patch(
            cp.url + "/v1/adapters/default/a0", json={"load_policy": "Explicit"}, headers=ADMIN
        )
        assert policy.status_code == 200, policy.text
    return cp


def inflight(cp: ControlPlane) -> int:
    """Requests the control plane counts on worker ``w0`` (what it balances load by)."""
    count: int = httpx.get(cp.url + "/v1/workers/w0", headers=ADMIN).json()["inflight"]
    return count


def wait_for_value(read: Any, want: Any, what: str, timeout: float = 20.0) -> None:
    wait_for(lambda: read() == want, timeout=timeout, what=f"{what} == {want!r}")


class DelayProxy:
    """A TCP proxy that holds every read from its client ``delay_s`` before passing it on: a
    database ``delay_s`` further away per round trip. Runs its own event loop in a thread."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if slow and self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
