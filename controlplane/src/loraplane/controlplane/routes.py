"""The router's in-memory view of where each ``model`` can be served, so a routed request costs
no database round trip when the answer is known.

An entry maps ``(namespace, model)`` to a ``Destination``: the ready workers that hold the
adapter's current version on every DP group (or, for a pool or base model, the pool's ready
workers). The worker is picked per request from in-memory inflight counts. Only routable
answers are kept; errors and "loaded nowhere" go to the database every time.

An adapter is routable everywhere or nowhere, so the view must never outlive a placement. It is
emptied whole, never patched:
- when this process writes a row that changes routing (``watch_writes``): once as the statement
  runs and again after its transaction ends, so that a lookup which read the old rows in
  between is dropped too. An unload marks its rows ``unloading`` and commits before it calls the
  worker, so the view is empty before the worker lets the adapter go;
- on every registry event (``EventBus``), which is how other replicas' changes arrive;
- after ``ttl_s``, for a change no event announced (a replica without Redis, a hand edit).
A worker that still answers 404 for the adapter sends the request back through the database
(``api/openai.py``).

Lookups run off the event loop (``asyncio.to_thread``), one at a time per key; a lookup that
started before the view was emptied is not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event

from loraplane.controlplane.events import EventBus, stop_tasks
from loraplane.controlplane.operations import WorkerRef

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, model as the client wrote it)

# Writes that can change where a model routes: table -> the columns whose update matters
# (None: every write). ``last_used_at`` and ``phase`` writes, for instance, leave routes alone.
ROUTING_COLUMNS: dict[str, frozenset[str] | None] = {
    "placements": frozenset(
        {"state", "lora_name", "worker_id", "adapter_id", "dp_group", "version"}
    ),
    "pools": None,
    "workers": frozenset({"state", "endpoint", "served_model", "pool_id", "dp_size", "name"}),
    "adapters": frozenset(
        {"desired", "inconsistent", "version", "pool_id", "namespace", "name", "load_policy"}
    ),
}
_WRITE = re.compile(r"^\s*(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+\"?(\w+)\"?", re.IGNORECASE)
_SET = re.compile(r"\bSET\s+(.*?)(?:\bWHERE\b|$)", re.IGNORECASE | re.DOTALL)
_ASSIGNED = re.compile(r"\"?(\w+)\"?\s*=")
_DIRTY = "loraplane_routes_dirty"


def changes_routing(statement: str) -> bool:
    """Whether the SQL ``statement`` writes a row that can change a route."""
    match = _WRITE.match(statement)
    if match is None:
        return False
    table = match.group(2).lower()
    if table not in ROUTING_COLUMNS:
        return False
    columns = ROUTING_COLUMNS[table]
    if columns is None or not match.group(1).upper().startswith("UPDATE"):
        return True
    assigned = _SET.search(statement)
    if assigned is None:
        return True
    return any(name.lower() in columns for name in _ASSIGNED.findall(assigned.group(1)))


def watch_writes(engine: Engine, on_change: Callable[[], None]) -> None:
    """Call ``on_change`` when a statement on ``engine`` changes routing, and again when the
    connection that ran it goes back to the pool (after its commit or rollback)."""

    @event.listens_for(engine, "after_cursor_execute")
    def _written(
        conn: Any, _cursor: Any, statement: str, _params: Any, _context: Any, _many: bool
    ) -> None:
        if changes_routing(statement):
            conn.info[_DIRTY] = True
            on_change()

    @event.listens_for(engine, "checkin")
    def _released(_dbapi_connection: Any, record: Any) -> None:
        if record is None or record.info.pop(_DIRTY, False):
            on_change()


@dataclass(frozen=True, slots=True)
class Candidate:
    worker: WorkerRef
    model: str  # what this worker is sent as ``model``


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one ``model`` can go now; ``candidates`` empty: loaded on no ready worker."""

    candidates: tuple[Candidate, ...]
    adapter_id: int | None
    adapter_name: str  # for metrics ("" = base)
    lora_name: str | None
    load_policy: str = "OnDemand"


@dataclass(frozen=True, slots=True)
class _Entry:
    destination: Destination
    at: float  # time.monotonic() of the lookup


class RouteTable:
    """``get`` answers from memory when it can, else looks the model up off the loop."""

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.hits = 0
        self.lookups = 0
        self._entries: dict[Key, _Entry] = {}
        self._generation = 0
        self._lock = threading.Lock()  # invalidate() runs on database threads too
        self._pending: dict[Key, tuple[int, asyncio.Future[Destination]]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def invalidate(self) -> None:
        """Forget every entry; a lookup still running is not stored. Safe from any thread."""
        with self._lock:
            self._generation += 1
            self._entries.clear()

    async def get(self, key: Key, lookup: Callable[[], Destination]) -> Destination:
        """The destination of ``key``; ``lookup`` (blocking: it reads the database) runs in a
        thread when memory has no fresh answer, and its errors reach every caller waiting."""
        entry = self._entries.get(key)
        if entry is not None:
            age = time.monotonic() - entry.at
            if age < self.ttl_s:
                self.hits += 1
                if age > self.ttl_s / 2:  # refreshed ahead, so steady traffic never misses
                    self._start_lookup(key, lookup)
                return entry.destination
        return await asyncio.shield(self._start_lookup(key, lookup))

    def _start_lookup(
        self, key: Key, lookup: Callable[[], Destination]
    ) -> asyncio.Future[Destination]:
        with self._lock:
            generation = self._generation
        pending = self._pending.get(key)
        if pending is not None and pending[0] == generation and not pending[1].done():
            return pending[1]
        future = asyncio.ensure_future(self._lookup(key, lookup, generation))
        self._pending[key] = (generation, future)
        future.add_done_callback(lambda done: self._settled(key, done))
        return future

    def _settled(self, key: Key, future: asyncio.Future[Destination]) -> None:
        pending = self._pending.get(key)
        if pending is not None and pending[1] is future:
            del self._pending[key]
        if not future.cancelled():
            future.exception()  # retrieved: a refresh-ahead nobody awaited may have failed

    async def _lookup(
        self, key: Key, lookup: Callable[[], Destination], generation: int
    ) -> Destination:
        self.lookups += 1
        destination = await asyncio.to_thread(lookup)
        if destination.candidates and self.ttl_s > 0:
            with self._lock:
                if generation == self._generation:
                    if len(self._entries) >= self.max_entries:
                        self._entries.clear()
                    self._entries[key] = _Entry(destination, time.monotonic())
        return destination

    async def start(self, bus: EventBus) -> None:
        """Empty the view on every registry event, this replica's and the others'."""
        subscribed = asyncio.Event()
        self._tasks = [asyncio.create_task(self._follow(bus, subscribed), name="route-events")]
        await subscribed.wait()

    async def _follow(self, bus: EventBus, subscribed: asyncio.Event) -> None:
        async with bus.subscribe(maxsize=100_000) as queue:
            subscribed.set()
            while True:
                await queue.get()
                self.invalidate()
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:  # a burst of events empties the view once
                        queue.get_nowait()

    async def close(self) -> None:
        await stop_tasks(self._tasks, "route table")
