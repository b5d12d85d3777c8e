"""The router's upstream client (``upstream.py``) against a real TCP server that writes its
answers byte by byte as a test scripts them: what a worker sends is read as it arrives, kept
connections are reused, and every way a worker can fail reads as the error the router maps
(gone: ``WorkerUnreachable``; busy: ``WorkerTimeout``; mid-answer: ``UpstreamError``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from loraplane.controlplane.upstream import HIGH_WATER, Upstream, UpstreamError
from loraplane.controlplane.workers import WorkerTimeout, WorkerUnreachable

pytestmark = pytest.mark.unit

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One request as the server saw it: its line, headers (lower-case names) and JSON body."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head.decode("latin-1").split("\r\n")[:-2]
    headers = dict(f.split(": ", 1) for f in fields)
    headers = {k.lower(): v for k, v in headers.items()}
    body = await reader.readexactly(int(headers["content-length"]))
    return {"line": line, "headers": headers, "body": json.loads(body)}


class Server:
    """``handler(reader, writer, state)`` per connection; ``state`` counts connections and
    keeps the requests seen."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.state: dict[str, Any] = {"connections": 0, "requests": []}
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.state["connections"] += 1
            try:
                await self.handler(reader, writer, self.state)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@asynccontextmanager
async def connected(
    handler: Handler, token: str | None = None
) -> AsyncIterator[tuple[Server, Upstream, str]]:
    """A server running ``handler``, an ``Upstream`` for it and its URL; the client's kept
    connections are closed after."""
    server = Server(handler)
    upstream = Upstream(probe_timeout_s=2, worker_token=token)
    try:
        async with server as url:
            yield server, upstream, url
    finally:
        await upstream.close()


async def ask_each(handler: Handler, bodies: list[dict[str, Any]], pause_s: float = 0) -> Server:
    """Each body sent in turn through one ``Upstream`` to a server running ``handler``, each
    answer read whole (it must be ``ok``) and released, ``pause_s`` apart; the server, after."""
    async with connected(handler) as (server, upstream, url):
        for body in bodies:
            r = await upstream.open("w0", url, "/v1/completions", body, 5)
            assert await r.read() == b"ok"
            r.release()
            await asyncio.sleep(pause_s)
    return server


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


def test_a_stream_is_read_as_it_arrives_and_its_connection_serves_the_next_request() -> None:
    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        while True:
            state["requests"].append(await read_request(reader))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + chunked(b"data: 1\n\n")
            )
            await writer.drain()
            await state["go"].wait()  # the client reads the first event before the rest
            state["go"].clear()
            writer.write(chunked(b"data: 2\n\n", b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with connected(handler, "secret") as (server, upstream, url):
            server.state["go"] = asyncio.Event()
            for n in range(2):
                r = await upstream.open("w0", url, "/v1/completions", {"prompt": "hi", "n": n}, 5)
                assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
                assert await r.readany() == b"data: 1\n\n" and not r.at_eof()
                server.state["go"].set()
                rest = b""
                while chunk := await r.readany():
                    rest += chunk
                assert rest == b"data: 2\n\ndata: [DONE]\n\n" and r.at_eof()
                r.release()
        assert server.state["connections"] == 1  # the second request reused the first's
        first = server.state["requests"][0]
        assert first["line"] == "POST /v1/completions HTTP/1.1"
        assert first["headers"]["authorization"] == "Bearer secret"
        assert first["headers"]["content-type"] == "application/json"
        assert first["headers"]["host"] == url.removeprefix("http://")
        assert [r["body"] for r in server.state["requests"]] == [
            {"prompt": "hi", "n": 0},
            {"prompt": "hi", "n": 1},
        ]

    asyncio.run(main())


def test_a_whole_answer_of_known_length_and_its_status_pass_through() -> None:
    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        await read_request(reader)
        body = b'{"error": {"message": "no adapter"}}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body[:10])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body[10:])
        await writer.drain()
        await reader.read()  # until the client closes

    async def main() -> None:
        async with connected(handler) as (_, upstream, url):
            r = await upstream.open("w0", url, "/v1/completions", {}, 5)
            assert r.status == 404
            assert json.loads(await r.read()) == {"error": {"message": "no adapter"}}
            r.close()

    asyncio.run(main())


def test_an_answer_larger_than_the_read_buffer_arrives_whole_to_a_slow_reader() -> None:
    """3 MB, read a piece at a time with pauses: the connection stops reading past 1 MB held
    and goes on as the reader drains, and every byte arrives, in order."""
    body = bytes(range(256)) * (3 * 4096)

    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with connected(handler) as (_, upstream, url):
            r = await upstream.open("w0", url, "/v1/completions", {}, 5)
            await asyncio.sleep(0.3)  # (the worker's whole answer could have arrived by now)
            assert HIGH_WATER < r._buffered < len(body)  # but the connection stopped reading
            got = b""
            while chunk := await r.readany():
                got += chunk
                await asyncio.sleep(0.001)
            assert got == body and r.at_eof()
            r.release()

    asyncio.run(main())


def test_a_kept_connection_the_worker_closed_is_replaced_without_an_error() -> None:
    """The worker answers and closes its side at once (no ``Connection: close`` said): the
    next request finds the kept connection dead and goes out on a new one."""

    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        await read_request(reader)
        writer.write(OK)
        await writer.drain()

    async def main() -> None:
        server = await ask_each(handler, [{}, {}, {}], pause_s=0.05)  # (the close arrives)
        assert server.state["connections"] == 3

    asyncio.run(main())


def test_a_request_on_a_kept_connection_that_the_worker_drops_unanswered_goes_out_again() -> None:
    """The worker takes the second request on a kept connection and closes it without a byte
    of answer (as one does that closes an idle connection just as a request arrives): the
    request goes out once more, on a new connection, and is answered there."""

    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        first = state["connections"] == 1
        while True:
            state["requests"].append(await read_request(reader))
            if first and len(state["requests"]) == 2:
                return  # closes unanswered
            writer.write(OK)
            await writer.drain()

    async def main() -> None:
        server = await ask_each(handler, [{"n": 0}, {"n": 1}])
        assert server.state["connections"] == 2
        assert [r["body"]["n"] for r in server.state["requests"]] == [0, 1, 1]

    asyncio.run(main())


def test_a_worker_that_does_not_answer_in_time_is_busy_and_one_not_listening_is_gone() -> None:
    async def silent(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        await read_request(reader)
        await asyncio.sleep(5)

    async def main() -> None:
        upstream = Upstream(probe_timeout_s=2, worker_token=None)
        async with Server(silent) as url:
            with pytest.raises(WorkerTimeout, match=r"did not answer within 0\.2 s"):
                await upstream.open("w0", url, "/v1/completions", {}, 0.2)
        with pytest.raises(WorkerUnreachable, match="worker w0: ConnectionRefusedError"):
            await upstream.open("w0", url, "/v1/completions", {}, 5)
        await upstream.close()

    asyncio.run(main())


def test_a_worker_that_stops_mid_answer_fails_the_read_and_its_connection_is_not_kept() -> None:
    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        state["requests"].append(await read_request(reader))
        if len(state["requests"]) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(chunked(b"data: 1\n\n"))
            await writer.drain()
            return  # closes mid-stream
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with connected(handler) as (server, upstream, url):
            r = await upstream.open("w0", url, "/v1/completions", {}, 5)
            assert await r.readany() == b"data: 1\n\n"
            with pytest.raises(UpstreamError, match="closed the connection"):
                await r.readany()
            assert not r.at_eof()
            r.release()  # (not read to its end: closed, not kept)
            r = await upstream.open("w0", url, "/v1/completions", {}, 5)
            assert r.status == 200 and await r.read() == b""
            r.release()
        assert server.state["connections"] == 2

    asyncio.run(main())


def test_what_is_not_http_reads_as_a_worker_gone() -> None:
    async def handler(reader, writer, state) -> None:  # type: ignore[no-untyped-def]
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with connected(handler) as (_, upstream, url):
            with pytest.raises(WorkerUnreachable, match="not an HTTP answer"):
                await upstream.open("w0", url, "/v1/completions", {}, 5)

    asyncio.run(main())


def test_an_endpoint_that_is_not_http_is_refused_by_name() -> None:
    async def main() -> None:
        upstream = Upstream(probe_timeout_s=2, worker_token=None)
        with pytest.raises(ValueError, match="worker endpoint 'w0:8000': expected http"):
            await upstream.open("w0", "w0:8000", "/v1/completions", {}, 5)

    asyncio.run(main())
