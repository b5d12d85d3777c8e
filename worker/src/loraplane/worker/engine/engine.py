"""The serving engine: one background thread that owns the executor.

Between two forward passes the thread runs adapter commands (load, unload), admits waiting
requests (scheduler + residency), fills slots, and then runs one step over every running
sequence of every DP group: a new sequence's whole prompt (prefill) or its last token
(decode). Slot copies therefore never overlap a forward, and a request keeps the adapter
version it was admitted with until it finishes.

Other threads (an `EngineClient`: the engine-core process's reader, or the HTTP server's
event loop) only call `submit`, `abort`, `load_adapter`, `unload_adapter` and the read-only
views; shared bookkeeping is guarded by one lock. The engine deals in token ids only: text,
and the stop strings matched on it, are the front end's (`engine.detokenizer`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Container, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from loraplane.worker.engine.executor import (
    Executor,
    ExecutorFailed,
    LaunchedStep,
    PromptLogprobs,
    SeqWork,
)
from loraplane.worker.engine.logprobs import TokenLogprob
from loraplane.worker.engine.merge import LoRAUpdateResult, merge_lora_update_results
from loraplane.worker.engine.pages import PagePool
from loraplane.worker.engine.residency import Residency, ResidencyError
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.scheduler import Admission, Scheduler
from loraplane.worker.engine.sequence import SeqEvent, Sequence
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError

log = logging.getLogger("loraplane.worker.engine")


class RequestTooLongError(ValueError):
    """A request that could never run: its KV positions exceed a DP group's whole pool."""


class UnknownAdapterError(LookupError):
    pass


class EngineObserver(Protocol):
    """Hooks the server's metrics implement; the engine knows nothing of Prometheus."""

    def request_started(self, adapter: str | None, prompt_tokens: int) -> None: ...
    def tokens_generated(self, adapter: str | None, count: int) -> None: ...
    def step(
        self,
        distinct_adapters: int,
        running_per_group: list[int],
        waiting: int,
        waiting_for_slot: int,
    ) -> None: ...
    def request_admitted(self, queue_seconds: float) -> None:
        """A request joined the running batch ``queue_seconds`` after the engine got it."""
        ...

    def first_token(self, seconds: float) -> None:
        """A request's first token reached its consumer ``seconds`` after the engine got it."""
        ...

    def loop_iteration(self, kind: str, seconds: float) -> None:
        """One pass of the engine loop that launched a step (``kind``: "mixed" when the step
        feeds prompt tokens, else "decode"): its preparation, launch and the read of the
        step it waited for (with overlapped steps the one launched before, ADR 0014)."""
        ...

    def idle(self) -> None: ...
    def evicted(self, adapter: str) -> None: ...
    def slot_loaded(self, adapter: str) -> None: ...
    def adapter_loaded(self, adapter: str) -> None: ...
    def adapter_unloaded(self, adapter: str) -> None: ...
    def prefix_lookup(self, adapter: str | None, cached_tokens: int, prompt_tokens: int) -> None:
        """A request was admitted with ``cached_tokens`` of its prompt from the prefix cache."""
        ...

    def kv_pool(self, dp_group: int, used: int, cached: int, total: int) -> None:
        """A DP group's KV pages: held by requests, cached prefixes held by none, all."""
        ...

    def residency_changed(
        self, slots_used: int, loaded: int, pinned: int, inconsistent: int
    ) -> None: ...
    def adapter_op(self, op: str, seconds: float, success: bool) -> None: ...
    def warmed_up(self, seconds: float) -> None: ...


def _run_command(fn: Callable[[], Any], future: Future[Any]) -> None:
    """``fn()`` into ``future`` (unless it was cancelled); its failure goes there too."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:
            log.exception("adapter command failed")
            future.set_exception(exc)


def resolve_key(name: str, key: str | None, inconsistent: bool, loaded: Iterable[str]) -> str:
    """`key` (the version new requests for adapter `name` get), or why `name` is not routable."""
    if inconsistent:
        raise UnknownAdapterError(
            f"adapter {name!r} is inconsistent after a partially failed unload and is not routable; "
            "retry POST /unload_lora_adapter"
        )
    if key is None:
        raise UnknownAdapterError(
            f"adapter {name!r} is not loaded on this worker; loaded: {sorted(loaded)}"
        )
    return key


@dataclass(frozen=True, slots=True)
class AdapterRoutes:
    """What a front end needs to route requests and list adapters, as of one moment."""

    keys: dict[str, str]  # adapter name -> the key (version) new requests get
    inconsistent: frozenset[str]
    pinned: frozenset[str]
    group_adapters: tuple[dict[str, str], ...]  # per DP group: name -> path

    def resolve(self, name: str) -> str:
        return resolve_key(name, self.keys.get(name), name in self.inconsistent, self.keys)

    def listed(self) -> list[dict[str, Any]]:
        """Every name some DP group holds: name, path, pinned, inconsistent."""
        names: dict[str, str] = {}
        for g in self.group_adapters:
            for n, p in g.items():
                names.setdefault(n, p)
        return [
            {
                "name": n,
                "path": p,
                "pinned": n in self.pinned,
                "inconsistent": n in self.inconsistent,
            }
            for n, p in sorted(names.items())
        ]


class _NullObserver:
    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


FaultHook = Callable[[str, int], "str | None"]  # (op, dp_group) -> failure message or None


@dataclass(frozen=True, slots=True)
class EventRecord:
    kind: str  # "evict"
    adapter: str
    at: float


def _fingerprint(path: str) -> tuple[Any, ...]:
    parts: list[Any] = []
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        try:
            st = (Path(path) / name).stat()
            parts.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append((name, None))
    return tuple(parts)


class _Launches(Protocol):
    """An executor whose ``supports_launch`` is true (``Executor.supports_launch``)."""

    def launch(self, work: list[list[SeqWork]], after: Any) -> LaunchedStep: ...


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer: TextTokenizer,
        *,
        max_loras_per_batch: int,
        max_loaded_loras: int,
        max_running: int,
        max_model_len: int,
        observer: EngineObserver | None = None,
        fault_hook: FaultHook | None = None,
        on_step: Callable[[], None] | None = None,
        overlap: bool = False,
        chunked_prefill_size: int = 0,
        step_tokens: int = 0,
    ) -> None:
        self.executor = executor
        # Prompt tokens fed per step at most (0: whole prompts), across the sequences being
        # prefilled; decoding sequences step regardless (ADR 0017).
        if chunked_prefill_size < 0:
            raise ValueError(
                f"chunked_prefill_size {chunked_prefill_size} must be >= 0 (0 turns chunking off)"
            )
        self.chunked_prefill_size = chunked_prefill_size
        # A step's tokens (its decode rows and prompt chunks) at most, so that it fits the
        # largest prompt-step graph (0: no such cap); the prompt chunks still get at least
        # half of it however many rows decode (ADR 0017, "the budget follows the graphs").
        if step_tokens < 0:
            raise ValueError(f"step_tokens {step_tokens} must be >= 0 (0: no cap)")
        self.step_tokens = step_tokens
        # Overlapped steps (ADR 0014), where the executor can launch a step ahead of reading
        # the last one's tokens (one rank or several); the others step in turn.
        self.overlap = overlap and bool(getattr(executor, "supports_launch", False))
        if overlap and not self.overlap:
            log.info("this executor cannot launch steps ahead; this engine steps in turn")
        # the launched step whose tokens are not read yet: its handle, its sequences and
        # whether each one's token is real (False: a prompt chunk that does not end the prompt)
        # (every DP group's sequences, group after group, as ``LaunchedStep.tokens`` reads)
        self._inflight: tuple[LaunchedStep, list[Sequence], list[bool]] | None = None
        # finished sequences whose KV row and adapter are released once the step in flight,
        # which still runs them, is resolved
        self._parked: list[Sequence] = []
        self.tokenizer = tokenizer
        self.dp_size = executor.dp_size
        self.max_model_len = min(max_model_len, executor.max_len)
        self.residency = Residency(max_loras_per_batch, max_loaded_loras)
        # one pool of KV pages per DP group (each group's ranks hold their own cache)
        self.pools = [PagePool(executor.kv_pages, executor.page_size) for _ in range(self.dp_size)]
        self.scheduler = Scheduler(
            self.dp_size, executor.max_seqs, max_running, self.residency, self.pools
        )
        # per adapter name (None: the base model): [requests with a prefix hit, without,
        # prompt tokens from the cache, prompt tokens]
        self.prefix_stats: dict[str | None, list[int]] = {}
        self._kv_reported: list[tuple[int, int, int]] = []
        self.observer: Any = observer or _NullObserver()
        self.fault_hook = fault_hook
        # called on the engine's thread after each round of commands and a step (outside the
        # lock): the engine-core process sends what the step's sinks and observer got then
        self.on_step = on_step
        # per DP group: adapter name -> path, as that group holds them
        self.group_adapters: list[dict[str, str]] = [{} for _ in range(self.dp_size)]
        self.inconsistent: set[str] = set()
        self.versions: dict[str, int] = {}
        self.fingerprints: dict[str, tuple[Any, ...]] = {}
        self.evictions: list[EventRecord] = []
        self.steps = 0
        # Slots whose load may still be copying (engine thread only): their requests sit out
        # the steps until the executor says the copy is done (ADR 0011).
        self._loading: set[int] = set()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Sequence] = []
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="loraplane-engine", daemon=True)
        # Adapter commands, in order, on a thread of their own when the executor reads adapter
        # files beside its steps: the read (seconds for a large adapter) then holds no step.
        self._adapter_queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._adapter_thread = (
            threading.Thread(target=self._adapter_loop, name="loraplane-adapters", daemon=True)
            if getattr(executor, "reads_adapters_concurrently", False)
            else None
        )
        self.error: BaseException | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self._adapter_thread is not None:
            self._adapter_thread.start()

    def stop(self, *, shutdown_executor: bool = True) -> None:
        """Stop the threads; then shut the executor down unless it is to serve another
        engine (``shutdown_executor=False``, as the probes do)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=10)
        if self._adapter_thread is not None:
            self._adapter_queue.put(None)
        if shutdown_executor:  # (before the join: a read in flight then ends at once)
            self.executor.shutdown()
        if self._adapter_thread is not None:
            self._adapter_thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # --- requests ------------------------------------------------------------------------

    def resolve_adapter(self, name: str) -> str:
        """The key of the version new requests for `name` get; UnknownAdapterError otherwise."""
        with self._lock:
            adapter = self.residency.current(name)
            return resolve_key(
                name,
                adapter.key if adapter is not None else None,
                name in self.inconsistent,
                self.residency.loaded_names,
            )

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: Callable[[SeqEvent], None],
    ) -> Sequence:
        kv_tokens = self.kv_tokens(len(prompt_ids), params.max_new_tokens)
        if not self.pools[0].fits(kv_tokens):
            raise RequestTooLongError(
                f"the request needs {kv_tokens} KV positions (a {len(prompt_ids)}-token prompt "
                f"and max_tokens {params.max_new_tokens}, within max_model_len "
                f"{self.max_model_len}); this worker's KV pool holds {self.kv_pool_tokens}"
            )
        with self._wake:
            key = self.resolve_adapter(adapter) if adapter is not None else None
            seq = Sequence(request_id, prompt_ids, params, adapter, key, sink)
            seq.kv_tokens = kv_tokens
            if key is not None:
                self.residency.hold(key)
            self._incoming.append(seq)
            self._wake.notify_all()
        self.observer.request_started(adapter, len(prompt_ids))
        return seq

    def kv_tokens(self, prompt: int, max_new_tokens: int) -> int:
        """KV positions a request reserves: its prompt and new tokens, cut at max_model_len."""
        return min(prompt + max_new_tokens, self.max_model_len)

    @property
    def kv_pool_tokens(self) -> int:
        """KV positions of one DP group's pool."""
        return self.pools[0].num_pages * self.pools[0].page_size

    def abort(self, seq: Sequence) -> None:
        with self._wake:
            seq.aborted = True
            self._wake.notify_all()

    # --- adapter commands ----------------------------------------------------------------

    def _command(self, fn: Callable[[], Any]) -> Future[Any]:
        """``fn`` on the engine's thread, between steps."""
        return self._enqueue(fn, self._commands.append)

    def _adapter_command(self, fn: Callable[[], Any]) -> Future[Any]:
        """``fn`` after every earlier adapter command: on the adapter thread if there is one
        (its engine state changes go to the engine's thread through ``_on_engine``), else
        on the engine's thread between steps."""
        if self._adapter_thread is None:
            return self._command(fn)
        return self._enqueue(fn, self._adapter_queue.put)

    def _enqueue(
        self, fn: Callable[[], Any], put: Callable[[tuple[Callable[[], Any], Future[Any]]], None]
    ) -> Future[Any]:
        future: Future[Any] = Future()
        with self._wake:
            if self._stop or not self._thread.is_alive():
                future.set_exception(RuntimeError("the engine is not running"))
                return future
            put((fn, future))
            self._wake.notify_all()
        return future

    def _adapter_loop(self) -> None:
        while (item := self._adapter_queue.get()) is not None:
            if self._stop:  # stopping: no more reads (the futures say why)
                item[1].set_exception(RuntimeError("the engine is not running"))
            else:
                _run_command(*item)
        while not self._adapter_queue.empty():  # stopped: what is left will not run
            if (left := self._adapter_queue.get()) is not None:
                left[1].set_exception(RuntimeError("the engine is not running"))

    def _on_engine(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine's thread, between steps (the executor's slots and host
        copies change only there), waiting for it."""
        if threading.current_thread() is self._thread:
            return fn()
        return self._command(fn).result()

    def load_adapter(
        self, name: str, path: str, pinned: bool = False, evict: Seq[str] = ()
    ) -> Future[LoRAUpdateResult]:
        """Load ``name`` from ``path`` on every DP group. ``evict`` names adapters to unload
        to make room, once the new one has been read on every group: a load that fails
        leaves them loaded."""
        victims = tuple(evict)
        return self._adapter_command(lambda: self._load(name, path, pinned, victims))

    def unload_adapter(self, name: str) -> Future[LoRAUpdateResult]:
        return self._adapter_command(lambda: self._on_engine(lambda: self._unload(name)))

    def _fault(self, op: str, group: int) -> str | None:
        return self.fault_hook(op, group) if self.fault_hook else None

    def _results(self, errors: Seq[str | None]) -> list[LoRAUpdateResult]:
        return [
            LoRAUpdateResult(
                success=err is None,
                error_message=err or "",
                loaded_adapters=dict(self.group_adapters[g]),
            )
            for g, err in enumerate(errors)
        ]

    def _load(
        self, name: str, path: str, pinned: bool, evict: tuple[str, ...] = ()
    ) -> LoRAUpdateResult:
        """Check, read on every group (on the adapter thread if there is one: the engine keeps
        stepping), then commit (evicting ``evict`` first) or roll back on the engine's
        thread."""
        t0 = time.perf_counter()
        try:
            path = str(Path(path).resolve())
        except (OSError, ValueError, RuntimeError) as exc:  # (a NUL byte, a symlink loop)
            return self._failed(f"lora_path: {path[:200]!r} is not a usable path ({exc})")
        fingerprint = _fingerprint(path)  # (a stat; not under the lock the steps take)
        with self._lock:
            if name in self.inconsistent:
                return self._failed(
                    f"lora_name: adapter {name!r} is inconsistent after a partially failed unload; "
                    "retry POST /unload_lora_adapter before loading it again"
                )
            current = self.residency.current(name)
            if (
                current is not None
                and current.path == path
                and self.fingerprints.get(current.key) == fingerprint
            ):
                # already loaded from these files: only the pin changes, and the victims the
                # caller named (a retried load with evictions) still go
                try:
                    victims = self._victims(name, evict)
                    self.residency.set_pinned(name, pinned)
                except ResidencyError as exc:
                    return self._failed(str(exc))
                self._publish_residency()
                if not victims:
                    return merge_lora_update_results(self._results([None] * self.dp_size))
                unchanged = True
            else:
                unchanged = False
                try:
                    victims = self._victims(name, evict)
                    freeing = sum(self.residency.current(v) is not None for v in victims)
                    self.residency.check_add(name, pinned, freeing)
                except ResidencyError as exc:
                    return self._failed(str(exc))
                version = self.versions.get(name, 0) + 1
                key = name if version == 1 else f"{name}@v{version}"
        if unchanged:
            return cast(LoRAUpdateResult, self._on_engine(lambda: self._evict_for(name, victims)))
        errors: list[str | None] = []
        for group in range(self.dp_size):
            fault = self._fault("load", group)
            if fault is not None:
                errors.append(fault)
                continue
            try:
                self.executor.read_adapter(group, key, path)
                errors.append(None)
            except AdapterError as exc:
                errors.append(str(exc))
            except ExecutorFailed as exc:  # not the adapter's fault: the worker is broken
                self.error = exc
                log.error("the executor failed while reading adapter %s: %s", name, exc)
                raise
            except Exception as exc:  # a bad file must not cost a 500: answer it, roll back
                log.exception("reading adapter %s from %s on dp group %d failed", name, path, group)
                errors.append(f"adapter {name!r}: lora_path: {path} cannot be read ({exc!r})")
        if all(e is None for e in errors) and _fingerprint(path) != fingerprint:
            # rewritten in place while the groups read it: they may hold different weights
            changed = f"lora_path: {path} changed while adapter {name!r} was read; load it again"
            errors = [changed] * self.dp_size
        return cast(
            LoRAUpdateResult,
            self._on_engine(lambda: self._commit_load(name, path, pinned, key, version,
                                                      fingerprint, errors, t0, victims)),
        )  # fmt: skip

    def _commit_load(
        self,
        name: str,
        path: str,
        pinned: bool,
        key: str,
        version: int,
        fingerprint: tuple[Any, ...],
        errors: list[str | None],
        t0: float,
        victims: tuple[str, ...] = (),
    ) -> LoRAUpdateResult:
        """The end of ``_load`` (engine thread): the adapter on every group, or on none; its
        victims unloaded only once it has been read everywhere."""
        with self._lock:
            if all(e is None for e in errors):
                for victim in victims:
                    evicted = self._unload(victim)
                    if not evicted.success:
                        errors = [f"evict: unloading {victim!r} to make room failed: "
                                  f"{evicted.error_message}"] * self.dp_size  # fmt: skip
                        break
                    log.info("evicted adapter %s to make room for %s", victim, name)
            if any(e is not None for e in errors):
                # roll back wherever it was read: the adapter is on every group or on none
                self.executor.drop_adapter(key)
                merged = merge_lora_update_results(self._results(errors))
                self.observer.adapter_op("load", time.perf_counter() - t0, False)
                log.warning(
                    "load %s from %s failed: %s", name, path, merged.error_message or "(no message)"
                )
                return merged
            self.versions[name] = version
            self.fingerprints[key] = fingerprint
            removable = self.residency.add(key, name, path, version, pinned=pinned)
            for old in removable:
                self._remove(old)
            for group in range(self.dp_size):
                self.group_adapters[group][name] = path
            self._publish_residency()
            self.observer.adapter_op("load", time.perf_counter() - t0, True)
            self.observer.adapter_loaded(name)
            log.info(
                "loaded adapter %s (version %d%s) from %s",
                name,
                version,
                ", pinned" if pinned else "",
                path,
            )
            return merge_lora_update_results(self._results([None] * self.dp_size))

    def _evict_for(self, name: str, victims: tuple[str, ...]) -> LoRAUpdateResult:
        """Unload ``victims`` for ``name``, which is loaded already (engine thread): the first
        that fails stops the rest and is the answer."""
        for victim in victims:
            evicted = self._unload(victim)
            if not evicted.success:
                return self._failed(
                    f"evict: unloading {victim!r} to make room failed: {evicted.error_message}"
                )
            log.info("evicted adapter %s to make room for %s", victim, name)
        with self._lock:
            return merge_lora_update_results(self._results([None] * self.dp_size))

    def _victims(self, name: str, evict: tuple[str, ...]) -> tuple[str, ...]:
        """The adapters of ``evict`` to unload for ``name``'s room: those loaded (or left
        inconsistent); one not loaded is gone already. Raises ResidencyError for a pinned
        one or ``name`` itself."""
        victims: list[str] = []
        for victim in dict.fromkeys(evict):
            adapter = self.residency.current(victim)
            if victim == name:
                raise ResidencyError(f"evict: {name!r} is the adapter being loaded")
            if adapter is not None and adapter.pinned:
                raise ResidencyError(
                    f"evict: adapter {victim!r} is pinned and pinned adapters are never "
                    "evicted; unpin it first"
                )
            if adapter is not None or victim in self.inconsistent:
                victims.append(victim)
        return tuple(victims)

    def _unload(self, name: str) -> LoRAUpdateResult:
        t0 = time.perf_counter()
        with self._lock:
            holders = [name in g for g in self.group_adapters]
            if not any(holders) and name not in self.inconsistent:
                return self._failed(
                    f"lora_name: adapter {name!r} is not loaded; loaded: {sorted(self.residency.loaded_names)}"
                )
            errors: list[str | None] = []
            for group in range(self.dp_size):
                fault = self._fault("unload", group)
                if fault is not None:
                    errors.append(fault)
                elif holders[group]:
                    del self.group_adapters[group][name]
                    errors.append(None)
                elif name in self.inconsistent:
                    errors.append(
                        None
                    )  # already unloaded there by an earlier, partially failed unload
                else:
                    errors.append(f"adapter {name!r} is not loaded on dp group {group}")
            current = self.residency.current(name)
            if current is not None:
                # not routable from now on; running requests keep their version until they finish
                for key in self.residency.retire(current.key):
                    self._remove(key)
            ok = all(e is None for e in errors)
            if ok:
                self.inconsistent.discard(name)
            else:
                self.inconsistent.add(name)
            self._publish_residency()
            self.observer.adapter_op("unload", time.perf_counter() - t0, ok)
            merged = merge_lora_update_results(self._results(errors))
            if ok:
                self.observer.adapter_unloaded(name)
                log.info("unloaded adapter %s", name)
            else:
                log.warning(
                    "unload %s failed on some dp group, marked inconsistent: %s",
                    name,
                    merged.error_message,
                )
            return merged

    def _failed(self, message: str) -> LoRAUpdateResult:
        return LoRAUpdateResult(False, message, dict(self.group_adapters[0]))

    def _remove(self, key: str) -> None:
        """Forget a version nobody holds: free its slot and its host copies (engine thread)."""
        slot = self.residency.remove(key)
        if slot is not None:
            self.executor.clear_slot(slot)
        self.executor.drop_adapter(key)
        self.fingerprints.pop(key, None)
        self._publish_residency()

    def _publish_residency(self) -> None:
        r = self.residency
        self.observer.residency_changed(
            r.slots_used, len(r.loaded_names), len(r.pinned_names), len(self.inconsistent)
        )

    # --- views ---------------------------------------------------------------------------

    def lora_state(self) -> dict[str, Any]:
        with self._lock:
            r = self.residency
            adapters = []
            for a in sorted(r.adapters.values(), key=lambda a: a.key):
                adapters.append(
                    {
                        "name": a.name,
                        "key": a.key,
                        "version": a.version,
                        "path": a.path,
                        "pinned": a.pinned,
                        "slot": a.slot,
                        "retired": a.retired,
                        "running": a.running,
                        "last_used": a.last_used,
                    }
                )
            return {
                "max_loras_per_batch": r.num_slots,
                "max_loaded_loras": r.max_loaded,
                "loaded": len(r.loaded_names),
                "pinned": r.pinned_names,
                "inconsistent": sorted(self.inconsistent),
                "slots": list(r.slots),
                "lru_order": r.lru_order(),
                "dp_groups": [
                    {
                        "dp_group": g,
                        "adapters": sorted(self.group_adapters[g]),
                        "slots_used": r.slots_used,
                        "slots_total": r.num_slots,
                        "running": sum(1 for s in self.scheduler.running if s.dp_group == g),
                        "kv_pages_used": self.pools[g].used,
                        "kv_pages_cached": self.pools[g].cached,
                        "kv_pages_total": self.pools[g].num_pages,
                    }
                    for g in range(self.dp_size)
                ],
                "adapters": adapters,
                "evictions": [{"adapter": e.adapter, "at": e.at} for e in self.evictions[-256:]],
                "prefix_cache": [
                    {
                        "adapter": name,
                        "hits": s[0],
                        "misses": s[1],
                        "cached_tokens": s[2],
                        "prompt_tokens": s[3],
                    }
                    for name, s in sorted(self.prefix_stats.items(), key=lambda i: i[0] or "")
                ],
                "waiting": len(self.scheduler.waiting) + len(self._incoming),
                "running": len(self.scheduler.running),
            }

    def routes(self) -> AdapterRoutes:
        with self._lock:
            r = self.residency
            return AdapterRoutes(
                keys={a.name: a.key for a in r.adapters.values() if not a.retired},
                inconsistent=frozenset(self.inconsistent),
                pinned=frozenset(r.pinned_names),
                group_adapters=tuple(dict(g) for g in self.group_adapters),
            )

    def listed_adapters(self) -> list[dict[str, Any]]:
        """Every name some DP group holds: name, path, pinned, inconsistent."""
        return self.routes().listed()

    # --- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (
                        self._stop
                        or self._commands
                        or self._incoming
                        or self.scheduler.running
                        or self.scheduler.waiting
                        or self._inflight is not None
                    ):
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        break
                    commands, self._commands = self._commands, []
                for fn, future in commands:
                    _run_command(fn, future)
                started = time.perf_counter()
                kind = self._step_overlapped() if self.overlap else self._step()
                if kind is not None:
                    self.observer.loop_iteration(kind, time.perf_counter() - started)
                with self._lock:
                    self._report_kv()
                if self.on_step is not None:
                    self.on_step()
        except BaseException as exc:
            self.error = exc
            log.exception("engine loop died")
            with self._lock:
                everyone = cast(
                    list[Sequence],
                    list(self.scheduler.running) + list(self.scheduler.waiting) + self._incoming,
                )
                for seq in everyone:
                    if seq.finish_reason is not None:
                        continue  # (told already: it waited for a lagged step, ADR 0014)
                    seq.sink(
                        SeqEvent(
                            "",
                            (),
                            finished=True,
                            finish_reason="abort",
                            error=f"engine failed: {exc}",
                        )
                    )
        finally:
            with self._lock:  # stopped: queued commands will not run, and none is queued now
                self._stop = True
                why = f"engine failed: {self.error}" if self.error else "the engine is not running"
                for _fn, future in self._commands:
                    if not future.done():
                        future.set_exception(RuntimeError(why))
                self._commands = []

    def _finish(self, seq: Sequence, reason: str, matched: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.matched_stop = matched

    def _release(self, seq: Sequence) -> None:
        """A finished sequence (already out of the running set) lets go of its adapter version."""
        if seq.adapter_key is not None and self.residency.unhold(seq.adapter_key):
            self._remove(seq.adapter_key)

    def _emit(
        self,
        seq: Sequence,
        new_tokens: tuple[int, ...],
        logprob: TokenLogprob | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        """Send ``seq``'s new tokens (with the logprob of the step's token, when it asked and
        the token is one of them) and its end, if any."""
        finished = seq.finish_reason is not None
        if new_tokens and not seq.first_token_seen:
            seq.first_token_seen = True
            self.observer.first_token(time.perf_counter() - seq.arrived)
        if new_tokens or finished:
            seq.sink(
                SeqEvent(
                    "",
                    new_tokens,
                    finished,
                    seq.finish_reason,
                    seq.matched_stop,
                    prompt_tokens=len(seq.prompt_ids),
                    completion_tokens=seq.generated,
                    logprobs=(logprob,) if new_tokens and logprob is not None else (),
                    prompt_logprobs=prompt_logprobs,
                )
            )

    def _admit(self, in_flight: Container[int] = ()) -> tuple[Admission, list[Sequence], int]:
        """Between steps: queue the new requests, end the aborted ones (those of the step in
        flight, whose ``id`` is in ``in_flight``, end when it is read), admit waiting ones
        and start their slots' loads. The admission, the running sequences that may step
        now, and how many requests wait."""
        with self._lock:
            for seq in self._incoming:
                # (no token to generate: it ends now, unless its prompt is to be scored)
                if seq.params.max_new_tokens == 0 and seq.params.prompt_logprobs is None:
                    self._finish(seq, "length")
                    self._release(seq)
                    self._emit(seq, ())
                else:
                    self.scheduler.add(seq)
            self._incoming = []
            for seq in [s for s in cast(list[Sequence], list(self.scheduler.waiting)) if s.aborted]:
                self.scheduler.drop_waiting(seq)
                self._finish(seq, "abort")
                self._release(seq)
                self._emit(seq, ())
            for seq in cast(list[Sequence], list(self.scheduler.running)):
                if seq.aborted and seq.finish_reason is None and id(seq) not in in_flight:
                    self._finish(seq, "abort")
                    self._end(seq)
                    self._emit(seq, ())
            admission = self.scheduler.schedule()
            self._prefix_hits(cast(list[Sequence], admission.admitted))
            now = time.perf_counter()
            for seq in cast(list[Sequence], admission.admitted):
                self.observer.request_admitted(now - seq.arrived)
            for key in admission.evicted:
                adapter = self.residency.adapters[key]
                self.evictions.append(EventRecord("evict", adapter.name, time.time()))
                self.observer.evicted(adapter.name)
                log.info("evicted adapter %s from its slot (LRU)", adapter.name)
            # (a finished sequence still running waits for its lagged step: ADR 0014)
            running = [
                s
                for s in cast(list[Sequence], list(self.scheduler.running))
                if s.finish_reason is None and not s.aborted
            ]
            waiting = len(self.scheduler.waiting)
            slot_names = [self.residency.adapters[key].name for _, key in admission.slot_loads]
        for (slot, key), name in zip(admission.slot_loads, slot_names, strict=True):
            self.executor.load_slot(slot, key)
            self._loading.add(slot)
            self.observer.slot_loaded(name)
        if admission.slot_loads:
            self._publish_residency()
        return admission, self._ready(running), waiting

    def _step(self) -> str | None:
        """One step in turn: admit, run, read. The step's kind (None: nothing ran)."""
        admission, running, waiting = self._admit()
        if not running:
            self.observer.idle()
            if waiting:
                time.sleep(0.001)
            return None
        work: list[list[SeqWork]] = [[] for _ in range(self.dp_size)]
        order: list[list[Sequence]] = [[] for _ in range(self.dp_size)]
        # Rows ordered by adapter slot (stable; no adapter first): each slot's tokens are then
        # contiguous, so the LoRA kernels read them in place, with no gather (`row_order`).
        plan = sorted(self._plan(running), key=lambda p: p[0].slot)
        for seq, take in plan:
            work[seq.dp_group].append(self._work(seq, seq.next_tokens(take), seq.generated))
            order[seq.dp_group].append(seq)
        self.observer.step(
            len({seq.adapter_key for seq in running if seq.adapter_key is not None}),
            [len(o) for o in order],
            waiting,
            admission.waiting_for_slot,
        )
        results = self.executor.step(work)
        self.steps += 1
        with self._lock:
            for group, seqs in enumerate(order):
                result = results[group]
                for i, (seq, token) in enumerate(zip(seqs, result.tokens, strict=True)):
                    seq.cached += len(work[group][i].tokens)
                    if seq.prefilling:
                        continue  # (a chunk of its prompt: the token sampled after it is not one)
                    before = len(seq.output_ids)
                    self._append(seq, token)
                    if seq.finish_reason is not None:
                        self.scheduler.finish(seq)
                        self._release(seq)
                    self._emit(
                        seq,
                        tuple(seq.output_ids[before:]),
                        *_logprobs_at(result.logprobs, result.prompt_logprobs, i),
                    )
                    if seq.params.max_new_tokens:  # (not a prompt scored only)
                        self.observer.tokens_generated(seq.adapter_name, 1)
        return _kind(plan)

    def _step_overlapped(self) -> str | None:
        """One step of ADR 0014: launch step N+1, then read step N's tokens. The launched
        step's kind (None: none was launched).

        A sequence of step N in flight is launched again with its input token taken from N's
        sampled ids on the device (``SeqWork.carry``), unless N ends it by length (known
        before its token is). Whether N's token ends it (EOS, a stop id, an abort) is known
        only when N is read: then its extra row in N+1 is discarded, and its KV row and
        adapter are released once N+1 is read too."""
        prev = self._inflight
        # each sequence in flight: its row in its DP group's part of that step
        in_flight: dict[int, int] = {}
        if prev:
            rows = [0] * self.dp_size
            for seq in prev[1]:
                in_flight[id(seq)] = rows[seq.dp_group]
                rows[seq.dp_group] += 1
        admission, running, waiting = self._admit(in_flight)
        running = [s for s in running if not self._ends_in_flight(s, in_flight)]
        launched: tuple[LaunchedStep, list[Sequence], list[bool]] | None = None
        kind: str | None = None
        if running:
            work: list[list[SeqWork]] = [[] for _ in range(self.dp_size)]
            order: list[list[Sequence]] = [[] for _ in range(self.dp_size)]
            real: list[list[bool]] = [[] for _ in range(self.dp_size)]
            # (as `_step` orders them; `cached` counts what the launched steps write, so a
            # sequence whose prompt is fed by the step in flight has its token carried)
            plan = sorted(self._plan(running), key=lambda p: p[0].slot)
            kind = _kind(plan)
            for seq, take in plan:
                carry = -1 if seq.prefilling else in_flight.get(id(seq), -1)
                tokens = (0,) if carry >= 0 else seq.next_tokens(take)
                index = seq.generated + (1 if carry >= 0 else 0)
                group = seq.dp_group
                work[group].append(self._work(seq, tokens, index, carry))
                order[group].append(seq)
                seq.cached += len(tokens)  # (written by this step, in the device's order)
                real[group].append(not seq.prefilling)
            stepping = [s for o in order for s in o]  # (group after group)
            self.observer.step(
                len({s.adapter_key for s in stepping if s.adapter_key is not None}),
                [len(o) for o in order],
                waiting,
                admission.waiting_for_slot,
            )
            launches = cast(_Launches, self.executor)
            launched = (
                launches.launch(work, prev[0] if prev else None),
                stepping,
                [r for g in real for r in g],
            )
            self.steps += 1
        self._inflight = launched
        if prev is None:
            if not running:
                self.observer.idle()
                if waiting:
                    time.sleep(0.001)
            return kind
        self._resolve(prev, {id(s) for s in launched[1]} if launched else set())
        return kind

    def _ends_in_flight(self, seq: Sequence, in_flight: dict[int, int]) -> bool:
        """Whether the step in flight gives ``seq`` its last token by length (so it is not
        launched again)."""
        if id(seq) not in in_flight or seq.prefilling:
            return False
        generated = seq.generated + 1
        return (
            generated >= seq.params.max_new_tokens
            or len(seq.prompt_ids) + generated >= self.max_model_len
        )

    def _resolve(
        self, step: tuple[LaunchedStep, list[Sequence], list[bool]], running_on: set[int]
    ) -> None:
        """Read a launched step's tokens: append, finish, emit. A sequence that ends here
        and runs in the step launched after it (``running_on``) keeps its KV row and adapter
        until that step is resolved; the sequences parked so before are released now."""
        tokens = step[0].tokens()
        logprobs, prompt_logprobs = step[0].logprobs()
        with self._lock:
            parked, self._parked = self._parked, []
            for seq in parked:
                self._end(seq)
            for i, (seq, token, real) in enumerate(zip(step[1], tokens, step[2], strict=True)):
                if seq.finish_reason is not None:
                    continue  # (its lagged row: the token is not the user's)
                if not real and not seq.aborted:
                    continue  # (a chunk of its prompt)
                before = len(seq.output_ids)
                if seq.aborted:
                    self._finish(seq, "abort")
                else:
                    self._append(seq, token)
                    if seq.params.max_new_tokens:  # (not a prompt scored only)
                        self.observer.tokens_generated(seq.adapter_name, 1)
                if seq.finish_reason is not None:
                    if id(seq) in running_on:
                        self._parked.append(seq)
                    else:
                        self._end(seq)
                self._emit(
                    seq,
                    tuple(seq.output_ids[before:]),
                    *_logprobs_at(logprobs, prompt_logprobs, i),
                )

    def _plan(self, running: list[Sequence]) -> list[tuple[Sequence, int | None]]:
        """The running sequences that step now, each with how many prompt tokens it is fed
        (None: a decoding sequence, fed its last token). Prompts go in chunks, oldest first,
        while the step's prompt-token budget (``prompt_budget``) lasts; a sequence the
        budget does not reach sits this step out, and the oldest always gets a chunk. A
        prompt whose log probabilities were asked for goes whole (they are read from one
        prefill's logits), spending the budget as much as it has."""
        plan: list[tuple[Sequence, int | None]] = [(s, None) for s in running if not s.prefilling]
        budget = self.prompt_budget(len(plan))
        for seq in sorted((s for s in running if s.prefilling), key=lambda s: s.seq_id):
            if budget is not None and budget <= 0:
                break
            take = len(seq.prompt_ids) - seq.cached
            # a request scoring its prompt (prompt logprobs) is fed it in one piece
            if budget is not None and seq.params.prompt_logprobs is None:
                take = min(take, budget)
                budget -= take
            plan.append((seq, take))
        return plan

    def prompt_budget(self, decodes: int) -> int | None:
        """The prompt tokens a step beside ``decodes`` decoding rows may feed (None: no
        limit): ``chunked_prefill_size``, and with ``step_tokens`` what the decode rows leave
        of it, at least half of it."""
        budget = self.chunked_prefill_size or None
        if self.step_tokens:
            fits = max(self.step_tokens - decodes, self.step_tokens // 2)
            budget = fits if budget is None else min(budget, fits)
        return budget

    def _end(self, seq: Sequence) -> None:
        """A finished sequence leaves the running set: its KV row and adapter are free."""
        self.scheduler.finish(seq)
        self._release(seq)

    def _work(self, seq: Sequence, tokens: tuple[int, ...], index: int, carry: int = -1) -> SeqWork:
        """``seq``'s row of this step, with its pages (before ``seq.cached`` counts ``tokens``)."""
        pages = self._pages(seq, len(tokens))
        return SeqWork(seq.cache_row, seq.cached, tokens, seq.slot, seq.params, index, carry, pages)

    def _pages(self, seq: Sequence, new_tokens: int) -> tuple[int, ...]:
        """``seq``'s KV pages once this step writes ``new_tokens`` more (taken from its
        reservation: ``engine/pages.py``); a step that writes the rest of its prompt makes
        the full prompt pages prefix-cache blocks."""
        assert seq.kv is not None
        pool = self.pools[seq.dp_group]
        pages = pool.cover(seq.kv, seq.cached + new_tokens)
        if seq.cached < len(seq.prompt_ids) <= seq.cached + new_tokens:
            pool.register(seq.kv, seq.adapter_key, seq.prompt_ids)
        return pages

    def _prefix_hits(self, admitted: list[Sequence]) -> None:
        """Admitted sequences skip the prefill of their cached prefix; counted per adapter."""
        for seq in admitted:
            assert seq.kv is not None
            seq.cached = seq.kv.cached
            stats = self.prefix_stats.setdefault(seq.adapter_name, [0, 0, 0, 0])
            stats[0 if seq.cached else 1] += 1
            stats[2] += seq.cached
            stats[3] += len(seq.prompt_ids)
            self.observer.prefix_lookup(seq.adapter_name, seq.cached, len(seq.prompt_ids))
        self._report_kv()

    def _report_kv(self) -> None:
        """The KV pools' use to the observer, when it changed."""
        now = [(p.used, p.cached, p.num_pages) for p in self.pools]
        if now != self._kv_reported:
            for group, (used, cached, total) in enumerate(now):
                self.observer.kv_pool(group, used, cached, total)
            self._kv_reported = now

    def _ready(self, running: list[Sequence]) -> list[Sequence]:
        """The running sequences this step can advance: those whose slot is not still
        loading. Loads copy beside the steps (ADR 0011), so while a newly admitted adapter's
        weights copy, the other requests keep getting tokens; when nothing else could run,
        the step waits for the copies instead."""
        if not self._loading:
            return running
        self._loading -= self.executor.loaded_slots(sorted(self._loading))
        ready = [seq for seq in running if seq.slot not in self._loading]
        if running and not ready:
            self.executor.loaded_slots(sorted(self._loading), wait=True)
            self._loading.clear()
            return running
        return ready

    def _append(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if params.max_new_tokens == 0:  # (a prompt scored, nothing generated)
            self._finish(seq, "length")
            return
        seq.generated += 1
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", token)
            return
        if token in params.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        seq.output_ids.append(token)
        if (
            seq.generated >= params.max_new_tokens
            or len(seq.prompt_ids) + seq.generated >= self.max_model_len
        ):
            self._finish(seq, "length")


def _kind(plan: list[tuple[Sequence, int | None]]) -> str:
    """A step's kind for the loop metrics: "mixed" when it feeds prompt tokens."""
    return "mixed" if any(take is not None for _, take in plan) else "decode"


def _logprobs_at(
    logprobs: list[TokenLogprob | None], prompt_logprobs: list[PromptLogprobs | None], i: int
) -> tuple[TokenLogprob | None, PromptLogprobs | None]:
    """Row ``i``'s logprobs of a step's (``StepResult``'s lists are empty when no row asked)."""
    return (logprobs[i] if logprobs else None, prompt_logprobs[i] if prompt_logprobs else None)
