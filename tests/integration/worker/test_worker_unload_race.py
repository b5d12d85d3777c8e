"""An unload racing a request for its adapter (ADR 0012): the front end routes from its copy of
the adapter routes, closed to the adapter from the moment the unload is sent. A request routed
before reaches the core ahead of the unload and finishes on its adapter version; one after is
answered 404 naming the adapter, streamed or not, never 500."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def served(tiny_model: Path, make_adapter_dir: Callable[..., Path]) -> Iterator[tuple[Any, Any]]:
    """A worker app in this process over its engine core's process, holding adapter `race`."""
    from fastapi.testclient import TestClient

    from loraplane.worker.server.app import create_app
    from loraplane.worker.server.factory import ServeConfig
    from loraplane.worker.server.serve import build_server

    path = make_adapter_dir("race", seed=11)
    config = ServeConfig(
        model=str(tiny_model),
        lora_backend="torch",
        sampler="torch",
        max_model_len=64,
        loras=(("race", str(path)),),
    )
    server = build_server(config)
    try:
        with TestClient(create_app(server)) as client:
            yield server, client
    finally:
        server.engine.stop()


BODIES = {
    "/v1/completions": {"model": "race", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "race",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/generate": {"text": "hi", "lora_path": "race", "sampling_params": {"max_new_tokens": 2}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_requests_sent_while_an_unload_runs_are_answered_404_naming_the_adapter(
    served: tuple[Any, Any], stream: bool
) -> None:
    server, client = served
    assert client.post("/v1/completions", json=BODIES["/v1/completions"]).status_code == 200
    # the core frozen: the unload is sent and not answered while the requests come
    os.kill(server.engine.pid, signal.SIGSTOP)
    try:
        unloading = server.engine.unload_adapter("race")
        for path, body in BODIES.items():
            r = client.post(path, json={**body, "stream": stream})
            assert r.status_code == 404, (path, r.text)
            error = r.json()["error"]
            field = "lora_path" if path == "/generate" else "model"  # (the field naming it)
            assert error["param"] == field and "'race'" in error["message"], error
            assert "being unloaded" in error["message"], error
            assert error["code"] == 404 and error["type"] == "not_found", error
    finally:
        os.kill(server.engine.pid, signal.SIGCONT)
    assert unloading.result(timeout=60).success
    r = client.post("/v1/completions", json=BODIES["/v1/completions"])
    assert r.status_code == 404 and "'race'" in r.json()["error"]["message"], r.text
    # the worker serves on: the base model answers
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_request_routed_before_the_unload_finishes_on_its_adapter(
    served: tuple[Any, Any],
) -> None:
    server, client = served
    body = {**BODIES["/v1/completions"], "max_tokens": 12, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert server.engine.unload_adapter("race").result(timeout=60).success
        rest = [line for line in lines if line.startswith("data: {")]
    last = json.loads(rest[-1][6:]) if rest else json.loads(first[6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 12


def test_a_core_refusing_an_unknown_adapter_is_answered_404(served: tuple[Any, Any]) -> None:
    """The core's own refusal (a front end whose routes still hold the adapter) is a 404."""
    server, client = served
    routed = server.engine._routes  # the front end's copy of the routes, with `race` in it
    r = client.post("/unload_lora_adapter", json={"lora_name": "race"})
    assert r.status_code == 200, r.text
    server.engine._routes = routed
    r = client.post("/v1/completions", json=BODIES["/v1/completions"])
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "'race'" in error["message"], error
