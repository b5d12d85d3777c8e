"""Placements: adapter x worker x DP group -> state (read only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from sqlalchemy import select

from loraplane.controlplane.deps import Reader, SessionDep, check_namespace
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.registry import placement_json

router = APIRouter(prefix="/v1/placements", tags=["placements"])


@router.get("")
def list_placements(
    session: SessionDep,
    principal: Reader,
    namespace: str | None = None,
    adapter: str | None = None,
    worker: str | None = None,
    pool: str | None = None,
    state: str | None = Query(
        None, pattern="^(loading|loaded|unloading|failed|inconsistent|unreachable)$"
    ),
) -> dict[str, Any]:
    query = select(Placement).join(Adapter).join(Worker).join(Pool, Adapter.pool_id == Pool.id)
    if namespace is not None:
        check_namespace(principal, namespace, "query.namespace")
        query = query.where(Adapter.namespace == namespace)
    if adapter is not None:
        query = query.where(Adapter.name == adapter)
    if worker is not None:
        query = query.where(Worker.name == worker)
    if pool is not None:
        query = query.where(Pool.name == pool)
    if state is not None:
        query = query.where(Placement.state == state)
    query = query.order_by(Adapter.namespace, Adapter.name, Worker.name, Placement.dp_group)
    rows = [p for p in session.scalars(query).all() if principal.sees(p.adapter.namespace)]
    return {"items": [placement_json(p) for p in rows]}
