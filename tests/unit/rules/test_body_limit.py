"""The request-body guard both servers put first: too large (413) and stalled (408)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loraplane.rules.body_limit import BodyLimit

pytestmark = pytest.mark.unit


def app_with(idle_s: float) -> Any:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    @app.exception_handler(HTTPException)
    async def refused(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    return BodyLimit(
        app, max_bytes=100, setting="--limit", refusal=lambda m: {"m": m}, idle_s=idle_s
    )


def call(app: Any, chunks: list[bytes | None], length: int) -> tuple[int, bytes]:
    """POST /echo with ``chunks`` (None: the client goes quiet)."""
    sent: list[dict[str, Any]] = []
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        if not queue:
            return {"type": "http.disconnect"}
        chunk = queue.pop(0)
        if chunk is None:
            await asyncio.sleep(3600)  # a client that declared more than it sends
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo",
        "query_string": b"", "headers": [(b"content-length", str(length).encode())],
        "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
        "root_path": "",
    }  # fmt: skip
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_whole_body_passes_and_a_stalled_one_is_refused_with_408() -> None:
    app = app_with(idle_s=0.2)
    assert call(app, [b"ab", b"cd"], 4) == (200, b'{"bytes":4}')
    status, body = call(app, [b"ab", None], 10)
    assert status == 408 and b"no part of the request body arrived for 0.2 s after 2 bytes" in body


def test_a_body_past_the_limit_is_refused_with_413() -> None:
    status, body = call(app_with(idle_s=5), [b"x" * 60, b"x" * 60], 100)
    assert status == 413 and b"--limit" in body
