"""Adapters: register, load, unload, pin/unpin, new version, delete. Every mutation is journalled."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import sqlalchemy.exc
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.auth import Principal
from loraplane.controlplane.deps import (
    Admin,
    IdempotencyKey,
    Reader,
    Services,
    ServicesDep,
    check_namespace,
)
from loraplane.controlplane.errors import conflict
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
from loraplane.controlplane.registry import (
    adapter_json,
    adapter_phase,
    check_label,
    get_adapter,
    get_pool,
    lora_name,
    operation_json,
)
from loraplane.controlplane.sources import (
    AdapterFacts,
    SourceCredentials,
    check_credentials,
    pool_limits,
)

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


Secret = Annotated[SecretStr, Field(min_length=1, max_length=8192)]


class CredentialsSpec(BaseModel):
    """Per-adapter credentials for fetching the source: used by the preflight only, never
    stored, never logged, not part of the idempotency hash (SecretStr hides them in reprs)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    aws_access_key_id: Secret | None = Field(None, description="s3:// (with the secret key)")
    aws_secret_access_key: Secret | None = Field(None, description="s3:// (with the key id)")
    aws_session_token: Secret | None = Field(None, description="s3://, optional")
    token: Secret | None = Field(
        None, description="http(s):// and hf://: sent as `Authorization: Bearer <token>`"
    )

    def for_fetch(self) -> SourceCredentials:
        return SourceCredentials(
            aws_access_key_id=self.aws_access_key_id,
            aws_secret_access_key=self.aws_secret_access_key,
            aws_session_token=self.aws_session_token,
            token=self.token,
        )


class SourceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    uri: str = Field(min_length=1, max_length=2048)
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="sha256 of adapter_model.safetensors"
    )
    credentials: CredentialsSpec | None = Field(
        None, description="fetch this source with these instead of the control plane's own"
    )

    def fetch_credentials(self) -> SourceCredentials | None:
        """The credentials for the preflight; 400 naming the key if they do not fit the URI."""
        credentials = self.credentials.for_fetch() if self.credentials is not None else None
        check_credentials(self.uri, credentials)
        return credentials


# What the idempotency hash of a request with a source covers: everything but the credentials
# (a retry with rotated credentials is the same request; no digest of a secret is stored).
UNHASHED = {"source": {"credentials"}}


class PlacementCount(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    count: int = Field(ge=1, le=10_000)


Placement = Literal["all"] | PlacementCount


LoadPolicy = Annotated[
    Literal["OnDemand", "Explicit"],
    Field(
        description="OnDemand: a routed request for it loads it where it is not loaded; "
        "Explicit: only a load (registration, POST .../load) does, and the router refuses "
        "requests while it is loaded nowhere"
    ),
]


class AdapterCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    namespace: str = "default"
    name: str
    pool: str
    source: SourceSpec
    pinned: bool = False
    placement: Placement = "all"
    priority: int = Field(0, ge=-1000, le=1000)
    load: bool = True
    load_policy: LoadPolicy = "OnDemand"


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    placement: Placement | None = None


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    pinned: bool | None = None
    priority: int | None = Field(None, ge=-1000, le=1000)
    load_policy: LoadPolicy | None = None


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    source: SourceSpec


def count_of(placement: Placement) -> int | None:
    return None if placement == "all" else placement.count  # type: ignore[union-attr]


async def preflight(
    services: Services, pool: Pool, source: SourceSpec, credentials: SourceCredentials | None
) -> AdapterFacts:
    limits = pool_limits(pool.model, pool.max_lora_rank, pool.target_modules)
    return await asyncio.to_thread(
        services.sources.resolve, source.uri, source.sha256, limits, credentials
    )


def respond(
    session: Session, op: Operation, status_ok: int, include_adapter: bool = True
) -> JSONResponse:
    """The answer to a mutation: adapter and operation, 502 if the fan-out failed."""
    body: dict[str, Any] = {"operation": operation_json(op)}
    adapter = session.scalar(
        select(Adapter).where(Adapter.namespace == op.namespace, Adapter.name == op.adapter_name)
    )
    if include_adapter and adapter is not None:
        session.refresh(adapter)
        body["adapter"] = adapter_json(adapter)
    if op.state in ("failed", "rolled_back"):
        body["error"] = {
            "code": op.error_code or "fanout_failed",
            "field": None,
            "message": op.error or "the operation failed on a worker without a message",
        }
        return JSONResponse(body, status_code=502)
    if op.state in ("pending", "running"):
        return JSONResponse(body, status_code=202)
    return JSONResponse(body, status_code=status_ok)


async def replay_or(
    services: Services, key: str | None, hash_: str, status_ok: int
) -> JSONResponse | None:
    if key is None:
        return None
    with services.db.session() as session:
        op = services.operations.existing(session, key, hash_)
        if op is None:
            return None
        return respond(session, op, status_ok)


async def run_and_respond(services: Services, op_id: str, status_ok: int) -> JSONResponse:
    # shielded: a client that goes away does not cancel an operation half way
    await asyncio.shield(asyncio.ensure_future(services.operations.run(op_id)))
    with services.db.session() as session:
        op = session.get(Operation, op_id)
        assert op is not None
        return respond(session, op, status_ok)


def visible(principal: Principal, namespace: str) -> None:
    check_namespace(principal, namespace)


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


@router.get("")
def list_adapters(
    services: ServicesDep,
    principal: Reader,
    namespace: str | None = None,
    pool: str | None = None,
    phase: str | None = Query(
        None, pattern="^(Pending|Loading|Ready|Degraded|Failed|Unloading|Unloaded)$"
    ),
) -> dict[str, Any]:
    with services.db.session() as session:
        query = select(Adapter).join(Pool).order_by(Adapter.namespace, Adapter.name)
        if namespace is not None:
            check_namespace(principal, namespace, "query.namespace")
            query = query.where(Adapter.namespace == namespace)
        if pool is not None:
            query = query.where(Pool.name == pool)
        adapters = [a for a in session.scalars(query).all() if principal.sees(a.namespace)]
        items = [adapter_json(a) for a in adapters if phase is None or adapter_phase(a) == phase]
    return {"items": items}


@router.get("/{namespace}/{name}")
def read_adapter(
    namespace: str, name: str, services: ServicesDep, principal: Reader
) -> dict[str, Any]:
    visible(principal, namespace)
    with services.db.session() as session:
        return adapter_json(get_adapter(session, namespace, name))


@router.post("", status_code=201)
async def register_adapter(
    body: AdapterCreate, services: ServicesDep, principal: Admin, key: IdempotencyKey = None
) -> JSONResponse:
    check_label(body.namespace, "body.namespace")
    check_label(body.name, "body.name")
    check_namespace(principal, body.namespace, "body.namespace")
    credentials = body.source.fetch_credentials()
    hash_ = request_hash("register", body.model_dump(mode="json", exclude=UNHASHED))
    replay = await replay_or(services, key, hash_, 201)
    if replay is not None:
        return replay
    with services.db.session() as session:
        pool = get_pool(session, body.namespace, body.pool, field="body.pool")
        existing = session.scalar(
            select(Adapter).where(Adapter.namespace == body.namespace, Adapter.name == body.name)
        )
        if existing is not None:
            why = (
                " (it is inconsistent: an unload failed; the name is not reusable until that settles)"
                if (existing.inconsistent)
                else ""
            )
            raise conflict(
                f"adapter {body.namespace}/{body.name} already exists{why}", field="body.name"
            )
        if body.pinned and pool.max_loras_per_batch < 2:
            raise conflict(
                f"pool {pool.name} has max_loras_per_batch={pool.max_loras_per_batch}; pinning needs at least 2 "
                "(at most max_loras_per_batch - 1 pinned per worker)",
                code="too_many_pinned",
                field="body.pinned",
            )
        pool_id = pool.id
        pool_snapshot = Pool(
            model=pool.model, max_lora_rank=pool.max_lora_rank, target_modules=pool.target_modules
        )
    facts = await preflight(services, pool_snapshot, body.source, credentials)
    with services.db.session() as session:
        adapter = Adapter(
            namespace=body.namespace,
            name=body.name,
            pool_id=pool_id,
            source_uri=body.source.uri,
            source_sha256=body.source.sha256.lower() if body.source.sha256 else None,
            path=facts.path,
            digest=facts.digest,
            rank=facts.rank,
            alpha=facts.alpha,
            target_modules=list(facts.target_modules),
            base_model=facts.base_model,
            pinned=body.pinned,
            placement_count=count_of(body.placement),
            priority=body.priority,
            load_policy=body.load_policy,
            version=1,
            last_used_at=0.0,
            **registered(body.load),
        )
        session.add(adapter)
        try:
            session.flush()
        except sqlalchemy.exc.IntegrityError as exc:  # a concurrent registration won the name
            raise conflict(
                f"adapter {body.namespace}/{body.name} already exists", field="body.name"
            ) from exc
        session.refresh(adapter)
        plan = LoadPlan(
            adapter.id, lora_name(adapter.namespace, adapter.name, 1), adapter.path, adapter.pinned
        )
        ready = [w for w in adapter.pool.workers if w.state == "ready"]
        if body.load and ready:
            plan = services.operations.plan_load(session, adapter, adapter.placement_count)
        op = services.operations.journal(
            session,
            key=key,
            hash_=hash_,
            kind="register",
            adapter=adapter,
            plan=plan,
        )
        services.operations.add_loading_rows(session, adapter, plan)
        start_loading(adapter, registering=True)
        op_id = op.id
    return await run_and_respond(services, op_id, 201)


@router.post("/{namespace}/{name}/load")
async def load_adapter(
    namespace: str,
    name: str,
    services: ServicesDep,
    principal: Admin,
    body: LoadRequest | None = None,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    body = body or LoadRequest()
    hash_ = request_hash("load", [namespace, name, body.model_dump(mode="json")])
    replay = await replay_or(services, key, hash_, 200)
    if replay is not None:
        return replay
    with services.db.session() as session:
        adapter = get_adapter(session, namespace, name)
        ensure_usable(adapter)
        if adapter.inconsistent:
            raise conflict(
                f"adapter {adapter.key} is inconsistent (an unload failed on some worker); unload it again or "
                "wait for the reconciler",
                code="inconsistent",
            )
        count = adapter.placement_count if body.placement is None else count_of(body.placement)
        plan = services.operations.plan_load(
            session, adapter, count, shrink=body.placement is not None
        )
        op = services.operations.journal(
            session,
            key=key,
            hash_=hash_,
            kind="load",
            adapter=adapter,
            plan=plan,
        )
        adapter.placement_count = count
        start_loading(adapter)
        services.operations.add_loading_rows(session, adapter, plan)
        op_id = op.id
    return await run_and_respond(services, op_id, 200)


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


async def _unload(
    namespace: str, name: str, services: Services, principal: Principal, key: str | None, kind: str
) -> JSONResponse:
    visible(principal, namespace)
    hash_ = request_hash(kind, [namespace, name])
    replay = await replay_or(services, key, hash_, 200)
    if replay is not None:
        return replay
    with services.db.session() as session:
        adapter = get_adapter(session, namespace, name)
        ensure_usable(adapter, deleting=kind == "delete")
        plan = unload_plan(adapter, "delete" if kind == "delete" else "keep")
        op = services.operations.journal(
            session,
            key=key,
            hash_=hash_,
            kind=kind,
            adapter=adapter,
            plan=plan,
        )
        start_unloading(adapter, delete=kind == "delete")
        op_id = op.id
    return await run_and_respond(services, op_id, 200)


@router.post("/{namespace}/{name}/unload")
async def unload_adapter(
    namespace: str, name: str, services: ServicesDep, principal: Admin, key: IdempotencyKey = None
) -> JSONResponse:
    return await _unload(namespace, name, services, principal, key, "unload")


@router.delete("/{namespace}/{name}")
async def delete_adapter(
    namespace: str, name: str, services: ServicesDep, principal: Admin, key: IdempotencyKey = None
) -> JSONResponse:
    return await _unload(namespace, name, services, principal, key, "delete")


@router.patch("/{namespace}/{name}")
async def patch_adapter(
    namespace: str,
    name: str,
    body: AdapterPatch,
    services: ServicesDep,
    principal: Admin,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    hash_ = request_hash("patch", [namespace, name, body.model_dump(mode="json")])
    replay = await replay_or(services, key, hash_, 200)
    if replay is not None:
        return replay
    with services.db.session() as session:
        adapter = get_adapter(session, namespace, name)
        ensure_usable(adapter)
        if body.priority is not None:
            adapter.priority = body.priority
        if body.load_policy is not None:
            adapter.load_policy = body.load_policy
        if body.pinned is None or body.pinned == adapter.pinned:
            session.flush()
            return JSONResponse({"adapter": adapter_json(adapter), "operation": None})
        current = lora_name(adapter.namespace, adapter.name, adapter.version)
        holders = {p.worker_id: p.worker for p in adapter.placements if p.lora_name == current}
        if body.pinned:
            if adapter.pool.max_loras_per_batch < 2:
                raise conflict(
                    f"pool {adapter.pool.name} has max_loras_per_batch={adapter.pool.max_loras_per_batch}; "
                    "pinning needs at least 2",
                    code="too_many_pinned",
                    field="body.pinned",
                )
            services.operations.check_pin_targets(session, adapter, list(holders.values()))
        plan = PinPlan(
            adapter.id,
            current,
            adapter.path,
            body.pinned,
            tuple(WorkerRef.of(w) for w in sorted(holders.values(), key=lambda w: w.name)),
        )
        op = services.operations.journal(
            session,
            key=key,
            hash_=hash_,
            kind="pin" if body.pinned else "unpin",
            adapter=adapter,
            plan=plan,
        )
        op_id = op.id
    return await run_and_respond(services, op_id, 200)


@router.post("/{namespace}/{name}/version")
async def update_version(
    namespace: str,
    name: str,
    body: VersionRequest,
    services: ServicesDep,
    principal: Admin,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    credentials = body.source.fetch_credentials()
    hash_ = request_hash(
        "update_version", [namespace, name, body.model_dump(mode="json", exclude=UNHASHED)]
    )
    replay = await replay_or(services, key, hash_, 200)
    if replay is not None:
        return replay
    with services.db.session() as session:
        adapter = get_adapter(session, namespace, name)
        ensure_usable(adapter)
        pool = adapter.pool
        pool_snapshot = Pool(
            model=pool.model, max_lora_rank=pool.max_lora_rank, target_modules=pool.target_modules
        )
    facts = await preflight(services, pool_snapshot, body.source, credentials)
    with services.db.session() as session:
        adapter = get_adapter(session, namespace, name)
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
            NewVersion(
                version=new_version,
                source_uri=body.source.uri,
                source_sha256=body.source.sha256.lower() if body.source.sha256 else None,
                path=facts.path,
                digest=facts.digest,
                rank=facts.rank,
                alpha=facts.alpha,
                target_modules=tuple(facts.target_modules),
                base_model=facts.base_model,
            ),
        )
        op = services.operations.journal(
            session,
            key=key,
            hash_=hash_,
            kind="update_version",
            adapter=adapter,
            plan=plan,
        )
        services.operations.add_loading_rows(session, adapter, plan, version=new_version)
        op_id = op.id
    return await run_and_respond(services, op_id, 200)
