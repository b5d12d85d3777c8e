"""The router's client for proxied inference requests (aiohttp), apart from ``workers.py``'s
httpx client for the worker API.

One proxied stream costs the router about an eighth of the CPU over aiohttp that it costs over
httpx, whose connection pool scans every connection on each request: with a few hundred
streams open, that scan was most of the router's time (docs/performance.md, "Router").
Errors keep ``WorkerClient``'s meaning: no connection is ``WorkerUnreachable`` (the worker is
gone), a connected worker that does not answer within the request timeout is
``WorkerTimeout`` (busy, not gone).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from yarl import URL

from loraplane.controlplane.workers import WorkerTimeout, WorkerUnreachable

# Upstream reads go straight to the client; a larger read buffer only means fewer reads.
READ_BUFSIZE = 1 << 20
# An idle connection to a worker is closed after this long: below the worker's own
# keep-alive (`loraplane worker serve --keep-alive-timeout`, 75 s), so the router closes
# first and never sends a request on a connection the worker is closing.
KEEPALIVE_S = 30
_JSON = {"Content-Type": "application/json"}


class Upstream:
    def __init__(self, *, probe_timeout_s: float, worker_token: str | None) -> None:
        self.probe_timeout_s = probe_timeout_s
        headers = {"Authorization": f"Bearer {worker_token}"} if worker_token else None
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers=headers,
            read_bufsize=READ_BUFSIZE,
            timeout=aiohttp.ClientTimeout(total=None),
            cookie_jar=aiohttp.DummyCookieJar(),  # workers set none: nothing to store or send
        )
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once per worker and path
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}  # one per request timeout

    async def open(
        self, worker: str, endpoint: str, path: str, body: dict[str, Any], timeout_s: float
    ) -> aiohttp.ClientResponse:
        """Send a proxied request; the caller reads and must ``close``/``release`` the answer.
        Connecting has the probe timeout; answering, and each read after it, ``timeout_s``."""
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            timeout = self._timeouts[timeout_s] = aiohttp.ClientTimeout(
                total=None, connect=min(timeout_s, self.probe_timeout_s), sock_read=timeout_s
            )
        url = self._urls.get((endpoint, path))
        if url is None:
            url = self._urls[(endpoint, path)] = URL(f"{endpoint}{path}")
        try:
            # (the body as bytes: aiohttp's JSON payload object costs more than the encoding)
            return await self.session.post(
                url, data=json.dumps(body).encode(), headers=_JSON, timeout=timeout
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise WorkerUnreachable(f"worker {worker}: ConnectTimeout: {exc}") from exc
        except TimeoutError as exc:
            raise WorkerTimeout(
                f"worker {worker} did not answer within {timeout_s:g} s "
                f"({type(exc).__name__}); raise router.request_timeout_s or ask for fewer tokens"
            ) from exc
        except aiohttp.ClientError as exc:
            raise WorkerUnreachable(
                f"worker {worker}: {type(exc).__name__}: {exc or 'no answer'}"
            ) from exc

    async def close(self) -> None:
        await self.session.close()


async def lines(response: aiohttp.ClientResponse) -> AsyncGenerator[list[bytes], None]:
    """The answer's complete lines (without their ``\\n``), as many as each read brought; a last
    line without a newline comes alone at the end."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *complete, pending = pending.split(b"\n")
        if complete:
            yield complete
    if pending:
        yield [pending]
