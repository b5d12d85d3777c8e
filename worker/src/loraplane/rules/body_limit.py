"""A request-body limit, as ASGI middleware, for the worker's and the control plane's servers:
a body larger than ``max_bytes`` is refused with 413 as it streams in (a declared
Content-Length before any of it is read), before the app parses it, and a body that stops
arriving (no part of it for ``idle_s`` seconds: a client that declared more than it sends,
or one holding connections open) with 408. Each server names its own setting in the message
and answers in its own error shape (``refusal``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """``setting``: the option a client's operator raises (named in the message);
    ``refusal``: the JSON body of the 413 sent for a declared length, from the message (a body
    found too large as it streams raises ``HTTPException(413)`` for the app's handler)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        setting: str,
        refusal: Callable[[str], dict[str, Any]],
        idle_s: float = 30.0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.setting = setting
        self.refusal = refusal
        self.idle_s = idle_s

    def message(self) -> str:
        return (
            f"body: the request body is larger than the limit of {self.max_bytes} bytes "
            f"({self.setting})"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = json.dumps(self.refusal(self.message())).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        seen, complete = 0, False

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # (after the body: a disconnect, which may come at any time)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except TimeoutError:  # the app's handler for HTTPException answers it
                raise HTTPException(
                    408,
                    f"body: no part of the request body arrived for {self.idle_s:g} s after "
                    f"{seen} bytes; send the whole body (its Content-Length) at once",
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise HTTPException(413, self.message())
            else:
                complete = True
            return message

        await self.app(scope, counted, send)
