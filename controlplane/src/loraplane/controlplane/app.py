"""The FastAPI application: routers, error handlers, and a lifespan that opens and closes the
database engine, the event bus (Redis), the worker HTTP client and the reconciler."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplane.controlplane.api import (
    adapters,
    openai,
    operations,
    placements,
    pools,
    proxy,
    system,
    tokens,
    workers,
)
from loraplane.controlplane.auth import TokenCache
from loraplane.controlplane.db import Database
from loraplane.controlplane.deps import Services
from loraplane.controlplane.errors import (
    ApiError,
    Conflict,
    DomainError,
    InvalidValue,
    NotFound,
    Unavailable,
)
from loraplane.controlplane.events import EventBus, close_within, make_bus, stop_tasks
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.operations import Inflight, Operations
from loraplane.controlplane.reconciler import Reconciler
from loraplane.controlplane.routes import RouteTable, watch_writes
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.sources import SourceResolver
from loraplane.controlplane.upstream import Upstream
from loraplane.controlplane.usage import UsageBatch
from loraplane.controlplane.workers import WorkerClient
from loraplane.rules.body_limit import BodyLimit
from loraplane.rules.validation import UNPARSED, UNPARSED_MESSAGE, body_refusal, summary

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005


# Validation errors a 422 lists at most (the rest are counted).
SHOWN_ERRORS = 8

# The HTTP status of each kind of domain error: the one place the domain meets HTTP. A kind
# not listed takes its nearest listed base class's status.
HTTP_STATUS: dict[type[DomainError], int] = {
    InvalidValue: 400,
    NotFound: 404,
    Conflict: 409,
    Unavailable: 503,
}


def http_status(exc: ApiError) -> int:
    """The status a client gets for ``exc``: the HTTP edge's own, or its kind's from the table."""
    if exc.status is not None:
        return exc.status
    for kind in type(exc).__mro__:
        if kind in HTTP_STATUS:
            return HTTP_STATUS[kind]
    raise TypeError(f"{type(exc).__name__} has no HTTP status: add its kind to HTTP_STATUS")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=http_status(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        refusal = body_refusal(errors, request.headers.get("content-type", ""))
        if refusal is not None:
            first: str | None = "body"
            message = refusal
        else:
            first, message = summary(errors, keep_body=True, shown=SHOWN_ERRORS)
        body = {"error": {"code": "validation_error", "field": first, "message": message}}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    async def database_unavailable(
        _: Request, exc: sqlalchemy.exc.OperationalError
    ) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        message = f"the registry database is unavailable, retry later ({type(exc.orig).__name__})"
        body = {"error": {"code": "database_unavailable", "field": None, "message": message}}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @app.exception_handler(sqlalchemy.exc.IntegrityError)
    async def integrity_error(_: Request, exc: sqlalchemy.exc.IntegrityError) -> JSONResponse:
        # a concurrent request wrote the same unique row first (the SQL is not shown: it
        # quotes the request's values)
        log.info("conflicting write: %s", type(exc.orig).__name__)
        message = "a concurrent request created or changed the same object first; read it and retry"
        body = {"error": {"code": "conflict", "field": None, "message": message}}
        return JSONResponse(body, status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            404: "not_found",
            405: "method_not_allowed",
            408: "body_timeout",
            413: "too_large",
        }.get(exc.status_code, "http_error")
        field = "body" if exc.status_code in (408, 413) else None
        message = str(exc.detail)
        if exc.status_code == 400 and exc.detail == UNPARSED:
            code, field, message = "invalid_value", "body", UNPARSED_MESSAGE
        return JSONResponse(
            {"error": {"code": code, "field": field, "message": message}},
            status_code=exc.status_code,
        )


class ControlPlaneApp(FastAPI):
    """The FastAPI app, with the router's completion routes (``api/proxy.py``) served ahead of
    its middleware, routing and dependency solving: ``inference`` (the raw handler behind
    the same body limit) takes a POST to one of their paths."""

    inference: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.inference is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and proxy.route_path(scope) in proxy.PATHS
        ):
            await self.inference(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def follow_revocations(bus: EventBus, tokens: TokenCache) -> asyncio.Task[None]:
    """A task that empties ``tokens`` on every ``token.revoked`` event (this replica's or,
    through Redis, another's), subscribed when this returns."""
    subscribed = asyncio.Event()

    async def follow() -> None:
        async with bus.subscribe() as queue:
            subscribed.set()
            while True:
                if (await queue.get()).get("type") == "token.revoked":
                    tokens.invalidate()

    task = asyncio.create_task(follow(), name="token-revocations")
    await subscribed.wait()
    return task


def create_app(settings: Settings | None = None) -> ControlPlaneApp:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = Database(settings.db_url)
        await asyncio.to_thread(db.migrate)  # no database call on the event loop, even at start
        metrics = Metrics()
        bus = make_bus(settings.redis_url, metrics, settings.replica_id)
        await bus.start()
        worker_token = settings.workers.admin_token
        http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
            headers={"Authorization": f"Bearer {worker_token.get_secret_value()}"}
            if worker_token is not None
            else None,
        )
        client = WorkerClient(
            http,
            load_timeout_s=settings.workers.load_timeout_s,
            probe_timeout_s=settings.workers.probe_timeout_s,
        )
        inflight = Inflight()
        ops = Operations(
            db,
            client,
            bus,
            metrics,
            inflight,
            owner=settings.replica_id,
            lease_s=settings.operations.lease_s,
        )
        reconciler = Reconciler(db, client, bus, metrics, settings.reconciler.interval_s)
        routes = RouteTable(settings.router.route_ttl_s)
        watch_writes(db.engine, routes.invalidate)
        await routes.start(bus)
        tokens = TokenCache(settings.token_cache_s)
        revocations = await follow_revocations(bus, tokens)
        usage = UsageBatch(db, settings.router.usage_flush_s)
        upstream = Upstream(
            probe_timeout_s=settings.workers.probe_timeout_s,
            worker_token=worker_token.get_secret_value() if worker_token is not None else None,
        )
        app.state.services = Services(
            settings=settings,
            db=db,
            client=client,
            bus=bus,
            metrics=metrics,
            inflight=inflight,
            operations=ops,
            reconciler=reconciler,
            sources=SourceResolver(settings.sources),
            routes=routes,
            usage=usage,
            upstream=upstream,
            tokens=tokens,
        )
        settled = await ops.settle_interrupted()
        if settled:
            log.warning("settled %d interrupted operations: %s", len(settled), ", ".join(settled))
        await ops.start()
        await usage.start()
        if settings.reconciler.enabled:
            await reconciler.start()
        # What startup built lives as long as the app: kept out of the cycle collector, whose
        # full passes then scan only what requests allocate instead of pausing the event loop
        # (every stream with it) for tens of milliseconds.
        gc.collect()
        gc.freeze()
        # A thread (a database call, a route lookup) holds the GIL for up to this long while
        # the event loop waits for it: Python's default, 5 ms, is the router's whole p99 budget.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            yield
        finally:
            sys.setswitchinterval(switch_interval)
            gc.unfreeze()
            # Each step is bounded (events.CLOSE_TIMEOUT_S): a stuck socket never hangs shutdown.
            await reconciler.close()
            await ops.close()
            await usage.close()
            await routes.close()
            await stop_tasks([revocations], "token revocations")
            await bus.close()
            await close_within(http.aclose(), "worker HTTP client")
            await close_within(upstream.close(), "router upstream client")
            await asyncio.to_thread(db.close)

    app = ControlPlaneApp(
        title="loraplane control plane",
        version="0.1.0",
        description="Registry of LoRA adapters across workers and DP groups, and an OpenAI-compatible router.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    body_limit: dict[str, Any] = {
        "max_bytes": settings.max_request_bytes,
        "setting": "max_request_bytes",
        "refusal": lambda message: {
            "error": {"code": "too_large", "field": "body", "message": message}
        },
    }
    app.add_middleware(BodyLimit, **body_limit)
    app.inference = BodyLimit(proxy.InferenceRoutes(app), **body_limit)
    routers = (pools, workers, adapters, placements, operations, tokens, proxy, openai, system)
    for module in routers:
        app.include_router(module.router)
    return app
