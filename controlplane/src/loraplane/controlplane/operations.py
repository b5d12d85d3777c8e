"""Journalled operations: register, load, unload, pin/unpin, update version, delete.

Each operation is written to the ``operations`` table (with its idempotency key and its full
plan: targets, evictions, names and paths) and the adapter is claimed for it *before* any
worker is touched. Running it fans out concurrently to every target worker (which fans out to
its DP groups), merges the answers fail-first (``merge.merge_results``), rolls back a failed
load where it succeeded, and writes the outcome.

Each operation has an owner (the replica that journalled it) and a lease the owner renews
while it runs it. ``settle_interrupted`` finishes or rolls back the operations nobody runs any
more: its own replica's that missed a renewal (left by an earlier process or dropped by an
unexpected error), and any replica's whose lease ran out. It runs at start and then every third of a lease, so a
database blip or a bug mid-operation never leaves an adapter claimed until a restart, and a
replica starting during a rolling update leaves the old replica's live operations alone.

The coroutines here await workers and the database, never block on either: every
transaction is a small synchronous method (``_start``, ``_set_rows``, ``_write_outcome`` …),
one ``with self.db.session()`` block each, run in a worker thread (``asyncio.to_thread``) and
handing back plain values, never ORM objects. A database 200 ms away per round trip holds the
operation, not the event loop that proxies the router's streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, delete, or_, select, update
from sqlalchemy.orm import Session

from loraplane.controlplane.db import Database
from loraplane.controlplane.errors import NoCapacity, PinLimit, conflict
from loraplane.controlplane.events import EventBus, stop_tasks
from loraplane.controlplane.lifecycle import PlacementState, mark, mark_where, new_placement, settle
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.models import Adapter, Operation, Placement, Worker
from loraplane.controlplane.plans import (
    LoadPlan,
    LoadTarget,
    PinPlan,
    Plan,
    UnloadPlan,
    VersionPlan,
    plan_from_json,
)
from loraplane.controlplane.plans import WorkerRef as WorkerRef  # the router imports it here
from loraplane.controlplane.registry import lora_name, worker_slots
from loraplane.controlplane.slots import NoCapacity as SlotsFull
from loraplane.controlplane.slots import (
    PinLimitExceeded,
    check_pin,
    choose_evictions,
    plan_placement,
)
from loraplane.controlplane.workers import Observation, WorkerClient, WorkerUnreachable
from loraplane.rules.merge import UpdateResult, merge_results

log = logging.getLogger(__name__)
INTERRUPTED = "control plane restarted while the operation ran"
ABANDONED = "the control plane stopped running the operation"


def now() -> datetime:
    return datetime.now(UTC)


def request_hash(kind: str, body: Any) -> str:
    return hashlib.sha256(
        json.dumps([kind, body], sort_keys=True, default=str).encode()
    ).hexdigest()


def _pool_of(session: Session, op: Operation) -> str:
    """The pool an operation's adapter belongs to ("" when the adapter is gone)."""
    adapter_id = (op.plan or {}).get("adapter_id")
    adapter = session.get(Adapter, adapter_id) if adapter_id else None
    if adapter is None and op.adapter_name:
        adapter = session.scalars(
            select(Adapter).where(
                Adapter.namespace == op.namespace, Adapter.name == op.adapter_name
            )
        ).first()
    return adapter.pool.name if adapter is not None else ""


VictimOutcome = Literal["evicted", "kept", "unknown"]


def _victim_outcome(
    victim: str, result: UpdateResult, seen: Observation | None, dp_size: int
) -> VictimOutcome:
    """What became of an eviction's victim: after a load that succeeded, what its answer
    lists (a worker that held the new adapter already evicts nothing); after a failed one,
    what the worker reports (``seen``; None: it did not answer)."""
    if result.success:
        return "kept" if victim in result.loaded_adapters else "evicted"
    if seen is None or victim in seen.inconsistent:
        return "unknown"
    present = seen.present_on(victim)
    if len(present) == dp_size:
        return "kept"
    return "evicted" if not present and victim not in seen.adapters else "unknown"


def _registered(session: Session, adapter_id: int, target: WorkerRef) -> bool:
    """Both ends of a placement row still exist: a worker or adapter deleted while an
    operation ran holds nothing in the registry, and no row may point at it."""
    return (
        session.get(Worker, target.id) is not None and session.get(Adapter, adapter_id) is not None
    )


@dataclass(frozen=True, slots=True)
class _Written:
    """What ``_write_outcome`` did: ``ours``: it wrote ``state`` (else another replica had
    settled the operation, as ``state``); the labels of the operation's metric and event."""

    ours: bool
    state: str
    namespace: str
    adapter_name: str | None
    pool_name: str


class Inflight:
    """Requests this replica is proxying, per worker and per (worker, lora_name) (the running batch)."""

    def __init__(self) -> None:
        self.by_worker: dict[int, int] = {}
        self.by_adapter: dict[tuple[int, str], int] = {}

    def add(self, worker_id: int, name: str | None, delta: int) -> None:
        self.by_worker[worker_id] = self.by_worker.get(worker_id, 0) + delta
        if name is not None:
            self.by_adapter[(worker_id, name)] = self.by_adapter.get((worker_id, name), 0) + delta


class Operations:
    def __init__(
        self,
        db: Database,
        client: WorkerClient,
        bus: EventBus,
        metrics: Metrics,
        inflight: Inflight,
        *,
        owner: str | None = None,
        lease_s: float = 30.0,
    ) -> None:
        self.db = db
        self.client = client
        self.bus = bus
        self.metrics = metrics
        self.inflight = inflight
        self.owner = owner or socket.gethostname()
        self.lease_s = lease_s
        self.started_at = now()
        self.running: set[str] = set()  # operations this process runs or settles right now
        self._tasks: list[asyncio.Task[None]] = []

    # -- leases ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Every third of a lease: renew this replica's leases, and (separately, since settling
        waits on workers for up to a load timeout) settle abandoned operations."""
        self._tasks = [
            asyncio.create_task(self._every_third(self.renew), name="operation-lease-renew"),
            asyncio.create_task(
                self._every_third(self.settle_interrupted), name="operation-lease-settle"
            ),
        ]

    async def close(self) -> None:
        await stop_tasks(self._tasks, "operations")

    async def _every_third(self, step: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database is away: the next pass tries again
                log.warning("operation lease pass failed: %s: %s", type(exc).__name__, exc)

    async def renew(self) -> None:
        """Renew this replica's leases, in a worker thread (a slow database holds this pass,
        not the event loop)."""
        if self.running:
            await asyncio.to_thread(self._renew, sorted(self.running))

    def _renew(self, running: list[str]) -> None:
        with self.db.session() as session:
            session.execute(
                update(Operation)
                .where(Operation.id.in_(running), Operation.owner == self.owner)
                .values(heartbeat_at=now())
                .execution_options(synchronize_session=False)
            )

    def _abandoned(self) -> ColumnElement[bool]:
        """Unfinished operations nobody runs: the lease ran out, or they are this replica's and
        missed a renewal (half a lease without one: its process is gone, or an error dropped
        it; a live process with the same name renews every third). The caller skips
        ``self.running``."""
        return and_(
            Operation.state.in_(("pending", "running")),
            or_(
                Operation.heartbeat_at.is_(None),
                Operation.heartbeat_at < now() - timedelta(seconds=self.lease_s),
                and_(
                    Operation.owner == self.owner,
                    Operation.heartbeat_at < now() - timedelta(seconds=self.lease_s / 2),
                ),
            ),
        )

    def _claim(self, op_id: str) -> bool:
        """Take an abandoned operation over (one replica wins: the row must still qualify)."""
        with self.db.session() as session:
            claimed = session.execute(  # type: ignore[attr-defined]
                update(Operation)
                .where(Operation.id == op_id, self._abandoned())
                .values(owner=self.owner, heartbeat_at=now())
                .execution_options(synchronize_session=False)
            ).rowcount
        return bool(claimed == 1)

    # -- journal -------------------------------------------------------------------------------
    @staticmethod
    def existing(session: Session, namespace: str, key: str | None, hash_: str) -> Operation | None:
        """The operation journalled under ``key`` in ``namespace`` (409 for another request)."""
        if key is None:
            return None
        op = session.scalar(
            select(Operation).where(
                Operation.namespace == namespace, Operation.idempotency_key == key
            )
        )
        if op is not None and op.request_hash != hash_:
            raise conflict(
                f"Idempotency-Key {key!r} was used for a different request (operation {op.id}, kind {op.kind})",
                code="idempotency_mismatch",
                field="header.Idempotency-Key",
            )
        return op

    def journal(
        self,
        session: Session,
        *,
        key: str | None,
        hash_: str,
        kind: str,
        adapter: Adapter,
        plan: Plan,
    ) -> Operation:
        """Write the operation and claim the adapter for it (409 if another operation holds it)."""
        op = Operation(
            id="op_" + uuid.uuid4().hex,
            idempotency_key=key or "auto-" + uuid.uuid4().hex,
            request_hash=hash_,
            kind=kind,
            namespace=adapter.namespace,
            adapter_name=adapter.name,
            state="pending",
            plan=plan.to_json(),
            targets=[w.name for w in plan.workers],
            per_target=[],
            owner=self.owner,
            heartbeat_at=now(),
        )
        session.add(op)
        session.flush()
        claimed = session.execute(  # type: ignore[attr-defined]
            update(Adapter)
            .where(Adapter.id == adapter.id, Adapter.busy_operation_id.is_(None))
            .values(busy_operation_id=op.id)
            .execution_options(synchronize_session=False)
        ).rowcount
        if claimed != 1:
            raise conflict(
                f"adapter {adapter.namespace}/{adapter.name} has operation {adapter.busy_operation_id} in progress; "
                "retry when it finishes",
                code="operation_in_progress",
            )
        return op

    # -- planning (in the caller's session, before journalling) -------------------------------------
    def plan_load(
        self,
        session: Session,
        adapter: Adapter,
        count: int | None,
        shrink: bool = False,
        pin_field: str | None = None,
    ) -> LoadPlan:
        """Targets for ``adapter``; with ``shrink`` (a placement count the caller set), the
        copies held beyond ``count`` are unloaded once the load succeeds. ``pin_field``: the
        request's field a pin limit names (``body.pinned`` where the request set the pin;
        a load of an adapter pinned before has none)."""
        name = lora_name(adapter.namespace, adapter.name, adapter.version)
        workers = list(adapter.pool.workers)
        slots = [
            worker_slots(w, self.inflight.by_adapter, self.inflight.by_worker.get(w.id, 0))
            for w in workers
        ]
        try:
            plan = plan_placement(slots, name, count=count, pinned=adapter.pinned)
        except PinLimitExceeded as exc:
            raise PinLimit(str(exc), field=pin_field) from exc
        except SlotsFull as exc:
            raise NoCapacity(str(exc), no_worker=exc.no_worker) from exc
        by_name = {w.name: w for w in workers}
        chosen = {t.worker for t in plan.targets}
        # `count: N` below what it holds now: the copies beyond the chosen N go once it succeeds
        extras = sorted(
            {p.worker.name for p in adapter.placements if p.lora_name == name} - chosen
            if count is not None and shrink
            else set()
        )

        def loaded_everywhere(worker: Worker) -> bool:
            groups = {
                p.dp_group for p in worker.placements if p.lora_name == name and p.state == "loaded"
            }
            return groups >= set(range(worker.dp_size))

        return LoadPlan(
            adapter.id,
            name,
            adapter.path,
            adapter.pinned,
            tuple(
                LoadTarget(
                    WorkerRef.of(by_name[t.worker]),
                    t.evict,
                    t.already_loaded and loaded_everywhere(by_name[t.worker]),
                )
                for t in plan.targets
            ),
            tuple(WorkerRef.of(by_name[w]) for w in extras if w in by_name),
        )

    def plan_beside(self, workers: Sequence[Worker], keep: Sequence[str]) -> tuple[LoadTarget, ...]:
        """Targets that load one more adapter next to what they hold (a new version beside the
        old one): each worker without a free slot evicts its least recently used victim, never
        one of ``keep``. Raises 409 ``no_capacity`` naming the worker that cannot make room."""
        targets = []
        for worker in workers:
            slots = worker_slots(
                worker, self.inflight.by_adapter, self.inflight.by_worker.get(worker.id, 0)
            )
            try:
                evict = choose_evictions(slots, 1, protect=keep)
            except SlotsFull as exc:
                raise NoCapacity(f"{exc}; the new version needs room beside the old") from exc
            targets.append(LoadTarget(WorkerRef.of(worker), tuple(evict)))
        return tuple(targets)

    @staticmethod
    def add_loading_rows(
        session: Session,
        adapter: Adapter,
        plan: LoadPlan | VersionPlan,
        version: int | None = None,
    ) -> None:
        for target in plan.targets:
            if target.already_loaded:
                continue
            for group in range(target.worker.dp_size):
                exists = session.scalar(
                    select(Placement).where(
                        Placement.adapter_id == adapter.id,
                        Placement.worker_id == target.worker.id,
                        Placement.dp_group == group,
                        Placement.lora_name == plan.lora_name,
                    )
                )
                if exists is None:
                    session.add(
                        new_placement(
                            adapter.id,
                            target.worker.id,
                            group,
                            plan.lora_name,
                            version or adapter.version,
                            "loading",
                        )
                    )
                else:
                    mark(exists, "loading")

    def check_pin_targets(
        self, session: Session, adapter: Adapter, workers: Sequence[Worker]
    ) -> None:
        name = lora_name(adapter.namespace, adapter.name, adapter.version)
        for worker in workers:
            try:
                check_pin(worker_slots(worker, {}, 0), name)
            except PinLimitExceeded as exc:
                raise PinLimit(str(exc), field="body.pinned") from exc

    # -- running ---------------------------------------------------------------------------------
    async def run(self, op_id: str) -> str | None:
        """Run a journalled operation; its final state, or None when it could not be settled
        here (the database went away), in which case the lease pass settles it later."""
        self.running.add(op_id)
        try:
            return await self._run(op_id)
        finally:
            self.running.discard(op_id)

    async def _run(self, op_id: str) -> str | None:
        kind, plan = await asyncio.to_thread(self._start, op_id)
        started = time.perf_counter()
        try:
            per_target: list[dict[str, Any]]
            if isinstance(plan, LoadPlan):
                state, merged, per_target = await self._run_load(plan)
            elif isinstance(plan, UnloadPlan):
                state, merged, per_target = await self._run_unload(plan)
            elif isinstance(plan, PinPlan):
                state, merged, per_target = await self._run_pin(plan)
            else:
                state, merged, per_target = await self._run_update_version(plan)
        except Exception:  # a bug or the database went away: settle it from what workers hold
            log.exception("operation %s failed unexpectedly; settling it", op_id)
            try:
                await asyncio.to_thread(self._count_error, op_id, kind)
                return await self._settle(op_id, kind, plan, ABANDONED)
            except Exception as exc:
                log.warning(
                    "operation %s could not be settled now (%s: %s); the lease pass will",
                    op_id,
                    type(exc).__name__,
                    exc,
                )
                return None
        return await self._finish(
            op_id, kind, state, merged, per_target, time.perf_counter() - started
        )

    def _start(self, op_id: str) -> tuple[str, Plan]:
        """Mark the operation running (by this replica); its kind and plan."""
        with self.db.session() as session:
            op = session.get(Operation, op_id)
            assert op is not None
            op.state = "running"
            op.owner, op.heartbeat_at = self.owner, now()
            return op.kind, plan_from_json(op.kind, op.plan)

    def _count_error(self, op_id: str, kind: str) -> None:
        with self.db.session() as session:
            op = session.get(Operation, op_id)
            assert op is not None
            self.metrics.operations.labels(op.namespace, _pool_of(session, op), kind, "error").inc()

    async def _finish(
        self,
        op_id: str,
        kind: str,
        state: str,
        merged: UpdateResult,
        per_target: list[dict[str, Any]],
        took: float,
    ) -> str:
        """Write the outcome and release the adapter; the operation's final state."""
        written = await asyncio.to_thread(
            self._write_outcome, op_id, kind, state, merged, per_target
        )
        if not written.ours:
            return written.state
        namespace, adapter_name = written.namespace, written.adapter_name
        self.metrics.operations.labels(namespace, written.pool_name, kind, state).inc()
        log.info(
            "operation %s %s %s/%s: %s (%.3fs)", op_id, kind, namespace, adapter_name, state, took
        )
        await self.bus.publish(
            "operation.finished",
            operation=op_id,
            kind=kind,
            state=state,
            namespace=namespace,
            adapter=adapter_name,
        )
        return state

    def _write_outcome(
        self,
        op_id: str,
        kind: str,
        state: str,
        merged: UpdateResult,
        per_target: list[dict[str, Any]],
    ) -> _Written:
        """The outcome into the journal, and the adapter settled; not over an outcome another
        replica wrote meanwhile (then ``state`` is that one's)."""
        with self.db.session() as session:
            op = session.get(Operation, op_id)
            assert op is not None
            if op.state not in ("pending", "running") or op.owner not in (None, self.owner):
                log.warning(
                    "operation %s was settled by %s meanwhile; not writing %s over it",
                    op_id,
                    op.owner,
                    state,
                )
                return _Written(False, op.state, op.namespace, op.adapter_name, "")
            op.state = state
            op.result = merged.to_json()
            op.per_target = per_target
            op.error = (
                None if merged.success else merged.error_message or "failed without a message"
            )
            op.error_code = None if merged.success else "fanout_failed"
            op.finished_at = now()
            adapter = (
                session.get(Adapter, op.plan.get("adapter_id"))
                if op.plan.get("adapter_id")
                else None
            )
            if adapter is not None and adapter.busy_operation_id == op_id:
                settle(
                    adapter,
                    error=op.error,
                    keeps_error=kind in ("register", "load", "pin", "unpin", "update_version"),
                )
            pool_name = adapter.pool.name if adapter is not None else _pool_of(session, op)
            return _Written(True, state, op.namespace, op.adapter_name, pool_name)

    async def _fanout(
        self,
        op_label: str,
        targets: Sequence[WorkerRef],
        call: Callable[[WorkerRef], Awaitable[UpdateResult]],
    ) -> tuple[list[UpdateResult], list[dict[str, Any]]]:
        async def timed(target: WorkerRef) -> tuple[UpdateResult, float]:
            start = time.perf_counter()
            result = await call(target)
            return result, time.perf_counter() - start

        start = time.perf_counter()
        # Every call runs to its end before this returns or raises: after an unexpected error
        # in one, the operation is settled from what the workers hold, and a load still in
        # flight elsewhere would land after that look (a copy with no row).
        outcomes = await asyncio.gather(*(timed(t) for t in targets), return_exceptions=True)
        self.metrics.fanout_latency.labels(op_label).observe(time.perf_counter() - start)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:  # a real error before a call's own cancellation: the caller settles on it
            raise next((e for e in errors if isinstance(e, Exception)), errors[0])
        answers = [a for a in outcomes if not isinstance(a, BaseException)]
        results = [a[0] for a in answers]
        per_target = [
            {
                "worker": t.name,
                "success": r.success,
                "error_message": r.error_message,
                "latency_s": round(s, 6),
            }
            for t, (r, s) in zip(targets, answers, strict=True)
        ]
        return results, per_target

    async def observe(self, target: WorkerRef) -> Observation | None:
        try:
            return await self.client.observe(target.name, target.endpoint, target.dp_size)
        except WorkerUnreachable:
            return None

    async def _record_observed(
        self, adapter_id: int, name: str, targets: Sequence[WorkerRef], error: str | None
    ) -> bool:
        """After a failure: rows of ``name`` on ``targets`` follow what the workers report.
        Present groups -> 'inconsistent' (to be unloaded by the reconciler), absent -> row dropped.
        A worker that cannot be asked may hold it: its rows are 'inconsistent' too, so when it
        comes back the reconciler unloads the leftover instead of restoring it.
        Returns True if the adapter is still present anywhere (or a worker could not be asked)."""
        observations = await asyncio.gather(*(self.observe(t) for t in targets))
        return await asyncio.to_thread(
            self._write_observed, adapter_id, name, targets, observations, error
        )

    def _write_observed(
        self,
        adapter_id: int,
        name: str,
        targets: Sequence[WorkerRef],
        observations: Sequence[Observation | None],
        error: str | None,
    ) -> bool:
        leftover = False
        with self.db.session() as session:
            for target, seen in zip(targets, observations, strict=True):
                if not _registered(session, adapter_id, target):
                    continue
                present = set(range(target.dp_size)) if seen is None else set(seen.present_on(name))
                leftover = leftover or bool(present)
                rows = session.scalars(
                    select(Placement).where(
                        Placement.adapter_id == adapter_id,
                        Placement.worker_id == target.id,
                        Placement.lora_name == name,
                    )
                ).all()
                have = {r.dp_group: r for r in rows}
                for group in range(target.dp_size):
                    row = have.get(group)
                    if group in present:
                        if row is None:
                            row = new_placement(
                                adapter_id, target.id, group, name, 0, "inconsistent"
                            )
                            session.add(row)
                        mark(
                            row,
                            "inconsistent",
                            error=error if seen is not None else f"{error} (worker unreachable)",
                            observed=seen is not None,
                        )
                    elif row is not None:
                        session.delete(row)
        return leftover

    def _set_rows(
        self, adapter_id: int, name: str, targets: Sequence[WorkerRef], state: PlacementState
    ) -> None:
        with self.db.session() as session:
            rows = session.scalars(
                select(Placement).where(
                    Placement.adapter_id == adapter_id,
                    Placement.worker_id.in_([t.id for t in targets]),
                    Placement.lora_name == name,
                )
            ).all()
            have = {(r.worker_id, r.dp_group): r for r in rows}
            for target in targets:
                if not _registered(session, adapter_id, target):
                    continue
                for group in range(target.dp_size):
                    row = have.get((target.id, group))
                    if row is None:
                        version = session.get(Adapter, adapter_id).version  # type: ignore[union-attr]
                        row = new_placement(adapter_id, target.id, group, name, version, state)
                        session.add(row)
                    mark(row, state, error=None, observed=True)

    def _mark_rows(
        self,
        state: PlacementState,
        holder: ColumnElement[bool],
        name: str,
        *where: ColumnElement[bool],
    ) -> None:
        """Every row of ``name`` matching ``holder`` (its adapter's, or its worker's) and
        ``where`` moves to ``state``, in one statement."""
        with self.db.session() as session:
            mark_where(session, state, holder, Placement.lora_name == name, *where)

    def _touch(self, adapter_id: int) -> None:
        """A load counts as a use: the adapter is not the next to go."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if adapter is not None:
                adapter.last_used_at = max(adapter.last_used_at or 0.0, time.time())

    def _mark_inconsistent(self, adapter_id: int) -> None:
        """A copy stayed after a failed load's rollback: not routable, name not reusable."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if adapter is not None:
                adapter.inconsistent = True

    def _write_pinned(self, adapter_id: int, pinned: bool) -> None:
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            assert adapter is not None
            adapter.pinned = pinned

    def _write_version(self, adapter_id: int, record: dict[str, Any]) -> None:
        """The adapter record switches to the new version's fields (``NewVersion``)."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            assert adapter is not None
            for field_name, value in record.items():
                setattr(adapter, field_name, value)

    def _named(self, adapter_id: int) -> dict[str, Any]:
        """An adapter event's ``namespace`` and ``adapter`` (its name): what a client knows it
        by (the row id is the registry's own)."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if adapter is None:
                return {"namespace": None, "adapter": None}
            return {"namespace": adapter.namespace, "adapter": adapter.name}

    def _drop_rows(self, adapter_id: int, name: str, targets: Sequence[WorkerRef]) -> None:
        with self.db.session() as session:
            session.execute(
                delete(Placement).where(
                    Placement.adapter_id == adapter_id,
                    Placement.worker_id.in_([t.id for t in targets]),
                    Placement.lora_name == name,
                )
            )

    async def _load_evicting(
        self,
        target: WorkerRef,
        name: str,
        path: str,
        pinned: bool,
        victims: Sequence[str],
        evicted: list[tuple[int, str]],
    ) -> UpdateResult:
        """Load ``name`` on ``target``, which unloads ``victims`` to make room once it has
        read ``name`` on every DP group: a load that fails there (a bad file, a shape the
        base model does not have) leaves them loaded and routable. The victims that went
        are added to ``evicted`` as (adapter id, lora name), for a rollback to restore."""
        for victim in victims:  # not routed there while it may go away
            await asyncio.to_thread(
                self._mark_rows, "unloading", Placement.worker_id == target.id, victim
            )
        result = await self.client.load(target.name, target.endpoint, name, path, pinned, victims)
        seen: Observation | None = None
        if not result.success:  # which victims went: ask the worker
            try:
                seen = await self.client.observe(target.name, target.endpoint, target.dp_size)
            except WorkerUnreachable:
                seen = None
        for victim in victims:
            outcome = _victim_outcome(victim, result, seen, target.dp_size)
            pool_labels, adapter_ids = await asyncio.to_thread(
                self._after_evict, target, victim, outcome, result.error_message
            )
            if outcome != "evicted":
                continue
            evicted += [(adapter_id, victim) for adapter_id in adapter_ids]
            self.metrics.evictions.labels(*pool_labels, target.name).inc()
            await self.bus.publish(
                "adapter.evicted",
                namespace=pool_labels[0] or None,
                worker=target.name,
                lora_name=victim,
            )
        return result

    def _after_evict(
        self, target: WorkerRef, victim: str, outcome: VictimOutcome, error: str
    ) -> tuple[tuple[str, str], set[int]]:
        """The victim's rows on ``target``: dropped (evicted), loaded again (the load failed
        before evicting it) or ``inconsistent`` (unknown, or half gone: the reconciler looks);
        the (namespace, pool) of the worker, for the eviction's metric and event, and the
        ids of the adapters the rows were of."""
        with self.db.session() as session:
            worker = session.get(Worker, target.id)
            rows = session.scalars(
                select(Placement).where(
                    Placement.worker_id == target.id, Placement.lora_name == victim
                )
            ).all()
            for row in rows:
                if outcome == "evicted":
                    session.delete(row)
                elif outcome == "kept":
                    mark(row, "loaded", observed=True)
                else:
                    mark(row, "inconsistent", error=f"evicting it for a load that failed: {error}")
            pool = (worker.pool.namespace, worker.pool.name) if worker is not None else ("", "")
            return pool, {row.adapter_id for row in rows}

    async def _restore(self, target: WorkerRef, evicted: Sequence[tuple[int, str]]) -> None:
        """Load again on ``target`` the victims a rolled-back load evicted there (it succeeded
        on ``target`` and failed elsewhere), so the failed load leaves every worker as it
        found it. A victim whose adapter is gone or names another version now stays out; one
        that fails to load stays out, as evicted (the registry says so)."""
        for adapter_id, victim in evicted:
            source = await asyncio.to_thread(self._source_of, adapter_id, victim)
            if source is None:
                continue
            path, pinned = source
            result = await self.client.load(target.name, target.endpoint, victim, path, pinned)
            if not result.success:
                log.warning(
                    "could not load %s again on %s after a rolled-back load: %s",
                    victim,
                    target.name,
                    result.error_message,
                )
                continue
            await asyncio.to_thread(self._set_rows, adapter_id, victim, [target], "loaded")
            await self.bus.publish(
                "adapter.loaded",
                **await asyncio.to_thread(self._named, adapter_id),
                lora_name=victim,
                workers=[target.name],
            )

    def _source_of(self, adapter_id: int, name: str) -> tuple[str, bool] | None:
        """(path, pinned) of the adapter whose current version is ``name``, or None."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if (
                adapter is None
                or lora_name(adapter.namespace, adapter.name, adapter.version) != name
            ):
                return None
            return adapter.path, adapter.pinned

    async def _load_everywhere(
        self, op_label: str, plan: LoadPlan
    ) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        """Load ``plan.lora_name`` onto every target, all or nothing."""
        adapter_id, name, path, pinned = plan.adapter_id, plan.lora_name, plan.path, plan.pinned
        targets = list(plan.workers)
        if not targets:
            return "succeeded", UpdateResult(True), []
        evictions = {t.worker.name: list(t.evict) for t in plan.targets}
        already = plan.already_loaded
        evicted: dict[str, list[tuple[int, str]]] = {}  # per target: the victims that went

        async def load_one(target: WorkerRef) -> UpdateResult:
            if target.name in already:
                return UpdateResult(True, "", {name: path})
            if evictions.get(target.name):
                gone = evicted.setdefault(target.name, [])
                victims = evictions[target.name]
                return await self._load_evicting(target, name, path, pinned, victims, gone)
            return await self.client.load(target.name, target.endpoint, name, path, pinned)

        results, per_target = await self._fanout(op_label, targets, load_one)
        merged = merge_results(results)
        if merged.success:
            await asyncio.to_thread(self._set_rows, adapter_id, name, targets, "loaded")
            await asyncio.to_thread(self._touch, adapter_id)
            await self.bus.publish(
                "adapter.loaded",
                **await asyncio.to_thread(self._named, adapter_id),
                lora_name=name,
                workers=[t.name for t in targets],
            )
            return "succeeded", merged, per_target
        # all or nothing: unload wherever this operation may have loaded it
        touched = [t for t in targets if t.name not in already]
        await self._fanout(
            "rollback", touched, lambda t: self.client.unload(t.name, t.endpoint, name)
        )
        leftover = await self._record_observed(adapter_id, name, touched, merged.error_message)
        for target in touched:
            if evicted.get(target.name):
                await self._restore(target, evicted[target.name])
        if leftover:
            await asyncio.to_thread(self._mark_inconsistent, adapter_id)
        await self.bus.publish(
            "adapter.failed",
            **await asyncio.to_thread(self._named, adapter_id),
            lora_name=name,
            error=merged.error_message,
        )
        return ("failed" if leftover else "rolled_back"), merged, per_target

    async def _run_load(self, plan: LoadPlan) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        state, merged, per_target = await self._load_everywhere("load", plan)
        if merged.success and plan.shrink:
            await self._unload_extras(plan.adapter_id, plan.lora_name, plan.shrink)
        return state, merged, per_target

    async def _unload_extras(self, adapter_id: int, name: str, extras: Sequence[WorkerRef]) -> None:
        """Unload copies beyond a smaller ``count`` (the chosen targets hold it, so it stays
        routable). Rows go ``unloading`` first; a copy that would not go is left
        ``inconsistent`` for the reconciler, without failing the load."""
        await asyncio.to_thread(
            self._mark_rows,
            "unloading",
            Placement.adapter_id == adapter_id,
            name,
            Placement.worker_id.in_([t.id for t in extras]),
        )
        results, _ = await self._fanout(
            "unload", extras, lambda t: self.client.unload(t.name, t.endpoint, name)
        )
        gone = [t for t, r in zip(extras, results, strict=True) if r.success]
        stuck = [t for t, r in zip(extras, results, strict=True) if not r.success]
        await asyncio.to_thread(self._drop_rows, adapter_id, name, gone)
        if stuck:
            error = merge_results([r for r in results if not r.success]).error_message
            await self._record_observed(adapter_id, name, stuck, error)

    async def _run_unload(self, plan: UnloadPlan) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        adapter_id = plan.adapter_id
        targets = list(plan.workers)
        names = {t.worker.name: list(t.lora_names) for t in plan.targets}
        if targets:

            async def unload_one(target: WorkerRef) -> UpdateResult:
                results = [
                    await self.client.unload(target.name, target.endpoint, n)
                    for n in names[target.name]
                ]
                return merge_results(results) if results else UpdateResult(True)

            results, per_target = await self._fanout("unload", targets, unload_one)
            merged = merge_results(results)
        else:
            merged, per_target = UpdateResult(True), []
        leftover = False
        if merged.success:
            for n in {n for ns in names.values() for n in ns}:
                await asyncio.to_thread(self._drop_rows, adapter_id, n, targets)
        else:
            for n in {n for ns in names.values() for n in ns}:
                holders = [t for t in targets if n in names[t.name]]
                leftover = (
                    await self._record_observed(adapter_id, n, holders, merged.error_message)
                    or leftover
                )
        named = await asyncio.to_thread(self._named, adapter_id)  # (before a delete forgets it)
        namespace = await asyncio.to_thread(
            self._after_unload, adapter_id, leftover, merged.error_message, plan.then
        )
        await self.bus.publish(
            "adapter.unloaded",
            namespace=namespace,
            adapter=named["adapter"],
            lora_names=sorted({n for ns in names.values() for n in ns}),
            success=merged.success,
            inconsistent=leftover,
        )
        return ("succeeded" if merged.success else "failed"), merged, per_target

    def _after_unload(self, adapter_id: int, leftover: bool, error: str, then: str) -> str | None:
        """The adapter inconsistent while a copy is left (else deleted, with ``then``
        "delete"); its namespace (None when it was gone already)."""
        with self.db.session() as session:
            adapter = session.get(Adapter, adapter_id)
            if adapter is None:
                return None
            adapter.inconsistent = leftover
            adapter.last_error = error if leftover else None
            if then == "delete" and not leftover:
                session.delete(adapter)
            return adapter.namespace

    async def _run_pin(self, plan: PinPlan) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        """Reload the adapter with the new ``pinned`` flag on every worker that holds it."""
        adapter_id, name, path, pinned = plan.adapter_id, plan.lora_name, plan.path, plan.pinned
        targets = list(plan.targets)

        async def reload(target: WorkerRef) -> UpdateResult:
            unloaded = await self.client.unload(target.name, target.endpoint, name)
            if not unloaded.success:
                return unloaded
            loaded = await self.client.load(target.name, target.endpoint, name, path, pinned)
            if not loaded.success:  # put back what was there
                await self.client.load(target.name, target.endpoint, name, path, not pinned)
            return loaded

        # absent for a moment on every target
        await asyncio.to_thread(
            self._mark_rows, "loading", Placement.adapter_id == adapter_id, name
        )
        if targets:
            results, per_target = await self._fanout("pin", targets, reload)
            merged = merge_results(results)
        else:
            merged, per_target = UpdateResult(True), []
        if merged.success:
            await asyncio.to_thread(self._write_pinned, adapter_id, pinned)
            await asyncio.to_thread(self._set_rows, adapter_id, name, targets, "loaded")
            return "succeeded", merged, per_target
        await self._observe_rows(adapter_id, name, targets)
        return "failed", merged, per_target

    async def _observe_rows(self, adapter_id: int, name: str, targets: Sequence[WorkerRef]) -> None:
        """Rows of ``name`` follow the workers: present -> loaded, absent -> failed (the reconciler restores)."""
        observations = await asyncio.gather(*(self.observe(t) for t in targets))
        await asyncio.to_thread(self._write_seen, adapter_id, name, targets, observations)

    def _write_seen(
        self,
        adapter_id: int,
        name: str,
        targets: Sequence[WorkerRef],
        observations: Sequence[Observation | None],
    ) -> None:
        with self.db.session() as session:
            for target, seen in zip(targets, observations, strict=True):
                rows = session.scalars(
                    select(Placement).where(
                        Placement.adapter_id == adapter_id,
                        Placement.worker_id == target.id,
                        Placement.lora_name == name,
                    )
                ).all()
                present = set() if seen is None else set(seen.present_on(name))
                for row in rows:
                    mark(
                        row,
                        "loaded"
                        if row.dp_group in present
                        else ("failed" if seen else "unreachable"),
                        observed=True,
                    )

    async def _run_update_version(
        self, plan: VersionPlan
    ) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        """Make before break: load the new version everywhere, switch, then unload the old one.

        The new version loads unpinned and takes the pin once the old one is gone: both pinned
        at once could pass the workers' K - 1 pin limit."""
        if not plan.targets:  # loaded nowhere: switching the record is the whole operation
            await self._switch_version(plan)
            return "succeeded", UpdateResult(True), []
        state, merged, per_target = await self._load_everywhere("load", plan.load)
        if not merged.success:
            return state, merged, per_target
        await self._switch_version(plan)
        if plan.pinned:
            name, path = plan.lora_name, plan.path
            targets = list(plan.load.workers)
            results, _ = await self._fanout(
                "pin", targets, lambda t: self.client.load(t.name, t.endpoint, name, path, True)
            )
            pinned = merge_results(results)
            if not pinned.success:  # loaded and routable; the reconciler sets the flag later
                log.warning("pinning %s after its update failed: %s", name, pinned.error_message)
        return "succeeded", merged, per_target

    async def _switch_version(self, plan: VersionPlan) -> None:
        adapter_id = plan.adapter_id
        await asyncio.to_thread(self._write_version, adapter_id, plan.new.to_json())
        old = plan.old_lora_name
        holders = list(plan.old_targets)
        # never reported loaded while it goes away
        await asyncio.to_thread(
            self._mark_rows, "unloading", Placement.adapter_id == adapter_id, old
        )
        if holders:
            results, _ = await self._fanout(
                "unload", holders, lambda t: self.client.unload(t.name, t.endpoint, old)
            )
            if merge_results(results).success:
                await asyncio.to_thread(self._drop_rows, adapter_id, old, holders)
            else:
                await self._record_observed(adapter_id, old, holders, "old version not unloaded")

    # -- restart recovery ----------------------------------------------------------------------
    async def settle_interrupted(self) -> list[str]:
        """Finish or roll back the operations nobody runs any more (see the module docstring);
        returns the ids this call settled."""
        settled = []
        for op_id, kind, plan, restarted in await asyncio.to_thread(self._abandoned_plans):
            if op_id in self.running or not await asyncio.to_thread(self._claim, op_id):
                continue  # running here, or another replica took it over first
            self.running.add(op_id)
            try:
                log.warning("settling interrupted operation %s (%s)", op_id, kind)
                await self._settle(op_id, kind, plan, INTERRUPTED if restarted else ABANDONED)
            finally:
                self.running.discard(op_id)
            settled.append(op_id)
        return settled

    def _abandoned_plans(self) -> list[tuple[str, str, Plan, bool]]:
        """(id, kind, plan, left by this replica's previous process) of every abandoned
        operation, oldest first."""
        with self.db.session() as session:
            ops = session.scalars(
                select(Operation).where(self._abandoned()).order_by(Operation.created_at)
            ).all()
            return [
                (op.id, op.kind, plan_from_json(op.kind, op.plan), self._before_start(op))
                for op in ops
            ]

    def _before_start(self, op: Operation) -> bool:
        """Left by this replica's previous process (SQLite hands datetimes back naive, in UTC)."""
        beat = op.heartbeat_at
        if op.owner != self.owner or beat is None:
            return False
        return (beat if beat.tzinfo else beat.replace(tzinfo=UTC)) < self.started_at

    async def _settle(self, op_id: str, kind: str, plan: Plan, why: str) -> str:
        """Finish ``op_id`` from what its workers hold now: a load present everywhere succeeds,
        anything less is rolled back; an unload is run again; a pin change keeps the old flag."""
        started = time.perf_counter()
        if isinstance(plan, UnloadPlan):
            state, merged, per_target = await self._run_unload(plan)
        elif isinstance(plan, LoadPlan) and not plan.targets:
            state, merged, per_target = "succeeded", UpdateResult(True), []
        elif isinstance(plan, LoadPlan):
            state, merged, per_target = await self._settle_load(plan, why)
        elif isinstance(plan, VersionPlan):
            state, merged, per_target = await self._settle_load(plan.load, why)
            if state == "succeeded":
                await self._switch_version(plan)
        else:  # pin / unpin: keep the old flag, let rows follow the workers, the reconciler restores
            await self._observe_rows(plan.adapter_id, plan.lora_name, plan.targets)
            state, merged, per_target = "failed", UpdateResult(False, why), []
        return await self._finish(
            op_id, kind, state, merged, per_target, time.perf_counter() - started
        )

    async def _settle_load(
        self, plan: LoadPlan, why: str
    ) -> tuple[str, UpdateResult, list[dict[str, Any]]]:
        name, adapter_id = plan.lora_name, plan.adapter_id
        targets = list(plan.workers)
        observations = await asyncio.gather(*(self.observe(t) for t in targets))
        complete = all(
            seen is not None and len(seen.present_on(name)) == t.dp_size
            for t, seen in zip(targets, observations, strict=True)
        )
        per_target = [
            {
                "worker": t.name,
                "success": seen is not None and len(seen.present_on(name)) == t.dp_size,
                "error_message": "" if seen is not None else "unreachable during recovery",
                "latency_s": 0.0,
            }
            for t, seen in zip(targets, observations, strict=True)
        ]
        if complete:
            await asyncio.to_thread(self._set_rows, adapter_id, name, targets, "loaded")
            return "succeeded", UpdateResult(True, "", {name: plan.path}), per_target
        already = plan.already_loaded
        touched = [t for t in targets if t.name not in already]
        await self._fanout(
            "rollback", touched, lambda t: self.client.unload(t.name, t.endpoint, name)
        )
        leftover = await self._record_observed(adapter_id, name, touched, why)
        if leftover:
            await asyncio.to_thread(self._mark_inconsistent, adapter_id)
        return (
            ("failed" if leftover else "rolled_back"),
            UpdateResult(False, why),
            per_target,
        )
