"""Operations: the journal, read only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from sqlalchemy import select

from loraplane.controlplane.auth import ALL_NAMESPACES
from loraplane.controlplane.deps import Reader, SessionDep, check_namespace
from loraplane.controlplane.errors import not_found
from loraplane.controlplane.models import Operation
from loraplane.controlplane.registry import operation_json

router = APIRouter(prefix="/v1/operations", tags=["operations"])


@router.get("")
def list_operations(
    session: SessionDep,
    principal: Reader,
    namespace: str | None = None,
    adapter: str | None = None,
    kind: str | None = None,
    state: str | None = Query(None, pattern="^(pending|running|succeeded|failed|rolled_back)$"),
    limit: int = Query(50, ge=1, le=1000),
) -> dict[str, Any]:
    query = select(Operation).order_by(Operation.created_at.desc(), Operation.id).limit(limit)
    if namespace is not None:
        check_namespace(principal, namespace, "query.namespace")
        query = query.where(Operation.namespace == namespace)
    elif principal.namespace != ALL_NAMESPACES:
        # in the query, not after it: the limit counts the caller's operations only
        query = query.where(Operation.namespace == principal.namespace)
    if adapter is not None:
        query = query.where(Operation.adapter_name == adapter)
    if kind is not None:
        query = query.where(Operation.kind == kind)
    if state is not None:
        query = query.where(Operation.state == state)
    ops = [op for op in session.scalars(query).all() if principal.sees(op.namespace)]
    return {"items": [operation_json(op) for op in ops]}


@router.get("/{op_id}")
def read_operation(op_id: str, session: SessionDep, principal: Reader) -> dict[str, Any]:
    op = session.get(Operation, op_id)
    if op is None or not principal.sees(op.namespace):
        raise not_found("operation", op_id, field="path.op_id")
    return operation_json(op)
