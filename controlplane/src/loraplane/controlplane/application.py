"""The control plane's use cases: one function per thing a client asks of an adapter.

Each takes a typed command (a frozen dataclass the router builds from the request) and
returns a typed result; each refusal is a domain error (``errors``), mapped to HTTP by the
app, once. A mutation runs in three steps:

1. in one transaction: read the adapter, check it may change now, build the plan
   (``plans``), journal it (``Operations.journal``, which also claims the adapter) and move
   the adapter and its placements to their new states (``lifecycle``);
2. run the journalled operation (``Operations.run``: fan-out to the workers, merge, rows);
3. the router reads the operation back and answers.

Database calls are synchronous SQLAlchemy; every step that touches the database here runs in
a worker thread (``asyncio.to_thread``), so a slow database never stalls the event loop that
proxies streams. (SQLAlchemy's asyncio engine would need async sessions through the
registry, operations and reconciler too; see docs/adr/0016-application-layer.md.)

No FastAPI here (an import-linter contract holds that line).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import sqlalchemy.exc
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.errors import (
    Conflict,
    NoCapacity,
    NotFound,
    PinLimit,
    Unavailable,
    conflict,
)
from loraplane.controlplane.lifecycle import registered, start_loading, start_unloading
from loraplane.controlplane.models import Adapter, Operation, Pool
from loraplane.controlplane.operations import request_hash
from loraplane.controlplane.plans import (
    LoadPlan,
    NewVersion,
    PinPlan,
    UnloadPlan,
    UnloadTarget,
    VersionPlan,
    WorkerRef,
)
from loraplane.controlplane.registry import get_adapter, get_pool, lora_name, routable_workers
from loraplane.controlplane.services import Services
from loraplane.controlplane.sources import AdapterFacts, SourceCredentials, pool_limits
from loraplane.rules.pins import RULE, max_pinned

LoadPolicy = Literal["OnDemand", "Explicit"]
ON_DEMAND_POLL_S = 0.05  # how often an on-demand load looks again while another operation runs


# -- commands and results --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Idempotency:
    """The client's ``Idempotency-Key`` (None: a fresh one) and the hash of its request: the
    same key with the same request in the same namespace answers the journalled operation
    again. Keys are per namespace: one tenant's key never meets another's."""

    key: str | None
    request_hash: str


@dataclass(frozen=True, slots=True)
class Source:
    uri: str
    sha256: str | None
    credentials: SourceCredentials | None  # for the preflight only: never stored


@dataclass(frozen=True, slots=True)
class Register:
    namespace: str
    name: str
    pool: str
    source: Source
    pinned: bool
    placement_count: int | None  # None: every ready worker
    priority: int
    load: bool
    load_policy: LoadPolicy
    idempotency: Idempotency


@dataclass(frozen=True, slots=True)
class Load:
    namespace: str
    name: str
    # None: keep the adapter's placement; otherwise the new one (its count, None for all)
    placement: tuple[int | None] | None
    idempotency: Idempotency


@dataclass(frozen=True, slots=True)
class Unload:
    namespace: str
    name: str
    delete: bool  # delete the record once nothing is left anywhere
    idempotency: Idempotency


@dataclass(frozen=True, slots=True)
class SetPinned:
    """PATCH: ``priority`` and ``load_policy`` change at once; a changed ``pinned`` flag is an
    operation (the adapter is reloaded with it on every worker that holds it)."""

    namespace: str
    name: str
    pinned: bool | None
    priority: int | None
    load_policy: LoadPolicy | None
    idempotency: Idempotency


@dataclass(frozen=True, slots=True)
class UpdateVersion:
    namespace: str
    name: str
    source: Source
    idempotency: Idempotency


@dataclass(frozen=True, slots=True)
class EnsureLoaded:
    """A routed request for an adapter no ready worker holds: load it onto one more worker."""

    adapter_id: int


@dataclass(frozen=True, slots=True)
class OperationDone:
    """The journalled operation a mutation ran (or, for a repeated request, ran before); None
    when nothing needed one (a PATCH that changed no pin)."""

    operation_id: str | None
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Loaded:
    state: Literal["succeeded"]


# -- shared steps ----------------------------------------------------------------------------
def _replayed(services: Services, namespace: str, idempotency: Idempotency) -> str | None:
    """The operation an earlier request with the same key in ``namespace`` journalled (409 if
    its body differed)."""
    if idempotency.key is None:
        return None
    with services.db.session() as session:
        op = services.operations.existing(
            session, namespace, idempotency.key, idempotency.request_hash
        )
        return op.id if op is not None else None


async def _once(
    services: Services,
    namespace: str,
    name: str,
    idempotency: Idempotency,
    fresh: Callable[[], Awaitable[OperationDone]],
) -> OperationDone:
    """Answer a request once per key: the journalled operation of an earlier request with
    the key, else ``fresh()``. A request that loses the race to a concurrent one with the same
    key and body answers the winner's operation as a replay would: where its checks or its
    journal refused (the adapter exists, is busy, is gone after the winner's delete, the key
    is taken), or where it found nothing left to do (the winner changed the pin)."""

    async def winner() -> str | None:
        return await asyncio.to_thread(_replayed, services, namespace, idempotency)

    replay = await winner()
    if replay is not None:
        return OperationDone(replay, namespace, name)
    try:
        done = await fresh()
    except (Conflict, NotFound, sqlalchemy.exc.IntegrityError):
        if idempotency.key is None or (replay := await winner()) is None:
            raise
        return OperationDone(replay, namespace, name)
    if (
        done.operation_id is None
        and idempotency.key is not None
        and (replay := await winner()) is not None
    ):
        return OperationDone(replay, namespace, name)
    return done


async def _run(services: Services, op_id: str, namespace: str, name: str) -> OperationDone:
    # shielded: a client that goes away does not cancel an operation half way
    await asyncio.shield(asyncio.ensure_future(services.operations.run(op_id)))
    return OperationDone(op_id, namespace, name)


def _journal(
    services: Services,
    session: Session,
    idempotency: Idempotency,
    kind: str,
    adapter: Adapter,
    plan: LoadPlan | VersionPlan | UnloadPlan | PinPlan,
) -> str:
    op = services.operations.journal(
        session,
        key=idempotency.key,
        hash_=idempotency.request_hash,
        kind=kind,
        adapter=adapter,
        plan=plan,
    )
    return op.id


def ensure_usable(adapter: Adapter, *, deleting: bool = False) -> None:
    """Refuse a mutation of an adapter that is going away or in another operation; a delete may
    be sent again (a failed delete is retried by deleting again)."""
    if adapter.desired == "deleted" and not deleting:
        raise conflict(
            f"adapter {adapter.key} is being deleted; send DELETE again to retry a failed delete",
            code="conflict",
        )
    if adapter.busy_operation_id:
        raise conflict(
            f"adapter {adapter.key} has operation {adapter.busy_operation_id} in progress; retry when it finishes",
            code="operation_in_progress",
        )


def check_pinnable(pool: Pool, *, detail: bool = False) -> None:
    """A pool whose workers have one GPU slot can pin nothing (at most K - 1 pinned)."""
    if max_pinned(pool.max_loras_per_batch) < 1:
        raise PinLimit(
            f"pool {pool.name} has max_loras_per_batch={pool.max_loras_per_batch}; pinning needs at least 2"
            + (f" ({RULE} pinned per worker)" if detail else ""),
            field="body.pinned",
        )


def _pool_snapshot(pool: Pool) -> Pool:
    """What the preflight needs of a pool, detached from the session it was read in."""
    return Pool(
        model=pool.model, max_lora_rank=pool.max_lora_rank, target_modules=pool.target_modules
    )


def _still_fits(
    session: Session, pool_id: int, checked: Pool, facts: AdapterFacts, field: str
) -> None:
    """The pool, read again with a share lock held until the journal commits, still takes
    the adapter its preflight checked: the same base model, a rank and modules within its
    limits. A PUT that tightened them while the source was fetched (``pools.check_live`` did
    not see this adapter yet) refuses the request instead of recording an adapter the new
    limits break; a PUT waits for this journal, or this journal for it. On PostgreSQL the
    lock makes that exact; SQLite drops ``FOR UPDATE``, so there a PUT that checked before
    this read and commits after it can still pass."""
    pool = session.get(Pool, pool_id, with_for_update={"read": True}, populate_existing=True)
    if pool is None:  # an empty pool, deleted while the source was fetched
        raise NotFound("the pool was deleted while the adapter's source was checked", field=field)
    limits = pool_limits(pool.model, pool.max_lora_rank, pool.target_modules)
    if (
        pool.model != checked.model
        or facts.rank > limits.max_lora_rank
        or not set(facts.target_modules) <= set(limits.target_modules)
    ):
        raise conflict(
            f"pool {pool.namespace}/{pool.name} changed while the adapter's source was checked "
            f"(model {pool.model!r}, max_lora_rank={pool.max_lora_rank}, target_modules="
            f"{list(limits.target_modules)}); send the request again",
            code="pool_changed",
            field=field,
        )


def version_record(version: int, source: Source, facts: AdapterFacts) -> NewVersion:
    """The adapter record's fields for ``version`` from ``source`` and what its preflight found."""
    return NewVersion(
        version=version,
        source_uri=source.uri,
        source_sha256=source.sha256.lower() if source.sha256 else None,
        path=facts.path,
        digest=facts.digest,
        rank=facts.rank,
        alpha=facts.alpha,
        target_modules=tuple(facts.target_modules),
        base_model=facts.base_model,
    )


async def _preflight(services: Services, pool: Pool, source: Source) -> AdapterFacts:
    limits = pool_limits(pool.model, pool.max_lora_rank, pool.target_modules)
    return await asyncio.to_thread(
        services.sources.resolve, source.uri, source.sha256, limits, source.credentials
    )


# -- register --------------------------------------------------------------------------------
async def register(services: Services, command: Register) -> OperationDone:
    """Record a new adapter (after the preflight of its source) and, with ``load``, load it."""

    async def fresh() -> OperationDone:
        pool_id, pool = await asyncio.to_thread(_check_registrable, services, command)
        facts = await _preflight(services, pool, command.source)
        await services.usage.flush()  # the evictions its load may plan read the LRU order
        op_id = await asyncio.to_thread(_journal_register, services, command, pool_id, pool, facts)
        return await _run(services, op_id, command.namespace, command.name)

    return await _once(services, command.namespace, command.name, command.idempotency, fresh)


def _check_registrable(services: Services, command: Register) -> tuple[int, Pool]:
    with services.db.session() as session:
        pool = get_pool(session, command.namespace, command.pool, field="body.pool")
        existing = session.scalar(
            select(Adapter).where(
                Adapter.namespace == command.namespace, Adapter.name == command.name
            )
        )
        if existing is not None:
            why = (
                " (it is inconsistent: an unload failed; the name is not reusable until that settles)"
                if existing.inconsistent
                else ""
            )
            raise conflict(
                f"adapter {command.namespace}/{command.name} already exists{why}",
                field="body.name",
            )
        if command.pinned:
            check_pinnable(pool, detail=True)
        return pool.id, _pool_snapshot(pool)


def _journal_register(
    services: Services, command: Register, pool_id: int, checked: Pool, facts: AdapterFacts
) -> str:
    with services.db.session() as session:
        _still_fits(session, pool_id, checked, facts, "body.pool")
        adapter = Adapter(
            namespace=command.namespace,
            name=command.name,
            pool_id=pool_id,
            **version_record(1, command.source, facts).to_json(),
            pinned=command.pinned,
            placement_count=command.placement_count,
            priority=command.priority,
            load_policy=command.load_policy,
            last_used_at=0.0,
            **registered(command.load),
        )
        session.add(adapter)
        try:
            session.flush()
        except sqlalchemy.exc.IntegrityError as exc:  # a concurrent registration won the name
            raise conflict(
                f"adapter {command.namespace}/{command.name} already exists", field="body.name"
            ) from exc
        session.refresh(adapter)
        plan = LoadPlan(
            adapter.id, lora_name(adapter.namespace, adapter.name, 1), adapter.path, adapter.pinned
        )
        ready = [w for w in adapter.pool.workers if w.state == "ready"]
        if command.load and ready:
            plan = services.operations.plan_load(
                session, adapter, adapter.placement_count, pin_field="body.pinned"
            )
        op_id = _journal(services, session, command.idempotency, "register", adapter, plan)
        services.operations.add_loading_rows(session, adapter, plan)
        start_loading(adapter, registering=True)
        return op_id


# -- load ------------------------------------------------------------------------------------
async def load(services: Services, command: Load) -> OperationDone:
    """Load the adapter's current version onto its placement (all ready workers or a count);
    a smaller count than it holds unloads the extra copies once the load succeeded."""

    async def fresh() -> OperationDone:
        await services.usage.flush()  # the evictions it may plan read the LRU order
        op_id = await asyncio.to_thread(_journal_load, services, command)
        return await _run(services, op_id, command.namespace, command.name)

    return await _once(services, command.namespace, command.name, command.idempotency, fresh)


def _journal_load(services: Services, command: Load) -> str:
    with services.db.session() as session:
        adapter = get_adapter(session, command.namespace, command.name)
        ensure_usable(adapter)
        if adapter.inconsistent:
            raise conflict(
                f"adapter {adapter.key} is inconsistent (an unload failed on some worker); unload it again or "
                "wait for the reconciler",
                code="inconsistent",
            )
        count = adapter.placement_count if command.placement is None else command.placement[0]
        plan = services.operations.plan_load(
            session, adapter, count, shrink=command.placement is not None
        )
        op_id = _journal(services, session, command.idempotency, "load", adapter, plan)
        adapter.placement_count = count
        start_loading(adapter)
        services.operations.add_loading_rows(session, adapter, plan)
        return op_id


# -- ensure loaded (the router's on-demand load) ---------------------------------------------
async def ensure_loaded(services: Services, command: EnsureLoaded) -> Loaded:
    """Make the adapter routable: loaded onto one more worker (LRU eviction there), journalled
    like any load. Concurrent calls for one adapter join the same load; while another
    operation holds the adapter this waits for it and looks again."""
    task = services.on_demand.get(command.adapter_id)
    if task is None or task.done():
        task = asyncio.ensure_future(_load_one_more(services, command.adapter_id))
        services.on_demand[command.adapter_id] = task
    await asyncio.shield(task)
    return Loaded("succeeded")


async def _load_one_more(services: Services, adapter_id: int) -> str:
    await services.usage.flush()  # the eviction it may plan reads the LRU order
    while True:
        step = await asyncio.to_thread(_journal_on_demand, services, adapter_id)
        if step is not None:
            break
        await asyncio.sleep(ON_DEMAND_POLL_S)
    if step == "routable":
        return "succeeded"
    op_id, pool_name = step
    await services.operations.run(op_id)
    return await asyncio.to_thread(_on_demand_outcome, services, op_id, pool_name)


def _journal_on_demand(
    services: Services, adapter_id: int
) -> tuple[str, str] | Literal["routable"] | None:
    """Journal the load: (operation, pool); "routable" if a worker holds it now; None while
    another operation holds the adapter."""
    with services.db.session() as session:
        adapter = session.get(Adapter, adapter_id)
        if adapter is None:
            raise NotFound("adapter was deleted while loading")
        if routable_workers(adapter):
            return "routable"
        if adapter.busy_operation_id:
            return None
        if adapter.inconsistent:
            raise Unavailable(
                f"adapter {adapter.key} is inconsistent until the reconciler settles it",
                code="inconsistent",
            )
        try:
            plan = services.operations.plan_load(session, adapter, 1)
        except (NoCapacity, PinLimit) as exc:
            services.metrics.on_demand_loads.labels(
                adapter.namespace, adapter.pool.name, "no_capacity"
            ).inc()
            no_worker = isinstance(exc, NoCapacity) and exc.no_worker
            raise Unavailable(
                f"cannot load {adapter.key} on demand: {exc.message}",
                code="no_worker" if no_worker else "no_capacity",
            ) from exc
        op_id = _journal(
            services,
            session,
            Idempotency(None, request_hash("on_demand", adapter_id)),
            "load",
            adapter,
            plan,
        )
        start_loading(adapter)
        services.operations.add_loading_rows(session, adapter, plan)
        return op_id, adapter.pool.name


def _on_demand_outcome(services: Services, op_id: str, pool_name: str) -> str:
    with services.db.session() as session:
        op = session.get(Operation, op_id)
        assert op is not None
        services.metrics.on_demand_loads.labels(op.namespace, pool_name, op.state).inc()
        if op.state != "succeeded":
            raise Unavailable(f"on-demand load failed: {op.error}", code="on_demand_failed")
        return op.state


# -- unload and delete -----------------------------------------------------------------------
async def unload(services: Services, command: Unload) -> OperationDone:
    """Unload every version of the adapter everywhere; with ``delete``, then delete it."""

    async def fresh() -> OperationDone:
        op_id = await asyncio.to_thread(_journal_unload, services, command)
        return await _run(services, op_id, command.namespace, command.name)

    return await _once(services, command.namespace, command.name, command.idempotency, fresh)


def unload_plan(adapter: Adapter, then: Literal["keep", "delete"]) -> UnloadPlan:
    workers: dict[int, WorkerRef] = {}
    names: dict[int, list[str]] = {}
    for placement in adapter.placements:
        workers.setdefault(placement.worker_id, WorkerRef.of(placement.worker))
        held = names.setdefault(placement.worker_id, [])
        if placement.lora_name not in held:
            held.append(placement.lora_name)
    targets = sorted(
        (UnloadTarget(worker, tuple(names[worker_id])) for worker_id, worker in workers.items()),
        key=lambda t: t.worker.name,
    )
    return UnloadPlan(adapter.id, tuple(targets), then)


def _journal_unload(services: Services, command: Unload) -> str:
    with services.db.session() as session:
        adapter = get_adapter(session, command.namespace, command.name)
        ensure_usable(adapter, deleting=command.delete)
        plan = unload_plan(adapter, "delete" if command.delete else "keep")
        kind = "delete" if command.delete else "unload"
        op_id = _journal(services, session, command.idempotency, kind, adapter, plan)
        start_unloading(adapter, delete=command.delete)
        return op_id


# -- set pinned (PATCH) ----------------------------------------------------------------------
async def set_pinned(services: Services, command: SetPinned) -> OperationDone:

    async def fresh() -> OperationDone:
        op_id = await asyncio.to_thread(_journal_pin, services, command)
        if op_id is None:
            return OperationDone(None, command.namespace, command.name)
        return await _run(services, op_id, command.namespace, command.name)

    return await _once(services, command.namespace, command.name, command.idempotency, fresh)


def _journal_pin(services: Services, command: SetPinned) -> str | None:
    with services.db.session() as session:
        adapter = get_adapter(session, command.namespace, command.name)
        ensure_usable(adapter)
        if command.priority is not None:
            adapter.priority = command.priority
        if command.load_policy is not None:
            adapter.load_policy = command.load_policy
        if command.pinned is None or command.pinned == adapter.pinned:
            return None
        current = lora_name(adapter.namespace, adapter.name, adapter.version)
        holders = {p.worker_id: p.worker for p in adapter.placements if p.lora_name == current}
        if command.pinned:
            check_pinnable(adapter.pool)
            # loaded nowhere: the pin must fit wherever a load may put it, every ready worker
            # of the pool (else it would take the last unpinned slot of one when it loads)
            targets = list(holders.values()) or [
                w for w in adapter.pool.workers if w.state == "ready"
            ]
            services.operations.check_pin_targets(session, adapter, targets)
        plan = PinPlan(
            adapter.id,
            current,
            adapter.path,
            command.pinned,
            tuple(WorkerRef.of(w) for w in sorted(holders.values(), key=lambda w: w.name)),
        )
        kind = "pin" if command.pinned else "unpin"
        return _journal(services, session, command.idempotency, kind, adapter, plan)


# -- new version -----------------------------------------------------------------------------
async def update_version(services: Services, command: UpdateVersion) -> OperationDone:
    """Make before break: the new version loads beside the old one wherever the old one is,
    the record switches, then the old version goes."""

    async def fresh() -> OperationDone:
        pool = await asyncio.to_thread(_version_pool, services, command)
        facts = await _preflight(services, pool, command.source)
        await services.usage.flush()  # the evictions it may plan read the LRU order
        op_id = await asyncio.to_thread(_journal_version, services, command, pool, facts)
        return await _run(services, op_id, command.namespace, command.name)

    return await _once(services, command.namespace, command.name, command.idempotency, fresh)


def _version_pool(services: Services, command: UpdateVersion) -> Pool:
    with services.db.session() as session:
        adapter = get_adapter(session, command.namespace, command.name)
        ensure_usable(adapter)
        return _pool_snapshot(adapter.pool)


def _journal_version(
    services: Services, command: UpdateVersion, checked: Pool, facts: AdapterFacts
) -> str:
    with services.db.session() as session:
        adapter = get_adapter(session, command.namespace, command.name)
        _still_fits(session, adapter.pool_id, checked, facts, "body.source")
        ensure_usable(adapter)
        if adapter.inconsistent:
            raise conflict(
                f"adapter {adapter.key} is inconsistent; settle it first", code="inconsistent"
            )
        old = lora_name(adapter.namespace, adapter.name, adapter.version)
        new_version = adapter.version + 1
        new_name = lora_name(adapter.namespace, adapter.name, new_version)
        holders = sorted(
            {p.worker_id: p.worker for p in adapter.placements if p.lora_name == old}.values(),
            key=lambda w: w.name,
        )
        targets = services.operations.plan_beside(
            [w for w in holders if w.state == "ready"], keep=(old, new_name)
        )
        plan = VersionPlan(
            adapter.id,
            new_name,
            facts.path,
            adapter.pinned,
            targets,
            old,
            tuple(WorkerRef.of(w) for w in holders),
            version_record(new_version, command.source, facts),
        )
        op_id = _journal(services, session, command.idempotency, "update_version", adapter, plan)
        services.operations.add_loading_rows(session, adapter, plan, version=new_version)
        return op_id
