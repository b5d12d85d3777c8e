"""Health, readiness, metrics and the event stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplane.controlplane.deps import Reader, ServicesDep

router = APIRouter(tags=["system"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: ServicesDep) -> JSONResponse:
    database = await asyncio.to_thread(services.db.ping)
    body: dict[str, Any] = {"database": "ok" if database else "down", "redis": services.bus.state}
    return JSONResponse(body, status_code=200 if database else 503)


@router.get("/metrics")
async def metrics(services: ServicesDep) -> Response:
    # On the event loop, not a thread: the reconciler rewrites its gauges between two awaits,
    # so a scrape never sees them half rewritten.
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/events")
async def events(request: Request, services: ServicesDep, principal: Reader) -> StreamingResponse:
    async def stream() -> AsyncIterator[bytes]:
        async with services.bus.subscribe() as queue:
            yield b": subscribed\n\n"
            while not await request.is_disconnected():
                try:
                    async with asyncio.timeout(1.0):  # not wait_for: see Reconciler._loop
                        event = await queue.get()
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if not principal.sees(event.get("namespace") or ""):
                    continue  # another namespace's, or of none: cluster-wide readers only
                yield f"data: {json.dumps(event)}\n\n".encode()

    return StreamingResponse(stream(), media_type="text/event-stream")
