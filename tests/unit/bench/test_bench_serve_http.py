"""`loraplane bench serve`'s HTTP client against a real aiohttp server that writes its events
in pieces: an event split across two writes, a last event without its newline, an error
event and an error status are recorded as they are from a worker."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from loraplane.worker.bench.serve import HttpTransport, RequestRecord

pytestmark = pytest.mark.unit


def _event(tokens: int) -> bytes:
    return f"data: {json.dumps({'text': 'x', 'meta_info': {'completion_tokens': tokens}})}\n\n".encode()


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("lora_path") == "ghost":
        error = {"error": {"message": "adapter 'ghost' is not loaded", "code": 404}}
        return web.json_response(error, status=404)
    response = web.StreamResponse()
    await response.prepare(request)
    if body.get("lora_path") == "broken":
        await response.write(_event(1) + b'data: {"error": "engine failed"}\n\n' + _event(2))
        return response
    first, second = _event(1), _event(2)
    await response.write(first + second[:20])  # the second event's line ends in the next write
    await asyncio.sleep(0.05)
    await response.write(second[20:] + _event(2) + b": a comment\n\n" + _event(4).rstrip())
    return response


async def _records(*adapters: str | None) -> list[RequestRecord]:
    app = web.Application()
    app.router.add_post("/generate", _generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    transport = HttpTransport(f"http://127.0.0.1:{port}/", "generate", token=None)
    try:
        records = [RequestRecord(a, 0.0) for a in adapters]
        for record in records:
            await transport.stream([1, 2, 3], record.adapter, 4, record)
        return records
    finally:
        await transport.close()
        await runner.cleanup()


def test_events_split_across_reads_are_recorded_with_their_token_counts() -> None:
    (ok,) = asyncio.run(_records(None))
    assert ok.error is None
    # one chunk per step that brought tokens (the repeated count 2 is no new chunk)
    assert ok.counts == [1, 2, 4] and ok.tokens == 4 and len(ok.chunks) == 3
    assert ok.token_times() == [ok.chunks[0], ok.chunks[1], ok.chunks[2], ok.chunks[2]]


def test_an_error_status_and_an_error_event_are_the_requests_error() -> None:
    ghost, broken = asyncio.run(_records("ghost", "broken"))
    assert ghost.error == "HTTP 404: adapter 'ghost' is not loaded" and not ghost.chunks
    assert broken.error == "engine failed" and broken.counts == [1]  # nothing after it counts
