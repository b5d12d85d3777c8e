"""Compare the registry with what every worker reports and repair drift.

Runs every ``interval_s`` and whenever an event asks for it (a worker registered, an
operation left strays). Per worker:

- unreachable -> worker ``unreachable``; its placements ``unreachable`` (never reported loaded);
- a registered adapter the worker lacks (it restarted empty) -> loaded again;
- an adapter the worker holds that the registry does not place there (a stray, a failed
  rollback, an old version) -> unloaded;
- adapters with ``placement: all`` get placed on a ready worker of their pool that has room.

Adapters with an operation in progress are left alone; the operation owns them. So are
placements recorded after the pass asked the worker (``lifecycle.observed_since``): an
operation that loaded an adapter while the worker's answer was on its way knows better than
that answer, which would have the adapter loaded again, and not routable meanwhile. A stray
is unloaded only if no operation took its name since the comparison (checked just before the
unload), and the rows of an operation whose load landed before that unload stay: the next
pass sees the worker without the adapter and loads it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.db import Database
from loraplane.controlplane.events import EventBus, stop_tasks
from loraplane.controlplane.lifecycle import (
    PlacementState,
    mark,
    new_placement,
    observed_since,
)
from loraplane.controlplane.metrics import (
    ADAPTER_PHASES,
    PLACEMENT_STATES,
    WORKER_STATES,
    Metrics,
)
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.plans import WorkerRef
from loraplane.controlplane.registry import lora_name
from loraplane.controlplane.workers import Observation, WorkerClient, WorkerUnreachable
from loraplane.rules.merge import UpdateResult
from loraplane.rules.pins import room_to_pin

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    def __init__(
        self, db: Database, client: WorkerClient, bus: EventBus, metrics: Metrics, interval_s: float
    ) -> None:
        self.db = db
        self.client = client
        self.bus = bus
        self.metrics = metrics
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._events_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.passes = 0
        # (worker, lora_name) -> (failures, not before): a repair that keeps failing backs off
        self._backoff: dict[tuple[str, str], tuple[int, float]] = {}

    def poke(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="reconciler")
        self._events_task = asyncio.create_task(self._listen(), name="reconciler-events")

    async def close(self) -> None:
        await stop_tasks(
            [t for t in (self._task, self._events_task) if t is not None], "reconciler"
        )

    async def _listen(self) -> None:
        async with self.bus.subscribe() as queue:
            while True:
                event = await queue.get()
                if event.get("type") in (
                    "worker.registered",
                    "adapter.failed",
                    "adapter.unloaded",
                    "reconcile",
                ):
                    self.poke()

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.reconcile_passes.labels("error").inc()
                log.exception("reconcile pass failed")
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # lands as the wait ends, and the loop would outlive close() (a hung shutdown).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()

    async def reconcile_all(self) -> None:
        # several replicas: one reconciles at a time (a Redis lock that outlives a few passes)
        if not await self.bus.try_lead("reconciler", ttl_s=max(3 * self.interval_s, 2.0)):
            self.metrics.reconcile_passes.labels("standby").inc()
            # the leader exports the registry's gauges; a former leader's would add to them
            for gauge in (self.metrics.workers, self.metrics.adapters, self.metrics.placements):
                gauge.clear()
            return
        async with self._lock:
            workers = await asyncio.to_thread(self._workers)
            # one worker's failure is logged and fails the pass, but not the other workers'
            results = await asyncio.gather(
                *(self.reconcile_worker(w) for w in workers), return_exceptions=True
            )
            failed = 0
            for worker, result in zip(workers, results, strict=True):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if isinstance(result, BaseException):
                    failed += 1
                    log.error(
                        "reconciling worker %s failed", worker.name,
                        exc_info=(type(result), result, result.__traceback__),
                    )  # fmt: skip
            await asyncio.to_thread(self._finish_deletes)
            await asyncio.to_thread(self._update_gauges)
            self.passes += 1
        if failed:
            self.metrics.reconcile_passes.labels("error").inc()
            return
        self.metrics.reconcile_passes.labels("ok").inc()
        self.metrics.reconcile_last_success.set(time.time())

    async def reconcile_worker(self, worker: WorkerRef) -> None:
        asked_at = now()
        try:
            await self.client.health(worker.name, worker.endpoint)
            seen = await self.client.observe(worker.name, worker.endpoint, worker.dp_size)
        except WorkerUnreachable as exc:
            await self._mark_unreachable(worker, str(exc))
            return
        restore, strays, fill, became_ready = await asyncio.to_thread(
            self._compare, worker, seen, asked_at
        )
        if became_ready:
            namespace = await asyncio.to_thread(self._namespace_of, worker)
            await self.bus.publish("worker.ready", namespace=namespace, worker=worker.name)
        for name, path, pinned, adapter_id in await asyncio.to_thread(
            self._pin_drift, worker, seen
        ):
            # a pin operation may have started meanwhile
            if not await asyncio.to_thread(self._pin_still_drifts, adapter_id, pinned):
                continue
            # the same name and path again changes only the flag on the worker: nothing unloads
            result = await self.client.load(worker.name, worker.endpoint, name, path, pinned)
            if result.success:
                self.metrics.drift_repaired.labels("repinned").inc()
                await self.bus.publish(
                    "placement.drift_repaired",
                    namespace=await asyncio.to_thread(self._namespace_of, worker),
                    kind="repinned",
                    worker=worker.name,
                    lora_name=name,
                )
            else:
                log.warning(
                    "setting pinned=%s for %s on %s failed: %s",
                    pinned,
                    name,
                    worker.name,
                    result.error_message,
                )
        for name, path, pinned, adapter_id in restore:
            failures, not_before = self._backoff.get((worker.name, name), (0, 0.0))
            if time.monotonic() < not_before:
                continue
            if set(seen.present_on(name)):  # partially present: start clean
                await self.client.unload(worker.name, worker.endpoint, name)
            result = await self.client.load(worker.name, worker.endpoint, name, path, pinned)
            await asyncio.to_thread(self._after_restore, worker, adapter_id, name, result, asked_at)
            if not result.success:
                delay = min(60.0, self.interval_s * 2**failures)
                self._backoff[(worker.name, name)] = (failures + 1, time.monotonic() + delay)
                log.warning(
                    "restoring %s on %s failed (retry in %.1fs): %s",
                    name,
                    worker.name,
                    delay,
                    result.error_message,
                )
            else:
                self._backoff.pop((worker.name, name), None)
            if result.success:
                self.metrics.drift_repaired.labels("restored").inc()
                await self.bus.publish(
                    "placement.drift_repaired",
                    namespace=await asyncio.to_thread(self._namespace_of, worker),
                    kind="restored",
                    worker=worker.name,
                    lora_name=name,
                )
        for name in strays:
            if not await asyncio.to_thread(self._still_stray, worker, name, asked_at):
                continue  # an operation took it since the comparison: it is the operation's
            result = await self.client.unload(worker.name, worker.endpoint, name)
            if result.success:
                await asyncio.to_thread(self._after_stray, worker, name, asked_at)
                self.metrics.drift_repaired.labels("stray_unloaded").inc()
                await self.bus.publish(
                    "placement.drift_repaired",
                    namespace=await asyncio.to_thread(self._namespace_of, worker),
                    kind="stray_unloaded",
                    worker=worker.name,
                    lora_name=name,
                )
            else:
                log.warning(
                    "could not unload stray %s from %s: %s", name, worker.name, result.error_message
                )
        for name, path, pinned, adapter_id in fill:
            result = await self.client.load(worker.name, worker.endpoint, name, path, pinned)
            await asyncio.to_thread(
                functools.partial(
                    self._after_restore, worker, adapter_id, name, result, asked_at, create=True
                )
            )
            if result.success:
                self.metrics.drift_repaired.labels("placed").inc()

    # The database work of a pass runs in worker threads (``asyncio.to_thread``), so a slow
    # database holds this pass and not the event loop that proxies the router's streams.

    def _workers(self) -> list[WorkerRef]:
        with self.db.session() as session:
            return [WorkerRef.of(w) for w in session.scalars(select(Worker)).all()]

    def _pin_still_drifts(self, adapter_id: int, pinned: bool) -> bool:
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            return not (adapter is None or adapter.busy_operation_id or adapter.pinned != pinned)

    def _namespace_of(self, worker: WorkerRef) -> str | None:
        """The namespace of the worker's pool: every adapter it holds is of that namespace."""
        with self.db.session() as session:
            row = session.get(Worker, worker.id)
            return row.pool.namespace if row is not None else None

    async def _mark_unreachable(self, worker: WorkerRef, error: str) -> None:
        if await asyncio.to_thread(self._record_unreachable, worker, error):
            log.warning("worker %s unreachable: %s", worker.name, error)
            await self.bus.publish(
                "worker.unreachable",
                namespace=await asyncio.to_thread(self._namespace_of, worker),
                worker=worker.name,
                error=error,
            )

    def _record_unreachable(self, worker: WorkerRef, error: str) -> bool:
        """Mark the worker and its loaded placements unreachable; whether it was not already."""
        with self.db.session() as session:
            row = session.get(Worker, worker.id)
            if row is None:
                return False
            changed = row.state != "unreachable"
            row.state = "unreachable"
            row.last_error = error
            for placement in row.placements:
                if placement.state == "loaded":
                    mark(placement, "unreachable")
        return changed

    def _pin_drift(self, worker: WorkerRef, seen: Observation) -> list[tuple[str, str, bool, int]]:
        """Adapters this worker holds on every DP group whose pinned flag differs from the
        registry's (a pin change that failed half-way): (name, path, pinned, adapter id)."""
        drift = []
        with self.db.session() as session:
            for placement in session.scalars(
                select(Placement).where(
                    Placement.worker_id == worker.id, Placement.state == "loaded"
                )
            ).all():
                adapter, name = placement.adapter, placement.lora_name
                if (
                    placement.dp_group != 0
                    or adapter.busy_operation_id
                    or name != lora_name(adapter.namespace, adapter.name, adapter.version)
                    or len(seen.present_on(name)) != worker.dp_size
                    or (name in seen.pinned) == adapter.pinned
                ):
                    continue
                drift.append((name, adapter.path, adapter.pinned, adapter.id))
        return drift

    def _compare(
        self, worker: WorkerRef, seen: Observation, asked_at: datetime
    ) -> tuple[list[tuple[str, str, bool, int]], list[str], list[tuple[str, str, bool, int]], bool]:
        """What to restore, unload and fill on ``worker`` from what it answered (``seen``,
        asked at ``asked_at``), and whether it became ready."""
        restore: list[tuple[str, str, bool, int]] = []
        fill: list[tuple[str, str, bool, int]] = []
        wanted: set[str] = set()
        busy: set[str] = set()
        became_ready = False
        with self.db.session() as session:
            row = session.get(Worker, worker.id)
            if row is None:
                return [], [], [], False
            became_ready = row.state != "ready"
            row.state = "ready"
            row.last_error = None
            row.last_seen_at = now()
            row.served_model = seen.served_model
            row.observed = dict(seen.lora_state) if seen.lora_state is not None else None
            by_name: dict[str, list[Placement]] = {}
            for placement in row.placements:
                by_name.setdefault(placement.lora_name, []).append(placement)
            # An operation evicting an adapter to make room (its rows "unloading") holds no
            # claim on that adapter, only on its own: while any operation of the pool runs,
            # such rows are its business, not a placement to restore (the eviction would be
            # undone between its unload and its rows' removal, and the load it made room for
            # would find the worker full). With none running they are a leftover of an
            # operation that died, whose load never ran: the adapter is placed there as
            # before (marked loaded if the worker holds it, else loaded again).
            # (The pool is asked only when this worker has such rows: most passes have none.)
            evicting = {
                name for name, rows in by_name.items() if any(r.state == "unloading" for r in rows)
            }
            pool_busy = bool(evicting) and (
                session.scalar(
                    select(Adapter.id)
                    .where(Adapter.pool_id == row.pool_id, Adapter.busy_operation_id.is_not(None))
                    .limit(1)
                )
                is not None
            )
            for name, rows in by_name.items():
                adapter = rows[0].adapter
                if (
                    adapter.busy_operation_id
                    or (name in evicting and pool_busy)
                    or any(observed_since(r, asked_at) for r in rows)
                ):
                    busy.add(name)
                    continue
                current = lora_name(adapter.namespace, adapter.name, adapter.version)
                keep = (
                    adapter.desired == "loaded"
                    and name == current
                    and all(r.state != "inconsistent" for r in rows)
                )
                present = set(seen.present_on(name))
                if not keep:
                    continue  # not wanted here: a stray if present, rows dropped once it is gone
                wanted.add(name)
                if present >= set(range(worker.dp_size)):
                    for r in rows:
                        mark(r, "loaded", error=None, observed=asked_at)
                else:
                    for r in rows:
                        state: PlacementState = "loaded" if r.dp_group in present else "loading"
                        mark(r, state, observed=asked_at)
                    restore.append((name, adapter.path, adapter.pinned, adapter.id))
            # rows of unwanted names that the worker no longer holds are forgotten
            for name, rows in by_name.items():
                if name in wanted or name in busy:
                    continue
                if not seen.present_on(name):
                    adapter = rows[0].adapter
                    for r in rows:
                        session.delete(r)
                    session.flush()
                    if adapter.inconsistent and not any(
                        p.state == "inconsistent" for p in adapter.placements if p not in rows
                    ):
                        adapter.inconsistent = False
                        adapter.last_error = None
            # placement: all -> fill this worker if it has room
            pool = row.pool
            held = len(by_name)
            candidates = session.scalars(
                select(Adapter)
                .where(
                    Adapter.pool_id == pool.id,
                    Adapter.placement_count.is_(None),
                    Adapter.desired == "loaded",
                    Adapter.busy_operation_id.is_(None),
                    Adapter.inconsistent.is_(False),
                    Adapter.last_error.is_(None),
                )
                .order_by(
                    Adapter.pinned.desc(), Adapter.priority.desc(), Adapter.last_used_at.desc()
                )
            ).all()
            pinned_here = sum(1 for rows in by_name.values() if rows[0].adapter.pinned)
            for adapter in candidates:
                name = lora_name(adapter.namespace, adapter.name, adapter.version)
                if name in by_name or held >= pool.max_loaded_loras:
                    continue
                if adapter.pinned and not room_to_pin(pinned_here, pool.max_loras_per_batch):
                    continue
                if not any(p.lora_name == name for p in adapter.placements):
                    continue  # never loaded anywhere (or unloaded): an operation decides, not the reconciler
                held += 1
                pinned_here += int(adapter.pinned)
                wanted.add(name)
                fill.append((name, adapter.path, adapter.pinned, adapter.id))
        strays = sorted(seen.adapters - wanted - busy)
        return restore, strays, fill, became_ready

    def _after_restore(
        self,
        worker: WorkerRef,
        adapter_id: int,
        name: str,
        result: UpdateResult,
        asked_at: datetime,
        create: bool = False,
    ) -> None:
        """Rows of ``name`` on ``worker`` follow the load's answer, unless an operation took
        the adapter or recorded them since the pass asked the worker: then they are its."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if adapter is None or adapter.busy_operation_id:
                return
            rows = {
                r.dp_group: r
                for r in adapter.placements
                if r.worker_id == worker.id and r.lora_name == name
            }
            if any(observed_since(r, asked_at) for r in rows.values()):
                return
            ok = result.success
            for group in range(worker.dp_size):
                row = rows.get(group)
                if row is None:
                    if not (create and ok):
                        continue
                    row = new_placement(
                        adapter_id, worker.id, group, name, adapter.version, "loaded"
                    )
                    session.add(row)
                error = None if ok else result.error_message
                mark(row, "loaded" if ok else "failed", error=error, observed=True)

    def _still_stray(self, worker: WorkerRef, name: str, asked_at: datetime) -> bool:
        """No operation holds ``name``'s adapter on ``worker`` now, nor recorded its rows since
        the pass asked the worker (a load journalled after the comparison)."""
        with self.db.session() as session:
            return not any(
                r.adapter.busy_operation_id or observed_since(r, asked_at)
                for r in self._rows_of(session, worker, name)
            )

    @staticmethod
    def _rows_of(session: Session, worker: WorkerRef, name: str) -> Sequence[Placement]:
        return session.scalars(
            select(Placement).where(Placement.worker_id == worker.id, Placement.lora_name == name)
        ).all()

    def _after_stray(self, worker: WorkerRef, name: str, asked_at: datetime) -> None:
        """The stray's rows go, but those an operation holds or recorded since the pass asked
        (its load may have landed before the unload: the next pass restores it)."""
        with self.db.session() as session:
            rows = [
                r
                for r in self._rows_of(session, worker, name)
                if not (r.adapter.busy_operation_id or observed_since(r, asked_at))
            ]
            adapters = {r.adapter for r in rows}
            for r in rows:
                session.delete(r)
            session.flush()
            for adapter in adapters:
                if adapter.inconsistent and not any(
                    p.state == "inconsistent" for p in adapter.placements
                ):
                    adapter.inconsistent = False
                    adapter.last_error = None

    def _finish_deletes(self) -> None:
        with self.db.session() as session:
            for adapter in session.scalars(
                select(Adapter).where(Adapter.desired == "deleted")
            ).all():
                if not adapter.placements and not adapter.busy_operation_id:
                    session.delete(adapter)

    def _update_gauges(self) -> None:
        """Per-pool gauges from the registry; every known label combination is written (0 when
        empty) and combinations of deleted pools/workers disappear."""
        from loraplane.controlplane.registry import adapter_phase

        m = self.metrics
        workers: dict[tuple[str, str, str], int] = {}
        adapters: dict[tuple[str, str, str], int] = {}
        placements: dict[tuple[str, str, str, str], int] = {}
        with self.db.session() as session:
            for pool in session.scalars(select(Pool)).all():
                m.init_pool(pool.namespace, pool.name)
                for state in WORKER_STATES:
                    workers[(pool.namespace, pool.name, state)] = 0
                for phase in ADAPTER_PHASES:
                    adapters[(pool.namespace, pool.name, phase)] = 0
            for worker in session.scalars(select(Worker)).all():
                ns, pool_name = worker.pool.namespace, worker.pool.name
                key = (ns, pool_name, worker.state)
                workers[key] = workers.get(key, 0) + 1
                m.evictions.labels(ns, pool_name, worker.name)
                for state in PLACEMENT_STATES:
                    placements[(ns, pool_name, worker.name, state)] = 0
                for placement in worker.placements:
                    pkey = (ns, pool_name, worker.name, placement.state)
                    placements[pkey] = placements.get(pkey, 0) + 1
            for adapter in session.scalars(select(Adapter)).all():
                akey = (adapter.pool.namespace, adapter.pool.name, adapter_phase(adapter))
                adapters[akey] = adapters.get(akey, 0) + 1
                m.routed_requests.labels(adapter.namespace, adapter.name, "200")
        # No await from here on: a scrape never sees the gauges half rewritten.
        for gauge, values in (
            (m.workers, workers),
            (m.adapters, adapters),
            (m.placements, placements),
        ):
            gauge.clear()
            for labels, count in values.items():
                gauge.labels(*labels).set(count)
