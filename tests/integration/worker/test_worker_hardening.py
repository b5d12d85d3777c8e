"""A hostile client against a real worker: every bad input a 4xx in the documented error shape
that names the field, quotes little of the input, and leaves the worker serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from workerkit import WorkerProcess, generate, start_worker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(
    tiny_model: Path,
    make_adapter_dir: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    good = make_adapter_dir("good")
    process = start_worker(
        tiny_model,
        tmp_path_factory.mktemp("hardening"),
        "--allowed-lora-root",
        str(good.parent),
        "--max-model-len",
        "64",
        "--lora",
        f"good={good}",
    )
    yield process
    process.stop()


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The documented error body of a refusal with `status`."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    detail: dict[str, Any] = body["error"]
    return detail


def still_serving(worker: WorkerProcess) -> None:
    assert worker.client.get("/health").json() == {"status": "ok"}
    assert generate(worker, "hello", "good", max_tokens=2)["usage"]["completion_tokens"] >= 1


NON_FINITE = ["NaN", "Infinity", "-Infinity"]
ENDPOINTS = {
    "/generate": (
        '{{"text": "hi", "sampling_params": {{"{field}": {value}}}}}',
        "sampling_params.",
    ),
    "/v1/completions": ('{{"prompt": "hi", "{field}": {value}}}', ""),
    "/v1/chat/completions": (
        '{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}',
        "",
    ),
}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_non_finite_sampling_numbers_are_refused_by_name(worker: WorkerProcess, path: str) -> None:
    template, prefix = ENDPOINTS[path]
    for field in ("temperature", "top_p"):
        for value in NON_FINITE:
            body = template.format(field=field, value=value)
            r = worker.client.post(
                path, content=body.encode(), headers={"content-type": "application/json"}
            )
            error = error_of(r, 422)
            assert error["param"] == prefix + field, (body, error)
            assert "finite" in error["message"], error
    still_serving(worker)
