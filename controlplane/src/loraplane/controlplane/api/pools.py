"""Pools: a set of identical workers and their slot limits."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from pydantic import Field
from sqlalchemy import select

from loraplane.controlplane.api.bodies import Body, NoFields
from loraplane.controlplane.deps import ClusterAdmin, Reader, SessionDep, check_namespace
from loraplane.controlplane.errors import PinLimit, bad_value, conflict
from loraplane.controlplane.models import Pool
from loraplane.controlplane.registry import check_label, get_pool, pool_json, worker_loaded
from loraplane.controlplane.sources import DEFAULT_TARGET_MODULES, same_model
from loraplane.rules.pins import RULE, max_pinned

router = APIRouter(prefix="/v1/pools", tags=["pools"])


class PoolSpec(Body):
    model: str = Field(
        min_length=1, max_length=1024, description="path or URI of the base checkpoint"
    )
    tp: int = Field(1, ge=1, le=64)
    dp: int = Field(1, ge=1, le=64)
    max_loras_per_batch: int = Field(ge=1, le=1024, description="K: GPU slots per worker")
    max_loaded_loras: int = Field(ge=1, le=100_000, description="M: resident adapters per worker")
    max_lora_rank: int = Field(ge=1, le=1024)
    target_modules: list[str] | None = Field(
        None, description=f"allowed modules; default {DEFAULT_TARGET_MODULES}"
    )


class PoolCreate(PoolSpec):
    namespace: str = "default"
    name: str


def validate_spec(spec: PoolSpec) -> None:
    if spec.dp > 1 and spec.tp % spec.dp != 0:
        raise bad_value("body.dp", f"tp={spec.tp} must be a multiple of dp={spec.dp}")
    if spec.max_loaded_loras < spec.max_loras_per_batch:
        raise bad_value(
            "body.max_loaded_loras",
            f"{spec.max_loaded_loras} is below max_loras_per_batch={spec.max_loras_per_batch}; "
            "resident adapters must be at least the GPU slots",
        )
    if spec.target_modules is not None and (
        not spec.target_modules or not all(spec.target_modules)
    ):
        raise bad_value("body.target_modules", "must be a non-empty list of module names or null")


def _some(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_live(pool: Pool, spec: PoolSpec) -> None:
    """Refuse a change the pool's adapters and workers contradict (409 naming the field and
    who is in the way), instead of recording limits that what is registered breaks: a new
    model its adapters were not trained on, a lower rank or fewer modules than they use, fewer
    adapters than a worker holds or fewer slots than its pinned adapters need. Only a field
    that changes is checked: a PUT of the same spec (the operator's every resync) passes while
    a load, an eviction or a new version is in flight; a new model, a lower rank or fewer
    modules wait until no adapter of the pool has an operation in progress (a new version
    records its rank and modules only once it loaded). Adapters being deleted load nowhere
    again and constrain no new limit, but count where they are still loaded."""
    where = f"pool {pool.namespace}/{pool.name}"
    staying = [a for a in pool.adapters if a.desired != "deleted"]
    modules = set(spec.target_modules or DEFAULT_TARGET_MODULES)
    tightens = (
        spec.model != pool.model
        or spec.max_lora_rank < pool.max_lora_rank
        or not modules >= set(pool.target_modules or DEFAULT_TARGET_MODULES)
    )
    busy = [f"{a.key} ({a.busy_operation_id})" for a in staying if a.busy_operation_id]
    if tightens and busy:
        # a new version in flight records its rank and modules only once it loaded
        raise conflict(
            f"{where}: adapters have operations in progress ({_some(busy)}); retry when they "
            "finish",
            code="operation_in_progress",
        )
    if spec.model != pool.model:
        other_base = [
            a.key for a in staying if a.base_model and not same_model(a.base_model, spec.model)
        ]
        if other_base:
            raise conflict(
                f"{where} has adapters trained on its current base ({_some(other_base)}); "
                f"unregister them first, or make a new pool for {spec.model!r}",
                field="body.model",
            )
    if spec.max_lora_rank < pool.max_lora_rank:
        above = [f"{a.key} (r={a.rank})" for a in staying if a.rank > spec.max_lora_rank]
        if above:
            raise conflict(
                f"{where} has adapters above max_lora_rank={spec.max_lora_rank}: {_some(above)}",
                field="body.max_lora_rank",
            )
    if modules != set(pool.target_modules or DEFAULT_TARGET_MODULES):
        outside = [
            f"{a.key} ({sorted(set(a.target_modules) - modules)})"
            for a in staying
            if not set(a.target_modules) <= modules
        ]
        if outside:
            raise conflict(
                f"{where} has adapters on modules target_modules leaves out: {_some(outside)}",
                field="body.target_modules",
            )
    if spec.max_loaded_loras < pool.max_loaded_loras:
        full = [
            f"{w.name} ({len(held)})"
            for w in pool.workers
            if len(held := worker_loaded(w)) > spec.max_loaded_loras
        ]
        if full:
            raise conflict(
                f"{where}: more than max_loaded_loras={spec.max_loaded_loras} adapters are "
                f"loaded on {_some(full)}; unload some first",
                field="body.max_loaded_loras",
            )
    if spec.max_loras_per_batch < pool.max_loras_per_batch:
        limit = max_pinned(spec.max_loras_per_batch)
        over = []
        for worker in pool.workers:
            # an adapter pinned in two versions (a new version loading) is one pin
            pinned = {a.id for a, _ in worker_loaded(worker).values() if a.pinned}
            if len(pinned) > limit:
                over.append(f"{worker.name} ({len(pinned)} pinned)")
        if over:
            raise PinLimit(
                f"{where}: max_loras_per_batch={spec.max_loras_per_batch} allows {limit} pinned "
                f"adapters per worker ({RULE}), more are loaded on {_some(over)}; unpin some "
                "first",
                field="body.max_loras_per_batch",
            )


def apply(pool: Pool, spec: PoolSpec) -> None:
    for field_name in PoolSpec.model_fields:
        setattr(pool, field_name, getattr(spec, field_name))


@router.get("")
def list_pools(
    session: SessionDep, principal: Reader, namespace: str | None = Query(None)
) -> dict[str, Any]:
    query = select(Pool).order_by(Pool.namespace, Pool.name)
    if namespace is not None:
        check_namespace(principal, namespace, "query.namespace")
        query = query.where(Pool.namespace == namespace)
    pools = [p for p in session.scalars(query).all() if principal.sees(p.namespace)]
    return {"items": [pool_json(p) for p in pools]}


@router.get("/{namespace}/{name}")
def read_pool(namespace: str, name: str, session: SessionDep, principal: Reader) -> dict[str, Any]:
    check_namespace(principal, namespace)
    return pool_json(get_pool(session, namespace, name), detail=True)


@router.post("", status_code=201)
def create_pool(body: PoolCreate, session: SessionDep, _: ClusterAdmin) -> dict[str, Any]:
    check_label(body.namespace, "body.namespace")
    check_label(body.name, "body.name")
    validate_spec(body)
    if session.scalar(select(Pool).where(Pool.namespace == body.namespace, Pool.name == body.name)):
        raise conflict(
            f"pool {body.namespace}/{body.name} already exists; use PUT to update it",
            field="body.name",
        )
    pool = Pool(namespace=body.namespace, name=body.name)
    apply(pool, body)
    session.add(pool)
    session.commit()  # before the answer: a client's next call must see it
    return pool_json(pool)


@router.put("/{namespace}/{name}")
def put_pool(
    namespace: str, name: str, body: PoolSpec, session: SessionDep, _: ClusterAdmin
) -> dict[str, Any]:
    check_label(namespace, "path.namespace")
    check_label(name, "path.name")
    validate_spec(body)
    # locked (not the key: workers' and adapters' foreign keys do not wait): a registration or
    # new version journalled meanwhile waits for this, or this for it and then sees its
    # adapter; see application._still_fits
    pool = session.scalar(
        select(Pool)
        .where(Pool.namespace == namespace, Pool.name == name)
        .with_for_update(key_share=True)
    )
    if pool is None:
        pool = Pool(namespace=namespace, name=name)
        session.add(pool)
    else:
        check_live(pool, body)
    apply(pool, body)
    session.commit()
    return pool_json(pool)


@router.delete("/{namespace}/{name}", status_code=204)
def delete_pool(
    namespace: str,
    name: str,
    session: SessionDep,
    _: ClusterAdmin,
    _body: NoFields | None = None,
) -> Response:
    pool = get_pool(session, namespace, name)
    if pool.workers or pool.adapters:
        raise conflict(
            f"pool {namespace}/{name} still has {len(pool.workers)} workers and {len(pool.adapters)} adapters; "
            "delete them first"
        )
    session.delete(pool)
    session.commit()
    return Response(status_code=204)
