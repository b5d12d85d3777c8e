"""Pure pieces of the router's request path (``api/proxy.py``): the rewrite of ``model`` in a
worker's stream (``ModelSwap``: whichever way an event is written, the client reads the same
JSON as a full parse and rewrite would give it, and every other line passes unchanged) and the
path the app routes on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loraplane.controlplane.api.openai import Route
from loraplane.controlplane.api.proxy import ModelSwap, route_path
from loraplane.controlplane.plans import WorkerRef

pytestmark = pytest.mark.unit

SENT = "default/a0@3"  # what the worker was sent (and echoes)
NAMED = "bench:a0"  # what the client asked for


def swap() -> ModelSwap:
    worker = WorkerRef(id=1, name="w0", endpoint="http://w0", dp_size=1)
    return ModelSwap.of(Route(worker, SENT, 7, "a0", SENT), NAMED)


def through_json(payload: bytes) -> Any:
    """What the client should read: the event parsed, its top-level model replaced."""
    body = json.loads(payload)
    if isinstance(body, dict) and "model" in body:
        body["model"] = NAMED
    return body


EVENTS = [
    # the worker's own shape (compact separators) and json.dumps' default one
    {"id": "cmpl-1", "object": "text_completion", "model": SENT, "choices": [{"text": " t"}]},
    {"model": SENT, "choices": []},
    # a nested "model" before the top-level one: only the top-level one is the client's
    {"meta": {"model": SENT}, "model": SENT},
    # a nested "model" alone is not the event's model
    {"meta": {"model": SENT}},
    {"choices": [{"model": SENT}]},
    # a key that ends in the quoted word
    {'a"model': SENT},
    # text that quotes the key, escaped inside a string
    {"choices": [{"text": '"model": "default/a0@3"'}], "model": SENT},
    {"id": 'x\\"model', "model": SENT},
    # a worker echoing something else, or nothing
    {"model": "other", "choices": []},
    {"choices": [{"text": "no model here"}]},
    {"model": SENT, "x": {"model": "inner"}},
    {"model": SENT + "-longer"},
    {"text": "non-ascii \u00e9\u4e2d", "model": SENT},
]


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_an_event_reads_as_the_json_rewrite_would_give_it(
    event: dict[str, Any], separators: tuple[str, str]
) -> None:
    payload = json.dumps(event, separators=separators, ensure_ascii=False).encode()
    block = b"data: " + payload + b"\n\n"
    out = swap().lines(block)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert json.loads(out[6:]) == through_json(payload)


def test_lines_other_than_json_events_pass_unchanged() -> None:
    block = b": keep-alive\nevent: x\ndata: [DONE]\ndata: not json\n\n"
    assert swap().lines(block) == block
    assert swap().lines(b"\n\n") == b"\n\n"


def test_several_events_in_one_read_are_each_rewritten() -> None:
    events = [{"model": SENT, "choices": [{"text": f" t{i}"}]} for i in range(3)]
    block = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    out = swap().lines(block + b"data: [DONE]\n\n")
    lines = [line for line in out.split(b"\n") if line]
    assert [json.loads(line[6:])["model"] for line in lines[:3]] == [NAMED] * 3
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:3]] == [
        " t0",
        " t1",
        " t2",
    ]
    assert lines[3] == b"data: [DONE]"


@pytest.mark.parametrize(
    ("path", "root_path", "routed"),
    [
        ("/v1/completions", "", "/v1/completions"),
        ("/api/v1/completions", "/api", "/v1/completions"),
        ("/apiv1/completions", "/api", "/apiv1/completions"),
        ("/v1/completions", "/api", "/v1/completions"),
    ],
)
def test_the_routed_path_drops_the_root_path_as_starlette_does(
    path: str, root_path: str, routed: str
) -> None:
    assert route_path({"path": path, "root_path": root_path}) == routed
