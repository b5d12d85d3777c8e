"""Router overhead: streams routed through the control plane against the same streams sent
straight to the upstream; prints one JSON document (``loraplane bench router``).

- The upstream is ``StubWorker``: a raw ASGI app under uvicorn, in its own process, that
  answers the worker API the control plane drives (``/health``, ``/v1/models``,
  ``/load_lora_adapter``, ``/unload_lora_adapter``) and streams ``--tokens`` SSE tokens
  ``--gap-ms`` apart, the first one at once. It computes nothing, so what the router adds is
  not hidden under model time.
- The control plane is the real application (``create_app``) under uvicorn, in its own
  process, on SQLite (or ``--db-url``): the stub registered as worker ``w0`` of pool ``bench``
  and one adapter ``a0`` loaded on it through the API.
- ``--concurrency`` clients in this process each open one stream after another on a kept-alive
  connection (a closed loop; raw HTTP/1.1, so the client costs little), their starts spread
  over one stream's length so requests arrive evenly, in phases of ``--phase-s`` seconds
  (after that ramp) that alternate direct and routed (``--rounds`` of each), so both sides
  share the machine's load alike.

Added latency is routed minus direct at the same percentile: time to first token (TTFT) and
the gap between tokens.

    python bench/router_bench.py > bench/results/cpu/router.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ADMIN_TOKEN = "router-bench"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BASE_MODEL = "/models/bench"


# -- the stub upstream ---------------------------------------------------------------------------
class StubWorker:
    """A worker that holds adapters by name and streams fixed tokens at a fixed pace.

    A request body may carry ``stub_delay_s``: the answer (its headers too) waits that long,
    ending early if the client disconnects; ``stub_status``: answer that HTTP status with an
    error body; ``stub_cut_after``: drop the connection after that many tokens. ``GET /stub/stats`` reports the requests open now,
    those whose client left before the end, the completion requests received, the adapter
    loads received and the answers held. ``POST /stub/hold`` and ``/stub/release`` with
    ``{"what": [...]}`` hold and release answers of a kind: ``"models"`` (``/v1/models``
    answers as of when it was asked, sent on release: a look at the worker that arrives late),
    ``"loads"`` and ``"unloads"`` (each takes effect on release)."""

    def __init__(self, tokens: int, gap_s: float) -> None:
        self.tokens = tokens
        self.gap_s = gap_s
        self.loaded: set[str] = set()
        self.open = 0
        self.abandoned = 0
        self.completions = 0  # completion requests received, answered or not
        self.loads = 0  # load requests received, held or not
        self.gates = {k: asyncio.Event() for k in ("models", "loads", "unloads")}  # set: open
        for gate in self.gates.values():
            gate.set()
        self.held = dict.fromkeys(self.gates, 0)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = scope["method"] == "POST"
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body) if body else {}
        path = scope["path"]
        if path == "/health":
            await _answer(send, 200, {"status": "ok"})
        elif path == "/v1/models":
            data = [{"id": BASE_MODEL, "object": "model", "parent": None}]
            data += [{"id": n, "object": "model", "parent": BASE_MODEL} for n in self.loaded]
            await self._pass("models")
            await _answer(send, 200, {"object": "list", "data": data})
        elif path == "/stub/stats":
            stats = {
                "open": self.open,
                "abandoned": self.abandoned,
                "completions": self.completions,
                "loads": self.loads,
                "held": self.held,
            }
            await _answer(send, 200, stats)
        elif path in ("/stub/hold", "/stub/release"):
            for what in request["what"]:
                (self.gates[what].clear if path == "/stub/hold" else self.gates[what].set)()
            await _answer(send, 200, {"held": self.held})
        elif path in ("/load_lora_adapter", "/unload_lora_adapter"):
            if path.startswith("/load"):
                self.loads += 1
            await self._pass("loads" if path.startswith("/load") else "unloads")
            name = request["lora_name"]
            (self.loaded.add if path.startswith("/load") else self.loaded.discard)(name)
            loaded = {n: f"/stub/{n}" for n in sorted(self.loaded)}
            await _answer(
                send, 200, {"success": True, "error_message": "", "loaded_adapters": loaded}
            )
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self._complete(request, receive, send)
        else:
            await _answer(send, 404, {"error": {"message": f"no route {path}"}})

    async def _pass(self, what: str) -> None:
        """Wait while answers of kind ``what`` are held."""
        gate = self.gates[what]
        if not gate.is_set():
            self.held[what] += 1
            try:
                await gate.wait()
            finally:
                self.held[what] -= 1

    async def _complete(self, request: dict[str, Any], receive: Any, send: Any) -> None:
        self.completions += 1
        model = request.get("model")
        if model != BASE_MODEL and model not in self.loaded:
            await _answer(send, 404, {"error": {"message": f"adapter {model!r} not loaded"}})
            return
        self.open += 1
        try:
            delay = float(request.get("stub_delay_s", 0))
            if delay and await _client_left(receive, delay):
                self.abandoned += 1
                return
            status = int(request.get("stub_status", 200))
            if status != 200:
                await _answer(send, status, {"error": {"message": f"stub answers {status}"}})
                return
            if not request.get("stream"):
                text = " tok" * self.tokens
                await _answer(send, 200, {"model": model, "choices": [{"text": text}]})
                return
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            cut_after = request.get("stub_cut_after")
            for index in range(self.tokens):
                if index:
                    await asyncio.sleep(self.gap_s)
                if index == cut_after:  # the worker dies mid-stream: the connection drops
                    raise ConnectionAbortedError(f"stub cut the stream after {index} tokens")
                chunk = {
                    "id": "cmpl-stub",
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": f" t{index}", "finish_reason": None}],
                }
                line = f"data: {json.dumps(chunk)}\n\n".encode()
                await send({"type": "http.response.body", "body": line, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except OSError:  # the client left mid-stream
            self.abandoned += 1
        finally:
            self.open -= 1


async def _client_left(receive: Any, within_s: float) -> bool:
    try:
        async with asyncio.timeout(within_s):
            while (await receive())["type"] != "http.disconnect":
                pass
            return True
    except TimeoutError:
        return False


async def _answer(send: Any, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


# -- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_stub(port: int, tokens: int, gap_s: float) -> None:
    import uvicorn

    # (idle connections kept as long as `loraplane worker serve` keeps them, 75 s: longer
    # than the router's pool keeps them, so the router's connections are reused across the
    # bench's phases as they are in front of a worker)
    uvicorn.run(
        StubWorker(tokens, gap_s),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_keep_alive=75,
    )


def serve_controlplane(port: int, db_url: str) -> None:
    import uvicorn

    from loraplane.controlplane.app import create_app
    from loraplane.controlplane.settings import Settings

    settings = Settings(db_url=db_url, admin_token=ADMIN_TOKEN, redis_url=None)
    settings.sources.allowed_roots = [Path(tempfile.gettempdir()).resolve()]
    settings.reconciler.interval_s = 5.0
    uvicorn.run(
        create_app(settings),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_keep_alive=settings.keep_alive_s,  # (as `loraplane controlplane serve` runs it)
    )


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


async def wait_until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.1)


async def set_up(client: Any, cp: str, stub: str, adapter_dir: Path) -> None:
    """Pool ``bench``, worker ``w0`` (the stub, ready) and adapter ``a0`` loaded on it."""

    async def answers(url: str) -> bool:
        with contextlib.suppress(Exception):
            return bool((await client.get(url, timeout=1)).status_code == 200)
        return False

    await wait_until(lambda: answers(stub + "/health"), "the stub to listen")
    await wait_until(lambda: answers(cp + "/readyz"), "the control plane to listen")
    pool = {
        "model": BASE_MODEL,
        "tp": 1,
        "dp": 1,
        "max_loras_per_batch": 4,
        "max_loaded_loras": 8,
        "max_lora_rank": 16,
    }
    (await client.put(cp + "/v1/pools/default/bench", json=pool, headers=ADMIN)).raise_for_status()
    worker = {"name": "w0", "pool": "bench", "endpoint": stub, "dp_size": 1}
    (await client.post(cp + "/v1/workers", json=worker, headers=ADMIN)).raise_for_status()

    async def ready() -> bool:
        answer = await client.get(cp + "/v1/workers/w0", headers=ADMIN)
        return bool(answer.json().get("state") == "ready")

    await wait_until(ready, "worker w0 to be ready")
    adapter = {"name": "a0", "pool": "bench", "source": {"uri": f"file://{adapter_dir}"}}
    registered = await client.post(cp + "/v1/adapters", json=adapter, headers=ADMIN, timeout=60)
    if registered.status_code >= 300:
        raise RuntimeError(f"registering a0 failed: {registered.text}")


# -- the measurement -----------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Side:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.requests = 0
        self.errors: list[str] = []

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": len(self.errors),
            "first_errors": self.errors[:3],
            "ttft_ms": {
                "p50": ms(percentile(self.ttft, 0.5)),
                "p99": ms(percentile(self.ttft, 0.99)),
                "mean": ms(sum(self.ttft) / len(self.ttft)) if self.ttft else None,
            },
            "gap_ms": {
                "p50": ms(percentile(self.gaps, 0.5)),
                "p99": ms(percentile(self.gaps, 0.99)),
                "samples": len(self.gaps),
            },
        }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class Connection:
    """One kept-alive HTTP/1.1 connection, the client's side: requests written and chunked
    answers read by hand, so the client costs little next to what it measures."""

    def __init__(self, url: str, token: str = ADMIN_TOKEN) -> None:
        self.token = token
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, path: str, body: dict[str, Any]) -> tuple[int, list[float]]:
        """POST ``body``; (status, arrival time of each ``data: {`` event)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        raw = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = head.lower()
        arrivals: list[float] = []
        if b"transfer-encoding: chunked" in headers:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                now = time.perf_counter()
                arrivals.extend(now for _ in range(chunk.count(b"data: {")))
        else:
            length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await self.reader.readexactly(length)
        return status, arrivals

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def one_stream(connection: Connection, model: str, side: Side) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 16, "stream": True}
    started = time.perf_counter()
    try:
        status, arrivals = await connection.stream("/v1/completions", body)
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        side.errors.append(f"{type(exc).__name__}: {exc}")
        connection.close()
        return
    if status != 200:
        side.errors.append(f"HTTP {status}")
        return
    side.requests += 1
    if arrivals:
        side.ttft.append(arrivals[0] - started)
        side.gaps.extend(b - a for a, b in itertools.pairwise(arrivals))


async def phase(
    url: str,
    model: str,
    side: Side,
    streams: int,
    seconds: float,
    stream_s: float,
    token: str = ADMIN_TOKEN,
) -> int:
    """``streams`` clients, each on its own kept-alive connection, one stream after another.
    Their starts are spread over one stream's length (``stream_s``), so requests arrive evenly
    as from many independent clients, not in waves of ``streams`` at once; what starts during
    that ramp (each connection's first request among it) is not counted."""
    ramp_end = time.monotonic() + stream_s
    stop = ramp_end + seconds
    ramp = Side()

    async def loop(index: int) -> None:
        await asyncio.sleep(index / streams * stream_s)
        connection = Connection(url, token)
        try:
            while (now := time.monotonic()) < stop:
                await one_stream(connection, model, side if now >= ramp_end else ramp)
        finally:
            connection.close()

    before = side.requests + len(side.errors)
    await asyncio.gather(*(loop(i) for i in range(streams)))
    side.errors.extend(ramp.errors)
    return side.requests + len(side.errors) - before + ramp.requests  # every stream started


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(args: argparse.Namespace, cp: str, stub: str, cp_pid: int) -> dict[str, Any]:
    """Set up, then alternate the phases; the router's own CPU time is counted over its
    routed phases (per request and per token: what it costs whatever else runs)."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        with tempfile.TemporaryDirectory() as tmp:
            sys.path.insert(0, str(HERE))
            from controlplane_bench import write_adapter

            adapter_dir = write_adapter(Path(tmp).resolve() / "a0")
            await set_up(client, cp, stub, adapter_dir)
        token = ADMIN_TOKEN
        if args.token == "scoped":  # what a client of the router holds: a token of its own
            made = await client.post(
                cp + "/v1/tokens",
                json={"name": "bench", "scopes": ["route"], "namespace": "default"},
                headers=ADMIN,
            )
            made.raise_for_status()
            token = made.json()["token"]
    # the client's own heap out of the collector: a full pass over it (200 ms here) would
    # show up as latency on whichever side was running
    gc.collect()
    gc.freeze()
    direct, routed = Side(), Side()
    stream_s = args.tokens * args.gap_ms / 1000
    router_cpu_s, routed_all = 0.0, 0
    load_before = os.getloadavg()[0]
    try:
        for _ in range(args.rounds):
            await phase(stub, "a0", direct, args.concurrency, args.phase_s, stream_s)
            before = cpu_seconds(cp_pid)
            routed_all += await phase(
                cp, "bench:a0", routed, args.concurrency, args.phase_s, stream_s, token
            )
            router_cpu_s += cpu_seconds(cp_pid) - before
    finally:
        gc.unfreeze()
    d, r = direct.summary(), routed.summary()
    added = {
        "ttft_p50_ms": round(r["ttft_ms"]["p50"] - d["ttft_ms"]["p50"], 3),
        "ttft_p99_ms": round(r["ttft_ms"]["p99"] - d["ttft_ms"]["p99"], 3),
        "gap_p50_ms": round(r["gap_ms"]["p50"] - d["gap_ms"]["p50"], 3),
        "gap_p99_ms": round(r["gap_ms"]["p99"] - d["gap_ms"]["p99"], 3),
    }
    return {
        "added": added,
        "targets": {"added_p50_ms": 1.0, "added_p99_ms": 5.0},
        "direct": d,
        "routed": r,
        "requests": direct.requests + routed.requests,
        "errors": len(direct.errors) + len(routed.errors),
        # over the routed phases, ramps included (the router served those streams too)
        "router_cpu": {
            "seconds": round(router_cpu_s, 3),
            "streams": routed_all,
            "ms_per_stream": round(router_cpu_s * 1000 / max(1, routed_all), 3),
        },
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=200, help="streams open at once")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per stream")
    parser.add_argument("--gap-ms", type=float, default=100.0, help="the stub's gap between tokens")
    parser.add_argument("--phase-s", type=float, default=5.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3, help="direct/routed phase pairs")
    parser.add_argument(
        "--db-url", default=None, help="the control plane's database (default: a new SQLite file)"
    )
    parser.add_argument(
        "--token",
        choices=("admin", "scoped"),
        default="admin",
        help="routed requests carry the bootstrap admin token, or a route-scoped token made "
        "through the API (looked up in the database, then kept in memory: token_cache_s)",
    )
    parser.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-controlplane", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_stub is not None:
        serve_stub(args.serve_stub, args.tokens, args.gap_ms / 1000)
        return 0
    if args.serve_controlplane is not None:
        serve_controlplane(args.serve_controlplane, args.db_url)
        return 0
    for name, value in (
        ("--concurrency", args.concurrency),
        ("--tokens", args.tokens),
        ("--rounds", args.rounds),
    ):
        if value < 1:
            parser.error(f"{name}: {value} is not a positive integer")
    if args.gap_ms < 0 or args.phase_s <= 0:
        parser.error(f"--gap-ms must be >= 0 and --phase-s > 0 (got {args.gap_ms}, {args.phase_s})")
    with tempfile.TemporaryDirectory() as tmp:
        db_url = args.db_url or f"sqlite:///{tmp}/controlplane.db"
        stub_port, cp_port = free_port(), free_port()
        logs = Path(tmp)
        stub = spawn(
            [
                "--serve-stub",
                str(stub_port),
                "--tokens",
                str(args.tokens),
                "--gap-ms",
                str(args.gap_ms),
            ],
            logs / "stub.log",
        )
        cp = spawn(
            ["--serve-controlplane", str(cp_port), "--db-url", db_url], logs / "controlplane.log"
        )
        try:
            result = asyncio.run(
                measure(
                    args, f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{stub_port}", cp.pid
                )
            )
        except Exception as exc:
            for log in ("stub.log", "controlplane.log"):
                sys.stderr.write(f"--- {log}\n{(logs / log).read_text(errors='replace')[-3000:]}\n")
            sys.stderr.write(f"router bench failed: {exc}\n")
            return 1
        finally:
            for proc in (stub, cp):
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
                if proc.poll() is None:
                    proc.kill()
    result = {
        "bench": "router",
        "config": {
            "concurrency": args.concurrency,
            "tokens": args.tokens,
            "gap_ms": args.gap_ms,
            "phase_s": args.phase_s,
            "rounds": args.rounds,
            "database": "sqlite" if args.db_url is None else args.db_url.split(":", 1)[0],
            "token": args.token,
        },
        **result,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
