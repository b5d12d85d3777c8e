"""Workers register themselves (the operator calls this for each ready pod)."""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from pydantic import Field
from sqlalchemy import select

from loraplane.controlplane.api.bodies import Body, NoFields
from loraplane.controlplane.deps import (
    ClusterAdmin,
    Reader,
    Services,
    ServicesDep,
    SessionDep,
    check_namespace,
)
from loraplane.controlplane.errors import bad_value, excerpt
from loraplane.controlplane.models import Pool, Worker
from loraplane.controlplane.registry import check_label, get_pool, get_worker, worker_json

router = APIRouter(prefix="/v1/workers", tags=["workers"])
WORKER_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is no ``http(s)://host[:port][/path]`` a worker answers at, or None."""
    if any(not 0x20 < ord(c) < 0x7F for c in endpoint):
        return "holds a space, a control or a non-ASCII character"
    parsed = urlsplit(endpoint)
    try:
        port = parsed.port
    except ValueError:
        port = 0
    if port == 0:
        return "has a port outside 1..65535"
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "is not an http(s)://host[:port] URL"
    if parsed.username is not None or parsed.password is not None:
        return "holds credentials (user:password@); workers take a token, never URL credentials"
    if parsed.query or parsed.fragment or endpoint.endswith(("?", "#")):
        return "has a query or a fragment"
    return None


class WorkerRegister(Body):
    name: str = Field(min_length=1, max_length=253)
    namespace: str = "default"
    pool: str
    endpoint: str = Field(
        min_length=1, max_length=1024, description="http(s)://host:port of the worker API"
    )
    dp_size: int = Field(ge=1, le=64)


@router.post("")
async def register_worker(
    body: WorkerRegister, services: ServicesDep, _: ClusterAdmin
) -> JSONResponse:
    if not WORKER_NAME.fullmatch(body.name):
        raise bad_value("body.name", f"{excerpt(body.name)} is not a DNS-1123 subdomain name")
    check_label(body.namespace, "body.namespace")
    check_label(body.pool, "body.pool")
    problem = endpoint_problem(body.endpoint)
    if problem is not None:
        raise bad_value("body.endpoint", f"{excerpt(body.endpoint)} {problem}")
    body_json, created = await asyncio.to_thread(_register, services, body)
    await services.bus.publish(
        "worker.registered", worker=body.name, pool=body.pool, namespace=body.namespace
    )
    services.reconciler.poke()
    return JSONResponse(body_json, status_code=201 if created else 200)


def _register(services: Services, body: WorkerRegister) -> tuple[dict[str, Any], bool]:
    """Record the worker (pending until the reconciler has seen it): its JSON, and whether it
    is new."""
    with services.db.session() as session:
        pool = get_pool(session, body.namespace, body.pool, field="body.pool")
        if body.dp_size != pool.dp:
            raise bad_value(
                "body.dp_size", f"{body.dp_size} does not match pool {pool.name}'s dp={pool.dp}"
            )
        worker = session.scalar(select(Worker).where(Worker.name == body.name))
        created = worker is None
        if worker is None:
            worker = Worker(name=body.name, state="pending")
            session.add(worker)
        elif worker.pool_id != pool.id and worker.placements:
            raise bad_value(
                "body.pool", f"worker {body.name} is registered in another pool and holds adapters"
            )
        worker.pool = pool
        worker.endpoint = body.endpoint.rstrip("/")
        worker.dp_size = body.dp_size
        if not created:
            worker.state = "pending"
        session.flush()
        return worker_json(worker, services.inflight.by_worker.get(worker.id, 0)), created


@router.get("")
def list_workers(
    services: ServicesDep,
    session: SessionDep,
    principal: Reader,
    pool: str | None = None,
    namespace: str | None = None,
    state: str | None = Query(None, pattern="^(pending|ready|unreachable)$"),
) -> dict[str, Any]:
    query = select(Worker).join(Pool).order_by(Worker.name)
    if namespace is not None:
        check_namespace(principal, namespace, "query.namespace")
        query = query.where(Pool.namespace == namespace)
    if pool is not None:
        query = query.where(Pool.name == pool)
    if state is not None:
        query = query.where(Worker.state == state)
    workers = [w for w in session.scalars(query).all() if principal.sees(w.pool.namespace)]
    return {"items": [worker_json(w, services.inflight.by_worker.get(w.id, 0)) for w in workers]}


@router.get("/{name}")
def read_worker(
    name: str, services: ServicesDep, session: SessionDep, principal: Reader
) -> dict[str, Any]:
    worker = get_worker(session, name)
    check_namespace(principal, worker.pool.namespace, "path.name")
    return worker_json(worker, services.inflight.by_worker.get(worker.id, 0))


@router.delete("/{name}", status_code=204)
async def delete_worker(
    name: str, services: ServicesDep, _: ClusterAdmin, _body: NoFields | None = None
) -> Response:
    namespace = await asyncio.to_thread(_delete, services, name)
    await services.bus.publish("worker.deregistered", namespace=namespace, worker=name)
    return Response(status_code=204)


def _delete(services: Services, name: str) -> str:
    """Forget the worker (its placements go with it); the namespace of its pool."""
    with services.db.session() as session:
        worker = get_worker(session, name)
        namespace = worker.pool.namespace
        session.delete(worker)
        return namespace
