"""An unload racing a request for its adapter (ADR 0012): the front end routes from its copy of
the adapter routes, which the unload's answer brings up to date; a request routed from the
copy before that reaches a core that no longer holds the adapter. It is answered 404 naming
the adapter, streamed or not, never 500."""

from __future__ import annotations

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
def test_a_request_routed_before_an_unload_is_answered_404_naming_the_adapter(
    served: tuple[Any, Any], stream: bool
) -> None:
    server, client = served
    assert client.post("/v1/completions", json=BODIES["/v1/completions"]).status_code == 200
    routed = server.engine._routes  # the front end's copy of the routes, with `race` in it
    r = client.post("/unload_lora_adapter", json={"lora_name": "race"})
    assert r.status_code == 200, r.text
    # the race: requests routed from the copy as it was before the unload's routes came back
    server.engine._routes = routed
    for path, body in BODIES.items():
        r = client.post(path, json={**body, "stream": stream})
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "model" and "'race'" in error["message"], error
        assert error["code"] == 404 and error["type"] == "not_found", error
    # the worker serves on: the base model answers
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
