"""`loraplane bench serve`: what a streaming client sees, in the field's form.

Like SGLang's ``bench_serving`` and vLLM's ``benchmark_serving``: clients stream generations
from a worker (``/generate``) or the control plane's router (``--endpoint completions``) and
the benchmark reports output tokens per
second, time to first token and inter-token gaps, per workload row. A row is one transport
(``http`` or ``in-process``), one load (``clients`` closed-loop streams, or a Poisson
``rate``) and one number of distinct ``adapters`` in use (0 = the base model); every row is
measured over ``--windows`` windows of ``--duration`` seconds after ``--warmup`` seconds.

- ``--url`` targets a running server; ``--model`` starts ``loraplane worker serve`` itself
  (``--worker-arg`` passes flags through), ``--transports in-process`` drives the same engine without
  HTTP (``serve.factory.build_engine``), for the HTTP / in-process ratio.
- ``--fixture dense|moe`` writes the probe models first (the Llama-3-8B or
  Qwen3-30B-A3B layer shape, ``--layers`` of them, bf16, random weights) and
  ``--num-adapters`` rank-16 adapters on every target.
- Prompts are random token ids (``--prompt-len``), ``--output-len`` new tokens, greedy with
  ``ignore_eos``; adapters are drawn ``uniform`` or ``zipf`` from the first ``adapters`` of
  the list, per request. With ``--shared-prefix N`` (a sweep: ``0,1024``) every prompt of one adapter (or of the
  base model) starts with the same N ids, drawn from the adapter's name (the worker's prefix
  cache, ADR 0015); rows name it (``shared_prefix``).
- ``gpu_busy`` is NVML's utilisation (the share of time a kernel ran), sampled every
  100 ms through the window, when NVML can be loaded; null otherwise.
- Why a window is slow or failed: ``error_kinds`` (the failed requests' messages, the 5 most
  frequent, with counts), ``cpu`` (cores used by this process and, for a worker it started,
  the worker and each of its processes: ``engine-core:<pid>``, ``rank:<pid>``) and ``engine``
  (from the server's ``/metrics`` at the window's edges: mean queue, first-token and step
  times, decode and mixed steps, the prefix cache's hit rate by lookups; null in-process).

Progress goes to stderr, one JSON object to stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from yarl import URL

# --- what one request saw -------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    adapter: str | None
    start: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each streamed chunk
    tokens: int = 0  # completion tokens the server reported (or counted)
    error: str | None = None
    # completion tokens so far at each chunk, where the stream says (/generate's meta_info)
    counts: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.start if self.chunks else None

    def token_times(self) -> list[float]:
        """When each output token arrived: a chunk carrying several tokens (held-back text,
        or events the server joined) counts them all at its arrival, by the stream's own
        counts where it gives them, else spread evenly over the chunks."""
        if not self.chunks or not self.tokens:
            return []
        if len(self.counts) == len(self.chunks):
            return [
                t
                for t, n, m in zip(self.chunks, self.counts, [0, *self.counts[:-1]], strict=True)
                for _ in range(n - m)
            ]
        per = self.tokens / len(self.chunks)
        times: list[float] = []
        for i, t in enumerate(self.chunks):
            n = round((i + 1) * per) - round(i * per)
            times.extend([t] * n)
        return times


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(records: list[RequestRecord], t0: float, t1: float) -> dict[str, Any]:
    """A window's figures: tokens that arrived in [t0, t1), the TTFT of requests started in
    it, the gaps between chunks that arrived in it."""
    tokens = sum(1 for r in records for t in r.token_times() if t0 <= t < t1)
    started = [r for r in records if t0 <= r.start < t1]
    ttfts = [r.ttft * 1e3 for r in started if r.ttft is not None and r.error is None]
    gaps = [
        (b - a) * 1e3
        for r in records
        for a, b in zip(r.chunks, r.chunks[1:], strict=False)
        if t0 <= b < t1
    ]
    ended = [r for r in records if r.chunks and t0 <= r.chunks[-1] < t1 and r.error is None]
    return {
        "out_tok_s": round(tokens / (t1 - t0), 1),
        "ttft_ms_p50": _round(percentile(ttfts, 50)),
        "ttft_ms_p99": _round(percentile(ttfts, 99)),
        "ttft_ms_max": _round(max(ttfts, default=None)),
        "itl_ms_p50": _round(percentile(gaps, 50)),
        "itl_ms_p99": _round(percentile(gaps, 99)),
        "requests": len(ended),
        "req_s": round(len(ended) / (t1 - t0), 2),
        "errors": sum(1 for r in started if r.error is not None),
        "error_kinds": error_kinds(started),
    }


def error_kinds(records: list[RequestRecord], top: int = 5) -> dict[str, int]:
    """The failed requests' messages (cut to 120 characters) and how many had each, the
    ``top`` most frequent first."""
    counts = Counter(r.error[:120] for r in records if r.error is not None)
    return dict(counts.most_common(top))


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


# --- transports ---------------------------------------------------------------------------

# A stream's events go straight to its record; a larger read buffer only means fewer reads.
READ_BUFSIZE = 1 << 20
# A connection that waited for its first byte, or for the next event, this long has failed.
STREAM_TIMEOUT_S = 600
# An idle connection is closed after this long: below the keep-alive of the servers measured
# (uvicorn's default 5 s, the router's; the worker's 75 s), so the bench never sends a request
# on a connection the server is closing.
KEEPALIVE_S = 4


class Transport(Protocol):
    name: str

    async def stream(
        self, prompt: list[int], adapter: str | None, output_len: int, record: RequestRecord
    ) -> None: ...

    async def close(self) -> None: ...


class HttpTransport:
    """Streams ``POST /generate`` (a worker: one event per step, so every token's arrival is
    seen) or ``POST /v1/completions`` (a worker or the router: an event per text delta, so
    tokens that decode to no text yet arrive with the next one, and TTFT and the gaps count
    text, not tokens).

    Over aiohttp, as the router's upstream streams (``controlplane/upstream.py``) and SGLang's
    ``bench_serving``: a stream costs this process little CPU, so its event loop does not hold
    token events back and inflate the TTFT and gaps it reports (``cpu.bench`` near 1.0 says
    it did). The session is made in the event loop that streams (a transport's rows run in
    one ``asyncio.run``) and closed by ``close``."""

    name = "http"

    def __init__(self, url: str, endpoint: str, token: str | None) -> None:
        self.endpoint = endpoint
        path = "/generate" if endpoint == "generate" else "/v1/completions"
        self.url = URL(url.rstrip("/") + path)  # parsed once, not per request
        self.headers = {"Authorization": f"Bearer {token}"} if token else None
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                # no cap on connections: every client streams on its own
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                headers=self.headers,
                read_bufsize=READ_BUFSIZE,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=STREAM_TIMEOUT_S, sock_read=STREAM_TIMEOUT_S
                ),
                cookie_jar=aiohttp.DummyCookieJar(),  # servers set none: nothing to store
            )
        return self.session

    def _body(self, prompt: list[int], adapter: str | None, output_len: int) -> dict[str, Any]:
        """The body of one greedy streamed request of ``output_len`` tokens."""
        greedy = {"temperature": 0, "ignore_eos": True}
        if self.endpoint == "generate":
            sampling = {"max_new_tokens": output_len, **greedy}
            body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
            if adapter is not None:
                body["lora_path"] = adapter
            return body
        body = {"prompt": prompt, "max_tokens": output_len, **greedy, "stream": True}
        if adapter is not None:
            body["model"] = adapter
        return body

    async def stream(
        self, prompt: list[int], adapter: str | None, output_len: int, record: RequestRecord
    ) -> None:
        body = self._body(prompt, adapter, output_len)
        async with self._session().post(self.url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {_error_message(text)[:200]}"
                return
            # each read's complete lines, as the router's ``upstream.lines`` splits them
            pending = b""
            async for data in response.content.iter_any():
                pending += data
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    if self._event(line, record):
                        return
            if pending:  # a last line without its newline
                self._event(pending, record)

    def _event(self, line: bytes, record: RequestRecord) -> bool:
        """Record one line of the stream; True when it ends the request (an error event)."""
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return False
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if "error" in chunk:
            record.error = str(chunk["error"])[:200]
            return True
        if self.endpoint == "generate":
            tokens = int(chunk["meta_info"]["completion_tokens"])
            if tokens > record.tokens:
                record.chunks.append(now)
                record.counts.append(tokens)
                record.tokens = tokens
            return False
        choices = chunk.get("choices") or [{}]
        if choices[0].get("text") or not record.chunks:
            record.chunks.append(now)
        if chunk.get("usage"):
            record.tokens = int(chunk["usage"]["completion_tokens"])
        return False

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def _error_message(body: str) -> str:
    """The message of an error body (``{"error": {"message": ...}}``, or FastAPI's
    ``{"detail": ...}``), else the body as it came."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if "detail" in doc:
            return str(doc["detail"])
    return body


class InProcessTransport:
    """The same engine driven in this process through ``InThreadEngineClient`` (its
    detokenizing included), without HTTP."""

    name = "in-process"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def stream(
        self, prompt: list[int], adapter: str | None, output_len: int, record: RequestRecord
    ) -> None:
        from loraplane.worker.engine.sampling import SamplingParams

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        seq = self.engine.submit(
            uuid.uuid4().hex,
            prompt,
            params,
            adapter,
            lambda event: loop.call_soon_threadsafe(queue.put_nowait, event),
        )
        try:
            while True:
                event = await queue.get()
                if event.error:
                    record.error = event.error[:200]
                    return
                if event.token_ids:
                    record.chunks.append(time.perf_counter())
                    record.tokens += len(event.token_ids)
                if event.finished:
                    return
        finally:
            if not record.chunks or record.error:
                self.engine.abort(seq)

    async def close(self) -> None:
        pass


# --- load -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    adapters: int  # distinct adapters in use; 0 = the base model
    clients: int  # closed-loop streams (0 under a Poisson rate)
    rate: float | None  # Poisson requests per second, or None
    shared_prefix: int = 0  # the first ids every prompt of one adapter shares


class AdapterDraw:
    def __init__(self, names: list[str], dist: str, rng: random.Random) -> None:
        self.names = names
        self.rng = rng
        weights = [1.0 / (i + 1) for i in range(len(names))] if dist == "zipf" else None
        self.weights = weights

    def __call__(self) -> str | None:
        if not self.names:
            return None
        return self.rng.choices(self.names, weights=self.weights)[0]


async def run_row(
    transport: Transport,
    row: Row,
    draw: AdapterDraw,
    *,
    prompt_len: int,
    output_len: int,
    vocab: int,
    warmup: float,
    duration: float,
    windows: int,
    seed: int,
    busy: GpuBusy,
    progress: Callable[[str], None],
    shared_prefix: int = 0,
    cpu: CpuUse | None = None,
    engine: EngineMetrics | None = None,
) -> list[dict[str, Any]]:
    """Drive one row's load and return one summary per window (with ``cpu``, each process's
    CPU use; with ``engine``, the server's own figures; null without)."""
    cpu = cpu or CpuUse()
    rng = random.Random(seed)
    prefixes: dict[str | None, list[int]] = {}

    def prefix_of(adapter: str | None) -> list[int]:
        if adapter not in prefixes:
            draw = random.Random(f"prefix:{adapter}")
            prefixes[adapter] = [draw.randrange(1, vocab) for _ in range(shared_prefix)]
        return prefixes[adapter]

    records: list[RequestRecord] = []
    end = time.perf_counter() + warmup + duration * windows
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        adapter = draw()
        head = prefix_of(adapter) if shared_prefix else []
        prompt = head + [rng.randrange(1, vocab) for _ in range(prompt_len - len(head))]
        record = RequestRecord(adapter, time.perf_counter())
        records.append(record)
        try:
            await transport.stream(prompt, record.adapter, output_len, record)
        except Exception as exc:  # a dropped connection is a row's error, not the bench's
            name = type(exc).__name__  # aiohttp's errors often carry no message: the type does
            record.error = (f"{name}: {exc}" if str(exc) else name)[:200]

    async def client() -> None:
        while time.perf_counter() < end:
            await one()

    start = time.perf_counter()
    if row.rate is None:
        tasks = {asyncio.create_task(client()) for _ in range(row.clients)}
    else:
        arrivals = random.Random(seed + 1)

        async def poisson() -> None:
            while time.perf_counter() < end:
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(arrivals.expovariate(row.rate or 1.0))

        tasks = {asyncio.create_task(poisson())}
    edges = [start + warmup + duration * i for i in range(windows + 1)]
    summaries: list[dict[str, Any]] = []
    for i in range(windows):
        await asyncio.sleep(max(0.0, edges[i] - time.perf_counter()))
        before = await engine.scrape() if engine else None
        busy.begin()
        cpu.begin()
        await asyncio.sleep(max(0.0, edges[i + 1] - time.perf_counter()))
        gpu_busy = busy.end()
        cpu_use = cpu.end()
        summary = summarise(records, edges[i], edges[i + 1])
        summary["gpu_busy"] = gpu_busy
        summary["cpu"] = cpu_use
        summary["engine"] = EngineMetrics.delta(before, await engine.scrape()) if engine else None
        summary["window"] = i
        summaries.append(summary)
        progress(
            f"  window {i}: {summary['out_tok_s']} tok/s, ttft p50 {summary['ttft_ms_p50']} ms, "
            f"itl p50 {summary['itl_ms_p50']} ms, {summary['requests']} requests, "
            f"{summary['errors']} errors, gpu_busy {gpu_busy}"
        )
        progress(f"    {diagnosis(summary)}")
    # stop issuing; let the streams in flight end so the next row starts from an idle server
    await asyncio.gather(*list(tasks), return_exceptions=True)
    return summaries


def diagnosis(summary: dict[str, Any]) -> str:
    """A window's CPU use, engine figures and error kinds on one line."""
    cpu = " ".join(f"{k} {v}" for k, v in summary.get("cpu", {}).items())
    parts = [f"cpu {cpu or '-'}"]
    e = summary.get("engine")
    if e is not None and all(v is None for v in e.values()):
        parts.append("engine -")
    elif e is not None:
        parts.append(
            f"queue {e['queue_ms_mean']} ms, first token {e['first_token_ms_mean']} ms, "
            f"steps decode {e['decode_steps']} x {e['decode_step_ms_mean']} ms "
            f"mixed {e['mixed_steps']} x {e['mixed_step_ms_mean']} ms, "
            f"prefix hits {e['prefix_hit_rate']}"
        )
    if summary.get("error_kinds"):
        parts.append(f"errors {json.dumps(summary['error_kinds'])}")
    return "; ".join(parts)


class GpuBusy:
    """NVML utilisation of the GPUs ``0 .. devices - 1`` sampled on a thread between ``begin``
    and ``end``, their mean (null without NVML)."""

    def __init__(self, devices: int = 1) -> None:
        self.handles: list[Any] = []
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(devices)]
            self.nvml = pynvml
        except Exception:  # no driver, no pynvml, fewer GPUs: gpu_busy is reported as null
            self.handles = []
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        if not self.handles:
            return
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            rates = [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
            self.samples.append(statistics.fmean(rates) / 100.0)

    def end(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        return round(statistics.fmean(self.samples), 3) if self.samples else None


class CpuUse:
    """The share of one CPU core (1.0 = a full core) each process used between ``begin`` and
    ``end``, from /proc/<pid>/stat: ``bench`` (this process) and, given the ``worker``'s pid,
    the worker (its HTTP front end) and each of its descendants that lived through the window
    (``engine-core:<pid>``, ``rank:<pid>``, ...). Without /proc, or for a process that ended,
    the entry is left out."""

    def __init__(self, worker: int | None = None) -> None:
        self.worker = worker
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._begin: tuple[float, dict[str, float]] = (0.0, {})

    def begin(self) -> None:
        self._begin = (time.perf_counter(), self._ticks())

    def end(self) -> dict[str, float]:
        t0, before = self._begin
        after = self._ticks()
        seconds = max(time.perf_counter() - t0, 1e-9)
        return {
            key: round((after[key] - ticks) / self.tick / seconds, 2)
            for key, ticks in before.items()
            if key in after
        }

    def _ticks(self) -> dict[str, float]:
        """CPU ticks (user + system) so far of every process measured, by key."""
        stats = _proc_stats()
        ticks = {}
        if os.getpid() in stats:
            ticks["bench"] = stats[os.getpid()][1]
        if self.worker is None or self.worker not in stats:
            return ticks
        ticks["worker"] = stats[self.worker][1]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo = [(pid, 1) for pid in children.get(self.worker, [])]
        while todo:
            pid, depth = todo.pop()
            ticks[f"{_process_name(pid, depth)}:{pid}"] = stats[pid][1]
            todo += [(child, depth + 1) for child in children.get(pid, [])]
        return ticks


def _proc_stats() -> dict[int, tuple[int, float]]:
    """{pid: (parent pid, utime + stime in ticks)} of every process /proc shows (none
    without /proc)."""
    stats: dict[int, tuple[int, float]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return stats
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read()
        except OSError:  # ended since the listing
            continue
        # the fields after the command name (which may hold spaces and parentheses):
        # state ppid ... utime (14th field of the line) stime (15th)
        rest = text[text.rindex(b")") + 2 :].split()
        stats[pid] = (int(rest[1]), float(int(rest[11]) + int(rest[12])))
    return stats


def _process_name(pid: int, depth: int) -> str:
    """A short name for a descendant of the worker: the engine core (its multiprocessing
    spawn child), the core's rank processes (spawned by it in turn), the resource tracker,
    else the program's name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    line = " ".join(argv)
    if "spawn_main" in line:
        return "engine-core" if depth == 1 else "rank"
    if "resource_tracker" in line:
        return "resource-tracker"
    if argv and argv[0]:
        return Path(argv[0]).name
    return "process"


ENGINE_FIGURES = (
    "queue_ms_mean",
    "first_token_ms_mean",
    "decode_steps",
    "mixed_steps",
    "decode_step_ms_mean",
    "mixed_step_ms_mean",
    "prefix_hit_rate",
)


class EngineMetrics:
    """The worker's own figures for a window, from two scrapes of its ``GET /metrics`` (one
    short request of its own at each edge, 5 s timeout): the means of its queue, first-token
    and step histograms, step counts by kind, and the prefix cache's hit rate by lookups.
    A figure whose metric the server does not expose (or a failed scrape) is null."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def scrape(self) -> dict[str, float] | None:
        """The totals so far, by series (``None`` if the scrape failed)."""
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5, headers=self.headers) as client:
                response = await client.get(self.url)
                response.raise_for_status()
            return parse_engine_totals(response.text)
        except Exception:  # a scrape never fails the row: its figures are null
            return None

    @staticmethod
    def delta(begin: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, Any]:
        def d(key: str) -> float | None:
            if begin is None or end is None or key not in begin or key not in end:
                return None
            return end[key] - begin[key]

        def mean_ms(name: str) -> float | None:
            total, count = d(f"{name}_sum"), d(f"{name}_count")
            if total is None or not count:
                return None
            return round(1000 * total / count, 2)

        def steps(kind: str) -> int | None:
            count = d(f"step:{kind}_count")
            return None if count is None else int(count)

        hits, lookups = d("prefix:hit"), d("prefix:all")
        return {
            "queue_ms_mean": mean_ms("queue"),
            "first_token_ms_mean": mean_ms("first_token"),
            "decode_steps": steps("decode"),
            "mixed_steps": steps("mixed"),
            "decode_step_ms_mean": mean_ms("step:decode"),
            "mixed_step_ms_mean": mean_ms("step:mixed"),
            "prefix_hit_rate": None if hits is None or not lookups else round(hits / lookups, 3),
        }


_HISTOGRAMS = {
    "loraplane_worker_queue_seconds": "queue",
    "loraplane_worker_first_token_seconds": "first_token",
    "loraplane_worker_step_seconds": "step",
}


def parse_engine_totals(text: str) -> dict[str, float]:
    """The series ``EngineMetrics`` needs from a Prometheus text page, summed over their
    labels: ``queue_sum``/``queue_count``, ``first_token_*``, ``step:<kind>_*``,
    ``prefix:hit`` and ``prefix:all`` (lookups); a series the page lacks is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        totals[key] = totals.get(key, 0.0) + value

    for family in text_string_to_metric_families(text):
        # a family the page has counts from 0 in the series it has not born yet
        kinds = ["step:decode", "step:mixed"] if family.name.endswith("step_seconds") else []
        for key in kinds or [_HISTOGRAMS.get(family.name, "")]:
            if key:
                totals.setdefault(f"{key}_sum", 0.0)
                totals.setdefault(f"{key}_count", 0.0)
        if family.name == "loraplane_worker_prefix_lookups":
            totals.setdefault("prefix:all", 0.0)
            totals.setdefault("prefix:hit", 0.0)
        for sample in family.samples:
            base, _, suffix = sample.name.rpartition("_")
            if base in _HISTOGRAMS and suffix in ("sum", "count"):
                key = _HISTOGRAMS[base]
                if key == "step":
                    key = f"step:{sample.labels.get('kind', 'unknown')}"
                add(f"{key}_{suffix}", sample.value)
            elif sample.name == "loraplane_worker_prefix_lookups_total":
                add("prefix:all", sample.value)
                add("prefix:hit", sample.value if sample.labels.get("result") == "hit" else 0.0)
    return totals


# --- the worker under test ------------------------------------------------------------------


def make_fixtures(kind: str, root: Path, layers: int, adapters: int) -> tuple[Path, list[Path]]:
    """The probe model (``bench.common.probe_fixtures`` shapes at full width) and adapters."""
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    model_dir = root / f"{kind}-{layers}l"
    moe = kind == "moe"
    hidden = 2048 if moe else 4096
    if not (model_dir / "config.json").is_file():
        make_model(
            model_dir,
            "qwen3-moe" if moe else "llama",
            dtype="bfloat16",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=32,
            num_kv_heads=4 if moe else 8,
            intermediate_size=14336,
            vocab_size=32000,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            head_dim=128,
            max_position_embeddings=4096,
        )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if not moe:
        targets += ["gate_proj", "up_proj", "down_proj"]
    paths = []
    for i in range(adapters):
        path = root / f"{kind}-{layers}l-a{i}"
        if not (path / "adapter_config.json").is_file():
            make_adapter(
                model_dir, path, rank=16, alpha=32, targets=targets, seed=i, experts=moe,
                dtype="bfloat16",
            )  # fmt: skip
        paths.append(path)
    return model_dir, paths


def _free_port() -> int:
    from loraplane.devcluster.processes import free_port

    return free_port()


class WorkerProcess:
    """``loraplane worker serve`` in a child process, stopped with the benchmark."""

    def __init__(self, args: list[str], log: Path, progress: Callable[[str], None]) -> None:
        self.port = _free_port()
        cmd = [
            sys.executable, "-c", "from loraplane.cli import app; app()", "worker", "serve",
            *args, "--port", str(self.port),
        ]  # fmt: skip
        progress(f"starting worker: {' '.join(cmd[3:])} (log {log})")
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the worker exited with {self.proc.returncode} before it was ready; see {self.log.name}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the worker was not ready after {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# --- the command ----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplane bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_argument_group("what to measure")
    target.add_argument("--url", help="a running worker or router (skips starting a worker)")
    target.add_argument("--model", type=Path, help="start `loraplane worker serve` on this model")
    target.add_argument(
        "--fixture", choices=("dense", "moe"), help="write the probe model and adapters first"
    )
    target.add_argument("--workdir", type=Path, default=Path("/tmp/loraplane-bench-serve"))
    target.add_argument("--layers", type=int, default=16, help="--fixture: decoder layers")
    target.add_argument(
        "--num-adapters", type=int, default=32, help="--fixture: adapters to write and load"
    )
    target.add_argument(
        "--lora", action="append", default=[], help="NAME=PATH to load at start; repeat"
    )
    target.add_argument(
        "--adapter-names",
        help="comma-separated adapters the server already holds (with --url)",
    )
    target.add_argument("--device", default="cuda")
    target.add_argument(
        "--tp", type=int, default=1, help="the worker's --tp (GPUs; both transports)"
    )
    target.add_argument("--dp", type=int, default=1, help="the worker's --dp (DP attention groups)")
    target.add_argument(
        "--dp-attention",
        action="store_true",
        help="the worker's --dp-attention (needed by --dp > 1)",
    )
    target.add_argument("--slots", type=int, default=32, help="K (--max-loras-per-batch)")
    target.add_argument("--max-running", type=int, default=64)
    target.add_argument("--lora-backend", default="triton", help="triton | torch (both transports)")
    target.add_argument("--sampler", default="auto", help="auto | torch | triton (both transports)")
    target.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="another flag for `worker serve` (http only; write --worker-arg=--flag); repeat",
    )
    target.add_argument(
        "--transports",
        default="http",
        help="comma-separated: http, in-process (in-process builds the engine in this process)",
    )
    target.add_argument(
        "--endpoint",
        choices=("generate", "completions"),
        default="generate",
        help="generate: the worker's /generate, every token seen (default); completions: "
        "/v1/completions, what the router serves (chunks carry text, not tokens)",
    )
    target.add_argument("--token", default=os.environ.get("LORAPLANE_TOKEN"))
    target.add_argument(
        "--worker-log-level",
        default="warning",
        help="the started worker's --log-level (info lists each decode graph it captures)",
    )
    load = p.add_argument_group("the workload")
    load.add_argument("--clients", default="48", help="closed-loop streams; comma-separated sweep")
    load.add_argument(
        "--rate",
        default="",
        help="Poisson requests/s rows (comma-separated), beside the closed-loop rows",
    )
    load.add_argument(
        "--poisson-fraction",
        type=float,
        default=0.0,
        help="after each closed-loop row, a Poisson row at this fraction of its req/s",
    )
    load.add_argument(
        "--adapters",
        default="0,4,16,32",
        help="distinct adapters in use per row (0 = base); comma-separated",
    )
    load.add_argument("--dist", choices=("uniform", "zipf"), default="uniform")
    load.add_argument("--prompt-len", type=int, default=256)
    load.add_argument("--output-len", type=int, default=128)
    load.add_argument(
        "--shared-prefix",
        default="0",
        help="the first N prompt ids are the same for every request of an adapter; "
        "comma-separated sweep (rows without sharing first, e.g. 0,1024)",
    )
    load.add_argument("--vocab", type=int, help="prompt ids below this (default: the model's)")
    load.add_argument("--warmup", type=float, default=5.0, help="seconds before the windows")
    load.add_argument("--duration", type=float, default=20.0, help="seconds per window")
    load.add_argument("--windows", type=int, default=1)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def progress(message: str) -> None:
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _resolve_target(args: argparse.Namespace) -> tuple[Path | None, list[tuple[str, str]]]:
    loras = [tuple(x.split("=", 1)) for x in args.lora]
    bad = [x for x, parts in zip(args.lora, loras, strict=True) if len(parts) != 2]
    if bad:
        raise SystemExit(f"error: --lora {bad[0]!r}: expected NAME=PATH")
    model: Path | None = args.model
    if args.fixture:
        progress(f"writing the {args.fixture} probe model and {args.num_adapters} adapters")
        model, paths = make_fixtures(args.fixture, args.workdir, args.layers, args.num_adapters)
        loras = [(f"a{i}", str(path)) for i, path in enumerate(paths)]
    return model, [(str(n), str(p)) for n, p in loras]


def _vocab(args: argparse.Namespace, model: Path | None) -> int:
    if args.vocab:
        return int(args.vocab)
    if model is not None:
        return int(json.loads((model / "config.json").read_text())["vocab_size"])
    return 1000


def _worker_flags(args: argparse.Namespace, model: Path, loras: list[tuple[str, str]]) -> list[str]:
    flags = [
        "--model", str(model), "--device", args.device,
        "--max-loras-per-batch", str(args.slots),
        "--max-loaded-loras", str(max(args.slots, len(loras), 1)),
        "--max-running", str(args.max_running),
        "--lora-backend", args.lora_backend, "--sampler", args.sampler,
        "--log-level", args.worker_log_level, "--tp", str(args.tp), "--dp", str(args.dp),
    ]  # fmt: skip
    if args.dp_attention:
        flags.append("--dp-attention")
    for name, path in loras:
        flags += ["--lora", f"{name}={path}"]
    return flags + list(args.worker_arg)


def _serve_config(args: argparse.Namespace, model: Path, loras: list[tuple[str, str]]) -> Any:
    from loraplane.worker.server.factory import ServeConfig

    return ServeConfig(
        model=str(model),
        device=args.device,
        max_loras_per_batch=args.slots,
        max_loaded_loras=max(args.slots, len(loras), 1),
        max_running=args.max_running,
        lora_backend=args.lora_backend,
        sampler=args.sampler,
        tp=args.tp,
        dp=args.dp,
        dp_attention=args.dp_attention,
    )


def _rows(args: argparse.Namespace, transport: str) -> list[Row]:
    rows: list[Row] = []
    rates = [float(x) for x in args.rate.split(",") if x.strip()]
    for s in _ints(args.shared_prefix):
        rows += [
            Row(transport, a, c, None, s) for c in _ints(args.clients) for a in _ints(args.adapters)
        ]
        rows += [Row(transport, a, 0, r, s) for r in rates for a in _ints(args.adapters)]
    return rows


async def _measure(
    transport: Transport,
    args: argparse.Namespace,
    names: list[str],
    vocab: int,
    busy: GpuBusy,
    slots: int | None,
    on_row: Callable[[list[dict[str, Any]]], None],
    cpu: CpuUse | None = None,
    engine: EngineMetrics | None = None,
) -> list[dict[str, Any]]:
    """Every row of ``transport``, each given to ``on_row`` as it ends; closes the transport."""
    try:
        results: list[dict[str, Any]] = []
        for i, row in enumerate(_rows(args, transport.name)):
            todo = [row]
            while todo:
                row = todo.pop(0)
                if row.adapters > len(names):
                    progress(f"skip {row}: only {len(names)} adapters are loaded")
                    continue
                progress(f"row {row}")
                draw = AdapterDraw(names[: row.adapters], args.dist, random.Random(args.seed + i))
                windows = await run_row(
                    transport,
                    row,
                    draw,
                    prompt_len=args.prompt_len,
                    output_len=args.output_len,
                    vocab=vocab,
                    warmup=args.warmup,
                    duration=args.duration,
                    windows=args.windows,
                    seed=args.seed + 1000 * i,
                    busy=busy,
                    progress=progress,
                    shared_prefix=row.shared_prefix,
                    cpu=cpu,
                    engine=engine,
                )
                for summary in windows:
                    results.append(
                        {
                            **asdict(row),
                            "slots": slots,
                            **summary,
                        }
                    )
                on_row(results)
                if row.rate is None and args.poisson_fraction > 0:
                    peak = statistics.fmean(w["req_s"] for w in windows)
                    if peak > 0:
                        todo.append(
                            Row(
                                row.transport,
                                row.adapters,
                                0,
                                round(peak * args.poisson_fraction, 2),
                                row.shared_prefix,
                            )
                        )
        return results
    finally:
        await transport.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in transports if t not in ("http", "in-process")]
    if unknown:
        print(f"error: --transports {unknown[0]!r}: expected http or in-process", file=sys.stderr)
        return 2
    if args.url and "in-process" in transports:
        print(
            "error: --transports in-process needs --model or --fixture, not --url", file=sys.stderr
        )
        return 2
    if not args.url and not (args.model or args.fixture):
        print("error: give --url, --model or --fixture", file=sys.stderr)
        return 2
    try:
        prefixes = _ints(args.shared_prefix)
    except ValueError:
        print(
            f"error: --shared-prefix {args.shared_prefix!r}: expected integers like 0,1024",
            file=sys.stderr,
        )
        return 2
    bad = [n for n in prefixes if not 0 <= n < args.prompt_len]
    if bad:
        print(
            f"error: --shared-prefix {bad[0]} must be in 0..--prompt-len - 1 "
            f"({args.prompt_len - 1}): each prompt keeps at least one id of its own",
            file=sys.stderr,
        )
        return 2
    model, loras = _resolve_target(args)
    names = [n for n, _ in loras] or [n for n in (args.adapter_names or "").split(",") if n.strip()]
    vocab = _vocab(args, model)
    busy = GpuBusy(args.tp)
    out: dict[str, Any] = {
        "bench": "serve",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": _env(args.device),
        "rows": [],
    }

    def flush(rows: list[dict[str, Any]] | None = None) -> None:
        """Write the JSON so far (with ``rows``, the transport's measured so far)."""
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            doc = out if rows is None else {**out, "rows": out["rows"] + rows}
            args.out.write_text(json.dumps(doc, indent=1))

    for name in transports:
        if name == "http":
            worker = None
            url = args.url
            if url is None:
                assert model is not None
                log = args.workdir / f"worker-k{args.slots}.log"
                args.workdir.mkdir(parents=True, exist_ok=True)
                worker = WorkerProcess(_worker_flags(args, model, loras), log, progress)
            try:
                if worker is not None:
                    out["ready_s"] = round(worker.wait_ready(args.ready_timeout), 1)
                    progress(f"worker ready after {out['ready_s']} s")
                    url = worker.url
                assert url is not None
                transport: Transport = HttpTransport(url, args.endpoint, args.token)
                slots = args.slots if worker is not None else None
                cpu = CpuUse(worker.proc.pid if worker is not None else None)
                scraper = EngineMetrics(url, args.token)
                out["rows"] += asyncio.run(
                    _measure(transport, args, names, vocab, busy, slots, flush, cpu, scraper)
                )
            finally:
                if worker is not None:
                    worker.stop()
        else:
            assert model is not None
            from loraplane.worker.server.engine_client import InThreadEngineClient
            from loraplane.worker.server.factory import build_engine

            progress("building the engine in this process")
            engine = InThreadEngineClient(build_engine(_serve_config(args, model, loras)))
            try:
                for lname, path in loras:
                    result = engine.load_adapter(lname, path, False).result()
                    if not result.success:
                        raise RuntimeError(f"--lora {lname}: {result.error_message}")
                out["rows"] += asyncio.run(
                    _measure(
                        InProcessTransport(engine), args, names, vocab, busy, args.slots, flush
                    )
                )
            finally:
                engine.stop()
        flush()
    print(json.dumps(out, indent=1))
    flush()
    return 1 if any(r["errors"] for r in out["rows"]) else 0


def _env(device: str) -> dict[str, Any]:
    from loraplane.worker.bench.common import env_info

    info = env_info(device)
    info["nvidia_smi"] = shutil.which("nvidia-smi") is not None
    return info


if __name__ == "__main__":
    sys.exit(main())
