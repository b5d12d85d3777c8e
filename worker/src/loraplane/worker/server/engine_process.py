"""The front end's client of the engine core's process (ADR 0012; the core: `engine_core`).

The front end (uvicorn, FastAPI, tokenizing, detokenizing) starts the core with the spawn
context (CUDA needs it) and talks to it over one duplex pipe of pickled tuples:

    front end -> core   ("submit", rid, request_id, prompt_ids, params, adapter)
                        ("abort", rid)
                        ("call", call_id, method, args)   load, unload, lora_state, faults
                        ("stop",)
    core -> front end   ("out", events, observer_calls, tokens, routes)   once per step
                        ("reply", call_id, ok, value)
                        ("ready", info) | ("failed", kind, message) | ("dead", message)

The core runs the `Engine` (executor, warm-up, adapter thread; a multi-rank executor's
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

import itertools
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from loraplane.worker.config import ConfigError
from loraplane.worker.engine.engine import (
    AdapterRoutes,
    EngineObserver,
    UnknownAdapterError,
    _NullObserver,
)
from loraplane.worker.engine.merge import LoRAUpdateResult
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.server.engine_client import Sink, text_sink
from loraplane.worker.server.engine_core import event_from_row, run_core
from loraplane.worker.server.factory import ServeConfig

log = logging.getLogger("loraplane.worker.engine_client")

_ERRORS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError,
    "AdapterError": ValueError,  # (AdapterError's constructor takes more than a message)
    "ValueError": ValueError,
}


def _error(kind: str, message: str) -> Exception:
    return _ERRORS.get(kind, RuntimeError)(message)


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
        self._unloading: dict[str, int] = {}  # adapter name -> unloads not answered yet
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
        self._kv_pool_tokens: int = info["kv_pool_tokens"]
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
                    self._deliver(sink, event_from_row(row))
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
    def kv_pool_tokens(self) -> int:
        return self._kv_pool_tokens

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
        if name in self._unloading:
            raise UnknownAdapterError(f"adapter {name!r} is being unloaded from this worker")
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

    def load_adapter(
        self, name: str, path: str, pinned: bool = False, evict: Sequence[str] = ()
    ) -> Future[LoRAUpdateResult]:
        """Load ``name``; the adapters it may evict are refused as ``unload_adapter``'s is
        until the core answers (whether or not the load evicted them)."""
        victims = tuple(evict)
        return self._refusing(victims, lambda: self.call("load", name, path, pinned, victims))

    def unload_adapter(self, name: str) -> Future[LoRAUpdateResult]:
        """Unload ``name``; new requests for it are refused (404) from now until the core
        answers, with the routes as they are then. A request routed before is in the pipe
        ahead of the unload, so the core admits it first (it keeps its adapter version to
        its end): no request reaches the core for an adapter it no longer holds."""
        return self._refusing((name,), lambda: self.call("unload", name))

    def _refusing(self, names: tuple[str, ...], call: Callable[[], Future[Any]]) -> Future[Any]:
        """Requests for ``names`` refused from now until ``call()`` (to the core) is done."""
        with self._lock:
            for name in names:
                self._unloading[name] = self._unloading.get(name, 0) + 1
        future = call()

        def answered(_future: Future[Any]) -> None:
            with self._lock:
                for name in names:
                    self._unloading[name] -= 1
                    if not self._unloading[name]:
                        del self._unloading[name]

        future.add_done_callback(answered)
        return future

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
