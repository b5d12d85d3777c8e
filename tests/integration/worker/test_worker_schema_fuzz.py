"""schemathesis against a real worker's OpenAPI schema: no input it generates gets a 5xx, and
every 4xx is the documented error body (or the documented adapter-update body)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.schema_fuzz import fuzz
from workerkit import WorkerProcess, start_worker

pytestmark = pytest.mark.integration
TOKEN = "fuzz-admin-token"
ERROR_KEYS = {"message", "type", "param", "code"}
UPDATE_KEYS = {"success", "error_message", "loaded_adapters"}


@pytest.fixture(scope="module")
def fuzzed_worker(
    tiny_model: Path,
    make_adapter_dir: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    good = make_adapter_dir("good")
    tmp = tmp_path_factory.mktemp("fuzz")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    process = start_worker(
        tiny_model,
        tmp,
        "--allowed-lora-root",
        str(good.parent),
        "--max-model-len",
        "48",
        "--lora",
        f"good={good}",
        "--admin-token-file",
        str(token_file),
        "--enable-fault-injection",
    )
    yield process
    process.stop()


def test_the_worker_answers_every_generated_request_without_a_5xx(
    fuzzed_worker: WorkerProcess,
) -> None:
    statuses: Counter[int] = Counter()

    def check(case: Any, response: Any) -> None:
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        if 400 <= response.status_code < 500:
            body = response.json()
            if set(body) == UPDATE_KEYS:  # /load_lora_adapter, /unload_lora_adapter
                assert body["success"] is False and body["error_message"], body
            else:
                assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
                assert body["error"]["code"] == response.status_code, body
            assert len(response.content) < 4096, response.text[:500]

    labels = fuzz(fuzzed_worker.url, {"Authorization": f"Bearer {TOKEN}"}, check, examples=20)
    assert "POST /v1/chat/completions" in labels and "POST /load_lora_adapter" in labels
    assert {200, 422} <= set(statuses) and sum(statuses.values()) > 100, statuses
