"""The router: OpenAI-compatible completions proxied to the least-loaded worker holding the adapter.

``model`` is ``"<pool-or-base>:<adapter>"``, ``"<adapter>"``, or a pool name / base model id.
If no ready worker holds the adapter, it is loaded on demand (journalled like any load, with
LRU eviction) and the request waits at most ``router.on_demand_timeout_s``; then 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select

from loraplane.controlplane import application
from loraplane.controlplane.auth import ALL_NAMESPACES, Principal
from loraplane.controlplane.deps import RouteCaller, Services, ServicesDep
from loraplane.controlplane.errors import ApiError, bad_value
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.operations import WorkerRef
from loraplane.controlplane.registry import check_label, lora_name, routable_workers
from loraplane.controlplane.workers import WorkerTimeout, WorkerUnreachable

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
                f"header.X-Loraplane-Namespace: token {principal.name!r} may not use namespace {header!r}",
                field="header.X-Loraplane-Namespace",
            )
        return principal.namespace
    namespace = header or "default"
    check_label(namespace, "header.X-Loraplane-Namespace")
    return namespace


def least_loaded(services: Services, workers: list[Worker]) -> Worker | None:
    ready = [w for w in workers if w.state == "ready"]
    if not ready:
        return None
    return min(ready, key=lambda w: (services.inflight.by_worker.get(w.id, 0), w.name))


async def on_demand_load(services: Services, adapter_id: int) -> str:
    """Start (or join) an on-demand load onto one more worker; returns the operation's final state."""
    loaded = await application.ensure_loaded(services, application.EnsureLoaded(adapter_id))
    return loaded.state


async def resolve(services: Services, principal: Principal, namespace: str, model: str) -> Route:
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
                    f"body.model: no adapter or pool named {model!r} in namespace {namespace!r}",
                    field="body.model",
                )
            worker = least_loaded(services, list(pool.workers))
            if worker is None:
                raise ApiError(503, "no_worker", f"pool {pool.name} has no ready worker")
            return Route(WorkerRef.of(worker), worker.served_model or model, None, "", None)
        if adapter is None or adapter.desired == "deleted":
            raise ApiError(
                404,
                "not_found",
                f"body.model: adapter {adapter_name!r} not found in namespace {namespace!r}",
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
                f"body.model: adapter {adapter_name!r} belongs to pool {pool.name!r}, "
                f"not {prefix!r}",
                field="body.model",
            )
        adapter_id, key = adapter.id, adapter.name
        worker = least_loaded(services, routable_workers(adapter))
        if worker is not None:
            return Route(
                WorkerRef.of(worker),
                lora_name(adapter.namespace, adapter.name, adapter.version),
                adapter_id,
                key,
                lora_name(adapter.namespace, adapter.name, adapter.version),
            )
        if adapter.load_policy == "Explicit":
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
    with services.db.session() as session:
        adapter = session.get(Adapter, adapter_id)
        assert adapter is not None
        worker = least_loaded(services, routable_workers(adapter))
        if worker is None:
            raise ApiError(
                503,
                "no_worker",
                f"adapter {namespace}/{key} was loaded but no worker holding it is ready",
            )
        name = lora_name(adapter.namespace, adapter.name, adapter.version)
        return Route(WorkerRef.of(worker), name, adapter_id, key, name)


def touch(services: Services, adapter_id: int | None) -> None:
    if adapter_id is None:
        return
    with contextlib.suppress(Exception), services.db.session() as session:
        adapter = session.get(Adapter, adapter_id)
        if adapter is not None:
            adapter.last_used_at = time.time()


def mark_lost(services: Services, route: Route) -> None:
    with services.db.session() as session:
        rows = session.scalars(
            select(Placement).where(
                Placement.worker_id == route.worker.id, Placement.lora_name == route.lora_name
            )
        ).all()
        for row in rows:
            row.state = "failed"
            row.error = "the worker answered 404 for this adapter"


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


@dataclass(slots=True)
class _Counted:
    """Whether a request was counted in ``routed_requests`` (a worker answered or was tried)."""

    routed: bool = False


async def proxy(
    request: Request, path: str, principal: Principal, services: Services, ns_header: str | None
) -> Response:
    """Route one OpenAI request; an error answered before any worker is counted by its code."""
    counted = _Counted()
    try:
        return await _proxy(request, path, principal, services, ns_header, counted)
    except ApiError as exc:
        if not counted.routed:
            services.metrics.router_rejected.labels(exc.code).inc()
        raise


async def _proxy(
    request: Request,
    path: str,
    principal: Principal,
    services: Services,
    ns_header: str | None,
    counted: _Counted,
) -> Response:
    try:
        body = json.loads(await request.body())
        check_finite(body, "body")
    except RecursionError as exc:
        raise bad_value("body", "JSON nested too deeply") from exc
    except ValueError as exc:
        raise bad_value("body", f"not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(body, dict):
        raise bad_value("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_value("body.model", "required: '<pool>:<adapter>', '<adapter>' or a pool name")
    if body.get("lora_path") is not None:  # the worker would prefer it to the routed adapter
        raise bad_value(
            "body.lora_path", "not accepted by the router: name the adapter in body.model"
        )
    namespace = pick_namespace(principal, ns_header)
    route = await resolve(services, principal, namespace, model)
    stream = bool(body.get("stream"))
    for attempt in range(2):
        forwarded = {**body, "model": route.model}
        services.inflight.add(route.worker.id, route.lora_name, 1)
        released = False

        def release(route: Route = route) -> None:
            nonlocal released
            if not released:
                released = True
                services.inflight.add(route.worker.id, route.lora_name, -1)

        try:
            response, _ = await services.client.stream(
                route.worker.name,
                route.worker.endpoint,
                path,
                forwarded,
                services.settings.router.request_timeout_s,
            )
        except WorkerTimeout as exc:  # busy, not gone: the worker stays routable
            release()
            services.metrics.routed_requests.labels(namespace, route.adapter_name, "504").inc()
            counted.routed = True
            raise ApiError(504, "upstream_timeout", str(exc)) from exc
        except WorkerUnreachable as exc:
            release()
            services.reconciler.poke()
            if attempt == 0:
                with services.db.session() as session:
                    worker = session.get(Worker, route.worker.id)
                    if worker is not None:
                        worker.state = "unreachable"
                        worker.last_error = str(exc)
                        for placement in worker.placements:
                            if placement.state == "loaded":
                                placement.state = "unreachable"
                route = await resolve(services, principal, namespace, model)
                continue
            services.metrics.routed_requests.labels(namespace, route.adapter_name, "503").inc()
            counted.routed = True
            raise ApiError(503, "no_worker", str(exc)) from exc
        except BaseException:  # whatever failed, this request no longer counts on the worker
            release()
            raise
        if response.status_code == 404 and route.lora_name is not None and attempt == 0:
            # the worker lost the adapter (it restarted): say so, let the reconciler repair, retry
            await response.aclose()
            release()
            mark_lost(services, route)
            services.reconciler.poke()
            route = await resolve(services, principal, namespace, model)
            continue
        touch(services, route.adapter_id)
        services.metrics.routed_requests.labels(
            namespace, route.adapter_name, str(response.status_code)
        ).inc()
        counted.routed = True
        if stream and response.status_code == 200:

            async def relay(response: Any = response, route: Route = route) -> AsyncIterator[bytes]:
                try:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            line = "data: " + rewrite_model(line[6:].encode(), model).decode()
                        yield (line + "\n").encode()
                except httpx.HTTPError as exc:  # the worker went away mid-stream: say so
                    services.reconciler.poke()
                    error = {
                        "error": {
                            "message": f"worker {route.worker.name} stopped mid-stream: "
                            f"{type(exc).__name__}: {exc}",
                            "type": "upstream_error",
                            "code": 502,
                        }
                    }
                    yield f"data: {json.dumps(error)}\n\n".encode()
                finally:
                    await response.aclose()
                    release()

            return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")
        try:
            content = await response.aread()
        finally:
            await response.aclose()
            release()
        media = response.headers.get("content-type", "application/json")
        if response.status_code == 200:
            content = rewrite_model(content, model)
        return Response(content, status_code=response.status_code, media_type=media)
    raise AssertionError("unreachable")


@router.post("/v1/completions")
async def completions(
    request: Request,
    principal: RouteCaller,
    services: ServicesDep,
    namespace: NamespaceHeader = None,
) -> Response:
    return await proxy(request, "/v1/completions", principal, services, namespace)


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request,
    principal: RouteCaller,
    services: ServicesDep,
    namespace: NamespaceHeader = None,
) -> Response:
    return await proxy(request, "/v1/chat/completions", principal, services, namespace)


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
