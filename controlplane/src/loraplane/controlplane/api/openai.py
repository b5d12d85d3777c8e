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
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
import anyio
from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select
from starlette.types import Receive, Scope, Send

from loraplane.controlplane import application
from loraplane.controlplane.auth import ALL_NAMESPACES, Principal
from loraplane.controlplane.deps import RouteCaller, Services, ServicesDep
from loraplane.controlplane.errors import ApiError, bad_value
from loraplane.controlplane.lifecycle import mark
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.operations import WorkerRef
from loraplane.controlplane.registry import check_label, lora_name, routable_workers
from loraplane.controlplane.routes import Candidate, Destination
from loraplane.controlplane.upstream import lines as upstream_lines
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
                    f"body.model: no adapter or pool named {model!r} in namespace {namespace!r}",
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
    await services.usage.flush()  # the eviction it may plan reads the LRU order
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
        lease = _Lease(services, route)
        try:
            response = await _send_unless_gone(request, services, route, path, forwarded)
        except WorkerTimeout as exc:  # busy, not gone: the worker stays routable
            lease.release()
            services.metrics.routed_requests.labels(namespace, route.adapter_name, "504").inc()
            counted.routed = True
            raise ApiError(504, "upstream_timeout", str(exc)) from exc
        except WorkerUnreachable as exc:
            lease.release()
            services.reconciler.poke()
            if attempt == 0:
                await asyncio.to_thread(mark_unreachable, services, route.worker.id, str(exc))
                services.routes.invalidate()
                route = await resolve(services, principal, namespace, model)
                continue
            services.metrics.routed_requests.labels(namespace, route.adapter_name, "503").inc()
            counted.routed = True
            raise ApiError(503, "no_worker", str(exc)) from exc
        except BaseException:  # whatever failed, this request no longer counts on the worker
            lease.release()
            raise
        if response is None:  # the client left before the worker answered
            lease.release()
            services.metrics.routed_requests.labels(namespace, route.adapter_name, "499").inc()
            counted.routed = True
            return Response(status_code=499)
        if response.status == 404 and route.lora_name is not None and attempt == 0:
            # the worker lost the adapter (it restarted): say so, let the reconciler repair,
            # and retry from the database, not from the route table
            response.close()
            lease.release()
            await asyncio.to_thread(mark_lost, services, route)
            services.routes.invalidate()
            services.reconciler.poke()
            route = await resolve(services, principal, namespace, model)
            continue
        if route.adapter_id is not None:
            services.usage.touch(route.adapter_id)
        services.metrics.routed_requests.labels(
            namespace, route.adapter_name, str(response.status)
        ).inc()
        counted.routed = True
        if stream and response.status == 200:
            return _Relay(_relay(services, response, route, model), response, lease)
        try:
            content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()
            raise ApiError(
                502, "upstream_error", f"worker {route.worker.name} stopped answering: {exc!r}"
            ) from exc
        finally:
            response.release()
            lease.release()
        media = response.headers.get("content-type", "application/json")
        if response.status == 200:
            content = rewrite_model(content, model)
        return Response(content, status_code=response.status, media_type=media)
    raise AssertionError("unreachable")


class _Lease:
    """One request counted on its worker (``Inflight``) until ``release``; releasing twice is
    harmless, so every path out of a request can release."""

    def __init__(self, services: Services, route: Route) -> None:
        self.inflight = services.inflight
        self.route = route
        self.released = False
        self.inflight.add(route.worker.id, route.lora_name, 1)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inflight.add(self.route.worker.id, self.route.lora_name, -1)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is read: the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _send_unless_gone(
    request: Request, services: Services, route: Route, path: str, body: dict[str, Any]
) -> aiohttp.ClientResponse | None:
    """The worker's answer (its headers), or None if the client disconnected first; then the
    worker's request is closed, so it stops generating for nobody."""
    sending = asyncio.ensure_future(
        services.upstream.open(
            route.worker.name,
            route.worker.endpoint,
            path,
            body,
            services.settings.router.request_timeout_s,
        )
    )
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((sending, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not sending.done():
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
    if gone.done() and not gone.cancelled():
        if not sending.cancelled() and sending.exception() is None:
            sending.result().close()
        return None
    return sending.result()


async def _relay(
    services: Services, response: aiohttp.ClientResponse, route: Route, model: str
) -> AsyncGenerator[bytes, None]:
    """The worker's SSE lines with ``model`` as the client named it, each read passed on as
    one chunk; an error event if the worker goes away mid-stream (not a stream that just
    stops, which reads as complete)."""
    try:
        async for batch in upstream_lines(response):
            yield b"".join(_client_line(line, model) for line in batch)
    except (aiohttp.ClientError, TimeoutError) as exc:
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


def _client_line(line: bytes, model: str) -> bytes:
    if line.startswith(b"data: ") and line != b"data: [DONE]":
        line = b"data: " + rewrite_model(line[6:], model)
    return line + b"\n"


class _Relay(StreamingResponse):
    """A stream from a worker that always ends with the worker's response closed and the
    request no longer counted on the worker: read to the end, the client disconnecting (before
    or after the first token), the worker failing, or the server shutting down."""

    def __init__(
        self, lines: AsyncGenerator[bytes, None], upstream: aiohttp.ClientResponse, lease: _Lease
    ) -> None:
        super().__init__(lines, status_code=200, media_type="text/event-stream")
        self._lines = lines
        self._upstream = upstream
        self._lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._lines.aclose()
                finally:  # a connection read to the end is kept for the next request
                    if self._upstream.content.at_eof():
                        self._upstream.release()
                    else:
                        self._upstream.close()
                    self._lease.release()


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
