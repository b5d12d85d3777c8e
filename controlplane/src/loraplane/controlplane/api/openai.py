"""The router: OpenAI-compatible completions proxied to the least-loaded worker holding the adapter.

``model`` is ``"<pool-or-base>:<adapter>"``, ``"<adapter>"``, or a pool name / base model id.
If no ready worker holds the adapter, it is loaded on demand (journalled like any load, with
LRU eviction) and the request waits at most ``router.on_demand_timeout_s``; then 503.

This module resolves where a request goes and lists the models; ``api/proxy.py`` serves the
two completion routes (parse, resolve, proxy, relay).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse
from sqlalchemy import select

from loraplane.controlplane import application
from loraplane.controlplane.auth import ALL_NAMESPACES, Principal
from loraplane.controlplane.deps import RouteCaller, Services, ServicesDep
from loraplane.controlplane.errors import ApiError, bad_value, excerpt
from loraplane.controlplane.lifecycle import mark
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.operations import WorkerRef
from loraplane.controlplane.registry import check_label, lora_name, routable_workers
from loraplane.controlplane.routes import Candidate, Destination

router = APIRouter(tags=["router"])
NamespaceHeader = Annotated[str | None, Header(alias="X-Loraplane-Namespace")]


@dataclass(frozen=True, slots=True)
class Route:
    worker: WorkerRef
    model: str  # what the worker is sent
    adapter_id: int | None
    adapter_name: str  # for metrics ("" = base)
    lora_name: str | None


def pick_namespace(principal: Principal, header: str | None) -> str:
    if principal.namespace != ALL_NAMESPACES:
        if header is not None and header != principal.namespace:
            raise ApiError(
                403,
                "forbidden_namespace",
                f"header.X-Loraplane-Namespace: token {principal.name!r} may not use namespace {excerpt(header)}",
                field="header.X-Loraplane-Namespace",
            )
        return principal.namespace
    namespace = header or "default"
    check_label(namespace, "header.X-Loraplane-Namespace")
    return namespace


async def on_demand_load(services: Services, adapter_id: int) -> str:
    """Start (or join) an on-demand load onto one more worker; returns the operation's final state."""
    loaded = await application.ensure_loaded(services, application.EnsureLoaded(adapter_id))
    return loaded.state


def _lookup(services: Services, namespace: str, model: str) -> Destination:
    """Read where ``model`` routes from the database (blocking: runs in a thread)."""
    prefix, _, adapter_name = model.rpartition(":")
    with services.db.session() as session:
        adapter = session.scalar(
            select(Adapter).where(Adapter.namespace == namespace, Adapter.name == adapter_name)
        )
        if adapter is None and not prefix:
            pools = session.scalars(select(Pool).where(Pool.namespace == namespace)).all()
            pool = next(
                (
                    p
                    for p in pools
                    if model in (p.name, p.model, p.model.rstrip("/").rsplit("/", 1)[-1])
                ),
                None,
            )
            if pool is None:
                pool = next(
                    (p for p in pools if any(w.served_model == model for w in p.workers)), None
                )
            if pool is None:
                raise ApiError(
                    404,
                    "not_found",
                    f"body.model: no adapter or pool named {excerpt(model)} in namespace {excerpt(namespace)}",
                    field="body.model",
                )
            ready = sorted((w for w in pool.workers if w.state == "ready"), key=lambda w: w.name)
            if not ready:
                raise ApiError(503, "no_worker", f"pool {pool.name} has no ready worker")
            return Destination(
                tuple(Candidate(WorkerRef.of(w), w.served_model or model) for w in ready),
                None,
                "",
                None,
            )
        if adapter is None or adapter.desired == "deleted":
            raise ApiError(
                404,
                "not_found",
                f"body.model: adapter {excerpt(adapter_name)} not found in namespace {excerpt(namespace)}",
                field="body.model",
            )
        pool = adapter.pool
        if (
            prefix
            and prefix not in (pool.name, pool.model, pool.model.rstrip("/").rsplit("/", 1)[-1])
            and not any(w.served_model == prefix for w in pool.workers)
        ):
            raise ApiError(
                404,
                "not_found",
                f"body.model: adapter {excerpt(adapter_name)} belongs to pool {pool.name!r}, "
                f"not {excerpt(prefix)}",
                field="body.model",
            )
        name = lora_name(adapter.namespace, adapter.name, adapter.version)
        return Destination(
            tuple(Candidate(WorkerRef.of(w), name) for w in routable_workers(adapter)),
            adapter.id,
            adapter.name,
            name,
            adapter.load_policy,
        )


def pick(services: Services, destination: Destination) -> Route | None:
    """The least-loaded candidate (inflight requests of this replica, then name)."""
    if not destination.candidates:
        return None
    chosen = min(
        destination.candidates,
        key=lambda c: (services.inflight.by_worker.get(c.worker.id, 0), c.worker.name),
    )
    return Route(
        chosen.worker,
        chosen.model,
        destination.adapter_id,
        destination.adapter_name,
        destination.lora_name,
    )


async def resolve(services: Services, principal: Principal, namespace: str, model: str) -> Route:
    """Where to send one request: from the route table, else the database (off the loop);
    an adapter loaded nowhere is loaded on demand."""
    destination = await services.routes.get(
        (namespace, model), lambda: _lookup(services, namespace, model)
    )
    route = pick(services, destination)
    if route is not None:
        return route
    adapter_id, key = destination.adapter_id, destination.adapter_name
    assert adapter_id is not None  # a pool without ready workers was refused by the lookup
    if destination.load_policy == "Explicit":
        raise ApiError(
            409,
            "adapter_not_loaded",
            f"body.model: adapter {namespace}/{key} is not loaded on any ready worker and "
            "its load_policy is Explicit: it is loaded only on request "
            f"(POST /v1/adapters/{namespace}/{key}/load), never by routing",
            field="body.model",
        )
    started = time.perf_counter()
    timeout = services.settings.router.on_demand_timeout_s
    try:
        await asyncio.wait_for(on_demand_load(services, adapter_id), timeout)
    except TimeoutError as exc:  # a request, not a load: router_rejected{code} counts it
        raise ApiError(
            503,
            "on_demand_timeout",
            f"adapter {namespace}/{key} was not loaded within {timeout}s "
            "(router.on_demand_timeout_s); the load continues, retry later",
        ) from exc
    finally:
        services.metrics.on_demand_wait.observe(time.perf_counter() - started)
    destination = await services.routes.get(
        (namespace, model), lambda: _lookup(services, namespace, model)
    )
    route = pick(services, destination)
    if route is None:
        raise ApiError(
            503,
            "no_worker",
            f"adapter {namespace}/{key} was loaded but no worker holding it is ready",
        )
    return route


def mark_lost(services: Services, route: Route) -> None:
    with services.db.session() as session:
        rows = session.scalars(
            select(Placement).where(
                Placement.worker_id == route.worker.id, Placement.lora_name == route.lora_name
            )
        ).all()
        for row in rows:
            mark(row, "failed", error="the worker answered 404 for this adapter")


def mark_unreachable(services: Services, worker_id: int, error: str) -> None:
    with services.db.session() as session:
        worker = session.get(Worker, worker_id)
        if worker is not None:
            worker.state = "unreachable"
            worker.last_error = error
            for placement in worker.placements:
                if placement.state == "loaded":
                    mark(placement, "unreachable")


def check_finite(value: Any, field: str) -> None:
    """Refuse ``NaN``, ``Infinity`` and numbers beyond a double (``1e400``) by their field:
    no worker would take them, and they cannot be sent on as JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_value(field, f"{value} is not a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{field}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_finite(item, f"{field}[{index}]")


def rewrite_model(payload: bytes, model: str) -> bytes:
    try:
        body = json.loads(payload)
    except ValueError:
        return payload
    if isinstance(body, dict) and "model" in body:
        body["model"] = model
        return json.dumps(body).encode()
    return payload


@router.get("/v1/models")
def list_models(
    principal: RouteCaller, services: ServicesDep, namespace: NamespaceHeader = None
) -> JSONResponse:
    ns = pick_namespace(principal, namespace)
    data: list[dict[str, Any]] = []
    with services.db.session() as session:
        for pool in session.scalars(
            select(Pool).where(Pool.namespace == ns).order_by(Pool.name)
        ).all():
            created = int(pool.created_at.timestamp())
            data.append(
                {
                    "id": pool.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "loraplane",
                    "root": pool.model,
                    "parent": None,
                }
            )
            for adapter in sorted(pool.adapters, key=lambda a: a.name):
                if adapter.desired == "deleted":
                    continue
                data.append(
                    {
                        "id": f"{pool.name}:{adapter.name}",
                        "object": "model",
                        "created": int(adapter.created_at.timestamp()),
                        "owned_by": adapter.namespace,
                        "root": adapter.source_uri,
                        "parent": pool.name,
                        "pinned": adapter.pinned,
                        "routable": bool(routable_workers(adapter)),
                    }
                )
    return JSONResponse({"object": "list", "data": data})
