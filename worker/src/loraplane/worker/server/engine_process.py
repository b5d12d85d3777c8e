"""The engine core in a process of its own, and the front end's client of it (ADR 0012).

The front end (uvicorn, FastAPI, tokenizing, detokenizing) starts the core with the spawn
context (CUDA needs it) and talks to it over one duplex pipe of pickled tuples:

    front end -> core   ("submit", rid, request_id, prompt_ids, params, adapter)
                        ("abort", rid)
                        ("call", call_id, method, args)   load, unload, lora_state, faults
                        ("stop",)
    core -> front end   ("out", events, observer_calls, tokens, routes)   once per step
                        ("reply", call_id, ok, value)
                        ("ready", info) | ("failed", kind, message) | ("dead", message)

The core runs today's `Engine` (executor, warm-up, adapter thread; a multi-rank executor's
rank processes are its children). After each step it sends ONE "out" message: every
sequence's new token ids and end, the observer calls of the step (the front end's
`WorkerMetrics` replays them, so /metrics stays in the front end), and the adapter routes
when they changed (the front end resolves adapters and lists them from that copy). A reply
goes after everything the core had to send before it, so a load's routes and metrics are
there when its answer is.

A core that dies (its engine loop failed, or the process exited) ends every request in
flight with an error and fails every call; /health then answers 503 with why. A front end
that goes away closes the pipe; the core sees the end of it, stops its engine and exits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from loraplane.worker.config import ConfigError
from loraplane.worker.engine.engine import (
    AdapterRoutes,
    Engine,
    EngineObserver,
    UnknownAdapterError,
    _NullObserver,
)
from loraplane.worker.engine.merge import LoRAUpdateResult
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import SeqEvent, Sequence
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.server.engine_client import Sink, text_sink
from loraplane.worker.server.factory import ServeConfig, build_engine
from loraplane.worker.server.faults import FaultInjector

log = logging.getLogger("loraplane.worker.engine_core")

_ERRORS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError,
    "AdapterError": ValueError,  # (AdapterError's constructor takes more than a message)
    "ValueError": ValueError,
}


def _error(kind: str, message: str) -> Exception:
    return _ERRORS.get(kind, RuntimeError)(message)


# Events cross the pipe as plain tuples: pickling a step's 64 SeqEvent dataclasses took
# ~16x as long as their tuples, on the engine's thread.
def _event_row(rid: int, e: SeqEvent) -> tuple[Any, ...]:
    return (rid, e.token_ids, e.finished, e.finish_reason, e.matched_stop,
            e.prompt_tokens, e.completion_tokens, e.error)  # fmt: skip


def _event(row: tuple[Any, ...]) -> SeqEvent:
    _rid, ids, finished, reason, matched, prompt_tokens, completion_tokens, error = row
    return SeqEvent("", ids, finished, reason, matched, prompt_tokens, completion_tokens, error)


# --- the core (the child process) ----------------------------------------------------------


class _Outbox:
    """What the core sends: a step's events, observer calls and routes in one message;
    any other message after what is buffered."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()  # the buffers (taken under an engine lock too)
        self._send_lock = threading.Lock()  # one message at a time, in order
        self._events: list[tuple[Any, ...]] = []  # `_event_row`s
        self._calls: list[tuple[str, tuple[Any, ...]]] = []
        self._tokens: dict[str | None, int] = {}
        self._routes: AdapterRoutes | None = None

    def event(self, rid: int, event: SeqEvent) -> None:
        row = _event_row(rid, event)
        with self._lock:
            self._events.append(row)

    def call(self, name: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._calls.append((name, args))

    def tokens(self, adapter: str | None, count: int) -> None:
        with self._lock:
            self._tokens[adapter] = self._tokens.get(adapter, 0) + count

    def routes(self, routes: AdapterRoutes) -> None:
        with self._lock:
            self._routes = routes

    def flush(self) -> None:
        with self._send_lock:
            self._flush()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._flush()
            self._send(message)

    def _flush(self) -> None:
        with self._lock:
            if not (self._events or self._calls or self._tokens or self._routes):
                return
            message = ("out", self._events, self._calls, self._tokens, self._routes)
            self._events, self._calls, self._tokens, self._routes = [], [], {}, None
        self._send(message)

    def _send(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the front end is gone: the reader sees the pipe end
            self._conn.send(message)


class _ForwardingObserver:
    """The engine's observer in the core: every call goes to the front end's metrics with
    the step's message; a residency change sends the adapter routes too."""

    def __init__(self, outbox: _Outbox) -> None:
        self.outbox = outbox
        self.engine: Engine | None = None

    def tokens_generated(self, adapter: str | None, count: int) -> None:
        self.outbox.tokens(adapter, count)

    def residency_changed(self, *args: Any) -> None:
        self.outbox.call("residency_changed", args)
        if self.engine is not None:
            self.outbox.routes(self.engine.routes())

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: self.outbox.call(name, args)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run_core(config: ServeConfig, conn: Connection) -> None:
    """The core process's main: build and warm up the engine, say ready, serve the pipe."""
    from loraplane.worker.server.serve import LOG_FORMAT

    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    # The front end stops the core: a Ctrl-C in a terminal (SIGINT to the whole process
    # group) reaches it through the front end's shutdown; a SIGTERM of its own stops it
    # cleanly (its executor shuts its rank processes down on the way out).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    outbox = _Outbox(conn)
    observer = _ForwardingObserver(outbox)
    faults = FaultInjector(config.dp) if config.enable_fault_injection else None
    try:
        engine = build_engine(config, observer=observer, fault_hook=faults.take if faults else None)
    except BaseException as exc:
        if not isinstance(exc, ConfigError):  # (the front end reports a ConfigError)
            log.exception("the engine core could not start")
        outbox.send(("failed", type(exc).__name__, str(exc)))
        conn.close()
        return
    observer.engine = engine
    engine.on_step = outbox.flush
    engine.start()
    try:
        outbox.routes(engine.routes())
        info = {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.executor.model_config.vocab_size,
        }
        outbox.send(("ready", info))
        _CoreServer(engine, conn, outbox, faults).serve()
    finally:
        engine.stop()
        outbox.flush()
        conn.close()


class _CoreServer:
    """The core's reader: requests, aborts and calls off the pipe, into the engine."""

    def __init__(
        self, engine: Engine, conn: Connection, outbox: _Outbox, faults: FaultInjector | None
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.outbox = outbox
        self.faults = faults
        self.live: dict[int, Sequence] = {}

    def serve(self) -> None:
        while True:
            if not self.conn.poll(0.5):
                if not self.engine.alive:
                    break
                continue
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.info("the front end closed the pipe: stopping the engine core")
                return
            kind = message[0]
            if kind == "stop":
                return
            if kind == "submit":
                self._submit(*message[1:])
            elif kind == "abort":
                seq = self.live.get(message[1])
                if seq is not None:
                    self.engine.abort(seq)
            elif kind == "call":
                self._call(*message[1:])
        why = f"engine failed: {self.engine.error}"
        self.outbox.send(("dead", why))

    def _submit(
        self,
        rid: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
    ) -> None:
        def sink(event: SeqEvent) -> None:
            if event.finished:
                self.live.pop(rid, None)
            self.outbox.event(rid, event)

        try:
            seq = self.engine.submit(request_id, prompt_ids, params, adapter, sink)
        except UnknownAdapterError as exc:  # unloaded since the front end resolved it
            self.outbox.event(rid, SeqEvent("", (), True, "abort", error=str(exc)))
            self.outbox.flush()
            return
        self.live[rid] = seq
        if seq.finish_reason is not None:
            self.live.pop(rid, None)

    def _call(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        def reply(ok: bool, value: Any) -> None:
            self.outbox.send(("reply", call_id, ok, value))

        def done(future: Future[Any]) -> None:
            exc = future.exception()
            if exc is None:
                reply(True, future.result())
            else:
                reply(False, (type(exc).__name__, str(exc)))

        try:
            if method == "load":
                self.engine.load_adapter(*args).add_done_callback(done)
            elif method == "unload":
                self.engine.unload_adapter(*args).add_done_callback(done)
            elif method == "lora_state":
                reply(True, self.engine.lora_state())
            elif method == "arm_fault" and self.faults is not None:
                self.faults.arm(*args)
                reply(True, self.faults.snapshot())
            elif method == "fault_snapshot" and self.faults is not None:
                reply(True, self.faults.snapshot())
            else:
                reply(False, ("ValueError", f"the engine core has no call {method!r}"))
        except Exception as exc:
            reply(False, (type(exc).__name__, str(exc)))


# --- the front end's client ----------------------------------------------------------------


class ProcessEngineClient:
    """The engine core in a child process: started, warmed up and ready when this returns
    (ConfigError, or the core's own error, if it could not start)."""

    def __init__(self, config: ServeConfig, *, observer: EngineObserver | None = None) -> None:
        self.dp_size = config.dp
        self._observer: Any = observer or _NullObserver()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[int, Sink] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._error: str | None = None
        self._stopping = False
        self._routes = AdapterRoutes({}, frozenset(), frozenset(), ())
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=run_core, args=(config, child), name="loraplane-engine-core"
        )
        self._process.start()
        child.close()  # (so that the core's end closes when the core exits)
        try:
            info = self._await_ready()
        except BaseException:
            self.stop()
            raise
        self.tokenizer = TextTokenizer(config.model)  # (the core has read the model dir)
        self._max_model_len: int = info["max_model_len"]
        self._vocab_size: int = info["vocab_size"]
        self._reader = threading.Thread(
            target=self._read, name="loraplane-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _await_ready(self) -> dict[str, Any]:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(timeout=10)
                raise RuntimeError(
                    f"the engine core process exited with code {self._process.exitcode} "
                    "before it was ready (its log says why)"
                ) from None
            if message[0] == "ready":
                return dict(message[1])
            if message[0] == "failed":
                raise _error(message[1], message[2])
            self._take(message)

    # --- the reader ------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "dead":
                self._error = message[1]
            else:
                self._take(message)
        if not self._stopping:
            self._process.join(timeout=10)
            code = self._process.exitcode
            self._error = self._error or f"the engine core process exited with code {code}"
            log.error("engine core gone: %s", self._error)
        self._fail_all(self._error or "the engine is not running")

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            _, events, calls, tokens, routes = message
            if routes is not None:
                self._routes = routes
            for name, args in calls:
                getattr(self._observer, name)(*args)
            for adapter, count in tokens.items():
                self._observer.tokens_generated(adapter, count)
            for row in events:
                rid, finished = row[0], row[2]
                with self._lock:
                    sink = (self._requests.pop if finished else self._requests.get)(rid, None)
                if sink is not None:
                    self._deliver(sink, _event(row))
        elif kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None:
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(_error(*value))

    @staticmethod
    def _deliver(sink: Sink, event: SeqEvent) -> None:
        try:
            sink(event)
        except Exception:  # one request's failure must not stop the others' events
            log.exception("a request's sink failed")

    def _fail_all(self, why: str) -> None:
        with self._lock:
            requests, self._requests = self._requests, {}
            calls, self._calls = self._calls, {}
        for sink in requests.values():
            self._deliver(sink, SeqEvent("", (), True, "abort", error=f"engine failed: {why}"))
        for future in calls.values():
            future.set_exception(RuntimeError(f"the engine is not running: {why}"))

    def _send(self, message: tuple[Any, ...]) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError):  # closed: the reader reports why
            return False

    # --- EngineClient ----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def alive(self) -> bool:
        return self._error is None and not self._stopping  # (the reader sees the core end)

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def group_adapters(self) -> list[dict[str, str]]:
        return [dict(g) for g in self._routes.group_adapters]

    def resolve_adapter(self, name: str) -> str:
        return self._routes.resolve(name)

    def listed_adapters(self) -> list[dict[str, Any]]:
        return self._routes.listed()

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: Sink,
    ) -> object:
        if adapter is not None:
            self.resolve_adapter(adapter)
        rid = next(self._ids)

        def on_stop() -> None:  # a stop string ended it: the core's later tokens are dropped
            with self._lock:
                self._requests.pop(rid, None)
            self._send(("abort", rid))

        with self._lock:
            self._requests[rid] = text_sink(self.tokenizer, params, sink, on_stop)
        if not self._send(("submit", rid, request_id, prompt_ids, params, adapter)):
            with self._lock:
                self._requests.pop(rid, None)
            raise RuntimeError(f"the engine is not running: {self._error}")
        return rid

    def abort(self, handle: object) -> None:
        self._send(("abort", handle))

    def call(self, method: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        call_id = next(self._ids)
        with self._lock:
            self._calls[call_id] = future
        if not self._send(("call", call_id, method, args)):
            with self._lock:
                self._calls.pop(call_id, None)
            future.set_exception(RuntimeError(f"the engine is not running: {self._error}"))
        return future

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> Future[LoRAUpdateResult]:
        return self.call("load", name, path, pinned)

    def unload_adapter(self, name: str) -> Future[LoRAUpdateResult]:
        return self.call("unload", name)

    def lora_state(self) -> dict[str, Any]:
        return dict(self.call("lora_state").result(timeout=60))

    def stop(self) -> None:
        """Stop the core (its engine shuts its executor and rank processes down) and wait
        for it; a core that does not exit in time is terminated, then killed."""
        self._stopping = True
        self._send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            log.warning("the engine core did not stop in 30 s: terminating it")
            self._process.terminate()
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()


class CoreFaults:
    """`--enable-fault-injection` with the engine in the core: the injector lives there and
    this arms it (for POST /debug/fault)."""

    def __init__(self, client: ProcessEngineClient) -> None:
        self.client = client

    def arm(self, op: str, dp_group: int, count: int, message: str) -> None:
        self.client.call("arm_fault", op, dp_group, count, message).result(timeout=30)

    def snapshot(self) -> dict[str, dict[str, object]]:
        return dict(self.client.call("fault_snapshot").result(timeout=30))
