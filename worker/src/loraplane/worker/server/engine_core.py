"""The engine core's process (ADR 0012): `run_core` is its main, started by
`engine_process.ProcessEngineClient` with the spawn context.

It builds and warms up the `Engine` (executor, adapter thread; a multi-rank executor's
rank processes are the core's children), says "ready", and serves the pipe (the message
forms are in `engine_process`'s docstring): its main thread reads requests, aborts and calls
into the engine; the engine's thread sends, after each step, ONE message with every
sequence's new token ids and end, the step's observer calls (the front end's metrics replay
them) and the adapter routes if they changed. A reply goes after everything buffered before
it. The core stops at "stop", at the end of the pipe (its front end is gone), on SIGTERM,
or when its engine dies (after saying "dead" and why).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from loraplane.worker.config import ConfigError
from loraplane.worker.engine.engine import AdapterRoutes, Engine, UnknownAdapterError
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import UNKNOWN_ADAPTER, SeqEvent, Sequence
from loraplane.worker.server.factory import ServeConfig, build_engine
from loraplane.worker.server.faults import FaultInjector

log = logging.getLogger("loraplane.worker.engine_core")


# Events cross the pipe as plain tuples: pickling a step's 64 SeqEvent dataclasses took
# ~16x as long as their tuples, on the engine's thread.
# (Log probabilities, when a request asks for them, go as `TokenLogprob`s: named tuples.)
def _event_row(rid: int, e: SeqEvent) -> tuple[Any, ...]:
    return (rid, e.token_ids, e.finished, e.finish_reason, e.matched_stop,
            e.prompt_tokens, e.completion_tokens, e.error, e.error_kind, e.logprobs,
            e.prompt_logprobs)  # fmt: skip


def event_from_row(row: tuple[Any, ...]) -> SeqEvent:
    (_rid, ids, finished, reason, matched, prompt_tokens, completion_tokens, error, error_kind,
     logprobs, prompt_logprobs) = row  # fmt: skip
    return SeqEvent(
        "", ids, finished, reason, matched, prompt_tokens, completion_tokens, error,
        error_kind, logprobs, prompt_logprobs,
    )  # fmt: skip


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
            "kv_pool_tokens": engine.kv_pool_tokens,
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
            ended = SeqEvent("", (), True, "abort", error=str(exc), error_kind=UNKNOWN_ADAPTER)
            self.outbox.event(rid, ended)
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
                # (its answer brings the routes as they are then: the front end refuses the
                # adapter's requests until it has them)
                def unloaded(future: Future[Any]) -> None:
                    self.outbox.routes(self.engine.routes())
                    done(future)

                self.engine.unload_adapter(*args).add_done_callback(unloaded)
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
