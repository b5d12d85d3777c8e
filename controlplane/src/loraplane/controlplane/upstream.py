"""The router's client for proxied inference requests, apart from ``workers.py``'s httpx client
for the worker API: HTTP/1.1 on asyncio protocols, with httptools (the parser uvicorn uses)
reading the answers, and a pool of kept-alive connections per worker.

It does what the router needs and no more: a JSON ``POST``, an answer read as it arrives
(content-length or chunked), connections kept for the next request once an answer was read
to its end. A general client pays for what this path never uses on every request (aiohttp's
request object, its headers and cookie handling, its timers and connector: a third of the
router's own time before the first token, docs/performance.md, "The control plane's
router"); httpx's pool also scans every connection on each request.

Errors keep ``WorkerClient``'s meaning: no connection is ``WorkerUnreachable`` (the worker is
gone), a connected worker that does not answer within the request timeout is
``WorkerTimeout`` (busy, not gone). Past the answer's head, a read that waits longer than the
request timeout raises ``TimeoutError`` and a connection that fails raises ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httptools

from loraplane.controlplane.workers import WorkerTimeout, WorkerUnreachable

# An idle connection to a worker is closed after this long: below the worker's own
# keep-alive (`loraplane worker serve --keep-alive-timeout`, 75 s), so the router closes
# first and never sends a request on a connection the worker is closing.
KEEPALIVE_S = 30
# Bytes held for a reader before the connection stops reading (resumed as the reader drains).
HIGH_WATER = 1 << 20


class UpstreamError(ConnectionError):
    """The worker's connection failed, closed or sent what is not HTTP, mid-answer."""


class _Endpoint:
    """One worker endpoint (``http://host:port`` or ``https://…``): where to connect, the bytes
    every request to it starts with, and its idle connections (the most recent last)."""

    __slots__ = ("head", "host", "idle", "port", "ssl")

    def __init__(self, endpoint: str, auth: bytes) -> None:
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"worker endpoint {endpoint!r}: expected http(s)://host[:port]")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self.head = (
            f"Host: {url.netloc}\r\nContent-Type: application/json\r\nAccept-Encoding: identity\r\n"
        ).encode("latin-1") + auth
        self.idle: deque[_Connection] = deque()


class _Connection(asyncio.Protocol):
    """One connection to a worker; the httptools parser calls its ``on_*`` methods."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"not an HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reason = f": {exc}" if exc else ""
        self._fail(UpstreamError(f"the worker closed the connection{reason}"))

    # --- parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        response._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response._end()

    # ---
    def _fail(self, exc: UpstreamError) -> None:
        if self.response is not None and not self.response.eof:
            self.response._fail(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A worker's answer: ``status`` and ``headers`` (names in lower case) once ``open``
    returns, the body through ``readany``/``read``. End with ``release`` (a connection read to
    the end is kept for the next request) or ``close``."""

    def __init__(self, connection: _Connection, endpoint: _Endpoint, read_timeout_s: float):
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.eof = False  # the whole answer has arrived (some of it may still be buffered)
        self.started = False  # any byte of the answer arrived
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._connection: _Connection | None = connection
        self._endpoint = endpoint
        self._timeout_s = read_timeout_s

    # --- from the connection
    def _wake(self) -> None:
        self.started = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and self._connection is not None:
            assert self._connection.transport is not None
            self._connection.transport.pause_reading()
        self._wake()

    def _end(self) -> None:
        self.eof = True
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        self._error = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- for the reader
    async def _wait(self) -> None:
        """Until the connection brings something (head, body, end or failure), at most the
        read timeout."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _head(self) -> None:
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def readany(self) -> bytes:
        """What has arrived since the last read (waiting for something); ``b""`` at the end."""
        while not self._chunks:
            if self.eof:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER and self._connection is not None:
            assert self._connection.transport is not None
            self._connection.transport.resume_reading()
        self._buffered = 0
        return data

    def at_eof(self) -> bool:
        """The whole answer has arrived and been read."""
        return self.eof and not self._chunks

    async def read(self) -> bytes:
        """The rest of the answer."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the answer was read
        to its end and the worker keeps it open, else it is closed."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.response = None
        if self.at_eof() and self.keep_alive and self._error is None and not connection.closed:
            connection.idle_since = asyncio.get_running_loop().time()
            self._endpoint.idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Done with the answer, its connection closed (whatever was left unread)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.response = None
            connection.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Upstream:
    def __init__(self, *, probe_timeout_s: float, worker_token: str | None) -> None:
        self.probe_timeout_s = probe_timeout_s
        self._auth = f"Authorization: Bearer {worker_token}\r\n".encode() if worker_token else b""
        self._endpoints: dict[str, _Endpoint] = {}
        self._paths: dict[str, bytes] = {}  # request lines, one per path

    async def open(
        self, worker: str, endpoint: str, path: str, body: dict[str, Any], timeout_s: float
    ) -> Response:
        """Send a proxied request; the caller reads and must ``close``/``release`` the answer.
        Connecting has the probe timeout; answering, and each read after it, ``timeout_s``.
        A kept connection that the worker closed before answering is replaced once."""
        target = self._endpoints.get(endpoint)
        if target is None:
            target = self._endpoints[endpoint] = _Endpoint(endpoint, self._auth)
        line = self._paths.get(path)
        if line is None:
            line = self._paths[path] = f"POST {path} HTTP/1.1\r\n".encode("latin-1")
        payload = json.dumps(body).encode()
        request = b"%s%sContent-Length: %d\r\n\r\n%s" % (line, target.head, len(payload), payload)
        while True:
            connection = self._kept(target)
            kept = connection is not None
            if connection is None:
                connection = await self._connect(worker, target, timeout_s)
            response = Response(connection, target, timeout_s)
            connection.response = response
            assert connection.transport is not None
            connection.transport.write(request)
            try:
                await response._head()
                return response
            except UpstreamError as exc:
                response.close()
                if kept and not response.started:
                    continue  # the worker closed the kept connection first: a new one
                raise WorkerUnreachable(f"worker {worker}: {exc}") from exc
            except TimeoutError as exc:
                response.close()
                raise WorkerTimeout(
                    f"worker {worker} did not answer within {timeout_s:g} s; raise "
                    "router.request_timeout_s or ask for fewer tokens"
                ) from exc
            except BaseException:
                response.close()
                raise

    def _kept(self, target: _Endpoint) -> _Connection | None:
        """The most recently used idle connection to ``target`` still worth using."""
        idle = target.idle
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                # (older ones past the keep-alive go now: they would go on their next turn)
                while idle and now - idle[0].idle_since >= KEEPALIVE_S:
                    idle.popleft().close()
                return connection
            connection.close()
        return None

    async def _connect(self, worker: str, target: _Endpoint, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(timeout_s, self.probe_timeout_s)):
                _, connection = await loop.create_connection(
                    _Connection, target.host, target.port, ssl=target.ssl
                )
        except TimeoutError as exc:
            raise WorkerUnreachable(f"worker {worker}: ConnectTimeout") from exc
        except OSError as exc:
            raise WorkerUnreachable(f"worker {worker}: {type(exc).__name__}: {exc}") from exc
        return connection

    async def close(self) -> None:
        """Close every idle connection (answers still being read close with their readers)."""
        for target in self._endpoints.values():
            while target.idle:
                target.idle.pop().close()
