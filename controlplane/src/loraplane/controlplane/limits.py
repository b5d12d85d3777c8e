"""A request-body limit: a body larger than ``max_request_bytes`` is refused with 413 as it
streams in (a declared Content-Length before any of it is read), before anything parses it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Message = MutableMapping[str, Any]
ASGIApp = Callable[..., Awaitable[None]]


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def message(self) -> str:
        return (
            f"body: the request body is larger than the limit of {self.max_bytes} bytes "
            "(max_request_bytes)"
        )

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = json.dumps(
                {"error": {"code": "too_large", "field": "body", "message": self.message()}}
            ).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # answered by the app's HTTPException handler
                    raise HTTPException(413, self.message())
            return message

        await self.app(scope, counted, send)
