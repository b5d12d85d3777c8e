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


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_parsed(
    worker: WorkerProcess,
) -> None:
    big = b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}'
    r = worker.client.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    error = error_of(r, 413)
    assert error["param"] == "body" and "16777216 bytes" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        for _ in range(17):
            yield b" " * (1024 * 1024)

    r = worker.client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert error_of(r, 413)["param"] == "body"
    still_serving(worker)


def test_a_prompt_too_long_for_the_model_is_refused_before_tokenizing(
    worker: WorkerProcess,
) -> None:
    five_mb = "word " * (1024 * 1024)
    r = worker.client.post("/v1/completions", json={"prompt": five_mb, "max_tokens": 1})
    error = error_of(r, 400)
    assert error["param"] == "prompt"
    assert f"the prompt has {len(five_mb)} characters" in error["message"], error
    assert len(r.content) < 1000
    r = worker.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": five_mb}]}
    )
    assert error_of(r, 400)["param"] == "messages"
    r = worker.client.post("/generate", json={"text": five_mb})
    assert error_of(r, 400)["param"] == "text"
    still_serving(worker)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/a", "pinned": "yes"}, "pinned"),
        ("/v1/completions", {"prompt": "hi", "stream": "true"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4.5}, "max_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, "sampling_params."),
    ],
)
def test_booleans_and_numbers_are_not_coerced(
    worker: WorkerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(worker.client.post(path, json=body), 422)
    assert error["param"].startswith(param), error
    assert [m["id"] for m in worker.client.get("/v1/models").json()["data"]] == [
        "tiny-llama",
        "good",
    ]


def test_a_body_of_many_bad_items_gets_a_bounded_answer(worker: WorkerProcess) -> None:
    """Every bad item is a validation error; the 422 lists the first few and counts the rest."""
    bad = [{"role": "user", "content": [{"type": "text", "text": 5}] * 4}] * 50
    r = worker.client.post("/v1/chat/completions", json={"messages": bad})
    error = error_of(r, 422)
    assert error["param"] == "messages.0.content.0.text", error
    assert "more" in error["message"] and len(r.content) < 2048, error
    still_serving(worker)


def test_errors_quote_at_most_a_short_prefix_of_the_input(worker: WorkerProcess) -> None:
    huge = "p" * (10 * 1024 * 1024)
    r = worker.client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": huge})
    assert error_of(r, 422)["param"] == "lora_path" and len(r.content) < 1000
    r = worker.client.post("/generate", json={"text": "hi", "lora_path": huge})
    assert error_of(r, 404)["param"] == "lora_path" and len(r.content) < 1000
    r = worker.client.post("/v1/completions", json={"prompt": "hi", "model": huge})
    assert error_of(r, 404)["param"] == "model" and len(r.content) < 1000
    still_serving(worker)


def test_with_a_token_configured_adapter_and_debug_endpoints_refuse_strangers(
    tiny_model: Path, make_adapter_dir: Callable[..., Path], tmp_path: Path
) -> None:
    good = make_adapter_dir("good")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    guarded = start_worker(
        tiny_model,
        tmp_path,
        "--allowed-lora-root",
        str(good.parent),
        "--admin-token-file",
        str(token_file),
        "--enable-fault-injection",
    )
    try:
        c = guarded.client
        load = {"lora_name": "good", "lora_path": str(good)}
        wrong = {"Authorization": "Bearer nope"}
        for headers in ({}, wrong):
            error = error_of(c.post("/load_lora_adapter", json=load, headers=headers), 401)
            assert "admin token" in error["message"] and error["type"] == "authentication_error"
            unload = {"lora_name": "good"}
            error_of(c.post("/unload_lora_adapter", json=unload, headers=headers), 401)
            error_of(c.get("/lora_state", headers=headers), 401)
            fault = {"op": "load", "dp_group": 0}
            error_of(c.post("/debug/fault", json=fault, headers=headers), 401)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-llama"]
        admin = {"Authorization": "Bearer s3cret-token"}
        r = c.post("/load_lora_adapter", json=load, headers=admin)
        assert r.status_code == 200, r.text
        assert c.get("/lora_state", headers=admin).status_code == 200
        # generation and health stay open
        assert generate(guarded, "hello", "good", max_tokens=2)["usage"]["completion_tokens"] >= 1
        assert c.get("/health").status_code == 200
    finally:
        guarded.stop()


def openai_client(worker: WorkerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def test_the_official_openai_client_completes_and_chats_with_text_parts(
    worker: WorkerProcess,
) -> None:
    client = openai_client(worker)
    done = client.completions.create(
        model="tiny-llama:good", prompt="The quick brown fox", max_tokens=3, temperature=0
    )
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 3
    as_string = client.chat.completions.create(
        model="good",
        messages=[{"role": "user", "content": "Say hi\nand bye"}],
        max_tokens=4,
        temperature=0,
    )
    as_parts = client.chat.completions.create(
        model="good",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Say hi"},
                    {"type": "text", "text": "and bye"},
                ],
            }
        ],
        max_tokens=4,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    streamed = client.chat.completions.create(
        model="good",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi\nand bye"}]}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == as_string.choices[0].message.content


UNSUPPORTED_COMPLETION = [
    ("best_of", {"best_of": 2}),
    ("n", {"n": 2}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("logit_bias", {"logit_bias": {"5": 10}}),
]
UNSUPPORTED_CHAT = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("n", {"n": 2}),
    ("presence_penalty", {"presence_penalty": 1.0}),
    ("response_format", {"response_format": {"type": "json_object"}}),
]


@pytest.mark.parametrize(("field", "extra"), UNSUPPORTED_COMPLETION)
def test_unsupported_completion_fields_are_refused_by_name(
    worker: WorkerProcess, field: str, extra: dict[str, Any]
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client(worker).completions.create(
            model="tiny-llama:good", prompt="hi", max_tokens=2, **extra
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field, error
    assert f"{field}: " in error["message"] and "not supported" in error["message"], error


@pytest.mark.parametrize(("field", "extra"), UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_refused_by_name(
    worker: WorkerProcess, field: str, extra: dict[str, Any]
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client(worker).chat.completions.create(
            model="good", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field, error


def test_sglang_penalties_and_non_text_parts_are_refused_by_name(
    worker: WorkerProcess,
) -> None:
    c = worker.client
    r = c.post("/generate", json={"text": "hi", "sampling_params": {"presence_penalty": 0.5}})
    assert error_of(r, 400)["param"] == "sampling_params.presence_penalty"
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]}
    r = c.post("/v1/chat/completions", json=body)
    assert error_of(r, 400)["param"] == "messages.0.content.1.type"
    # the neutral values of those fields are accepted
    r = c.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "best_of": 1, "echo": False, "n": 1},
    )
    assert r.status_code == 200, r.text
    still_serving(worker)


def test_an_idle_keep_alive_connection_outlives_the_routers_idle_time(
    worker: WorkerProcess,
) -> None:
    """A client (the router keeps its idle connections to a worker 30 s) that reuses a
    connection idle for longer than uvicorn's default keep-alive (5 s) gets its answer on it:
    the worker does not close idle connections before its clients do, which would fail
    the request sent just as it closes (seen as a reset by the client)."""
    from tests.keepalive import answers_on_an_idle_connection

    from loraplane.controlplane.upstream import KEEPALIVE_S
    from loraplane.worker.server.factory import ServeConfig

    assert ServeConfig(model="m").keep_alive_s > KEEPALIVE_S
    assert answers_on_an_idle_connection(worker.url, "/health", 6)


SURROGATE = "\ud800"  # a lone surrogate: valid JSON, no Unicode text
LONE = '"\\ud800"'  # the same as it is written in a JSON body


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", f'{{"text": {LONE}}}', "text"),
        ("/generate", f'{{"text": "hi", "rid": {LONE}}}', "rid"),
        ("/v1/completions", f'{{"prompt": {LONE}, "stream": true}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": [{LONE}]}}', "stop"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {LONE}}}]}}',
         "messages.0.content"),
        ("/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}]}}',
         "messages.0.content.0.text"),
        ("/load_lora_adapter", '{"lora_name": "x", "lora_path": "/tmp/a\\u0000b"}', "lora_path"),
    ],
)  # fmt: skip
def test_text_that_is_not_unicode_is_refused_by_name(
    worker: WorkerProcess, path: str, body: str, param: str
) -> None:
    """A lone surrogate reaches no tokenizer (a 500 before) and a NUL no file system."""
    r = worker.client.post(path, content=body, headers={"content-type": "application/json"})
    error = error_of(r, 422)
    assert error["param"] == param, error
    assert "surrogate" in error["message"] or "NUL" in error["message"], error
    still_serving(worker)


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 2}},
         "sampling_params.max_tokens", "did you mean max_new_tokens?"),
        ("/v1/completions", {"prompt": "hi", "max_new_tokens": 2}, "max_new_tokens",
         "did you mean max_tokens?"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate",
         "not a field of this endpoint"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop",
         "a valid string or a valid list"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt.0", "valid integer"),
    ],
)  # fmt: skip
def test_fields_an_endpoint_lacks_are_refused_by_name(
    worker: WorkerProcess, path: str, body: dict[str, Any], param: str, needle: str
) -> None:
    """A misspelt parameter is never silently ignored, and a union's field is named as the
    client wrote it (``stop``, not pydantic's ``stop.str``)."""
    error = error_of(worker.client.post(path, json=body), 422)
    assert error["param"] == param and needle in error["message"], error


def test_bodies_that_are_not_json_objects_are_refused_as_the_body(worker: WorkerProcess) -> None:
    c = worker.client
    json_type = {"content-type": "application/json"}
    error = error_of(c.post("/generate", content='{"text": "hi",', headers=json_type), 422)
    assert error["param"] == "body" and "not valid JSON at character" in error["message"], error
    error = error_of(
        c.post(
            "/v1/completions", content='{"prompt": "hi"}', headers={"content-type": "text/plain"}
        ),
        422,
    )
    assert error["param"] == "body" and "Content-Type: application/json" in error["message"]
    error = error_of(c.post("/generate", content=b'{"text": "\xff"}', headers=json_type), 400)
    assert error["param"] == "body" and "UTF-8 JSON" in error["message"], error
    still_serving(worker)


def test_conflicting_and_out_of_range_sampling_fields_are_refused(worker: WorkerProcess) -> None:
    c = worker.client
    r = c.post("/generate", json={"text": "hi", "input_ids": [1, 2]})
    assert error_of(r, 400)["param"] == "input_ids"
    for ids in ([-1], [10**9]):
        r = c.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": ids})
        assert error_of(r, 400)["param"] == "stop_token_ids"
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"stop_token_ids": ids}})
        assert error_of(r, 400)["param"] == "sampling_params.stop_token_ids"
    for stop in ("", [""]):
        r = c.post("/v1/completions", json={"prompt": "hi", "stop": stop})
        assert error_of(r, 400)["param"] == "stop"
    r = c.post("/generate", json={"text": "hi", "sampling_params": {"stop": ""}})
    assert error_of(r, 400)["param"] == "sampling_params.stop"
    still_serving(worker)


def test_the_answer_names_the_adapter_that_ran(worker: WorkerProcess) -> None:
    """``model`` names the adapter that ran when ``lora_path`` chose it (alone, or beside a
    ``model`` naming the base model, SGLang's way); ``model`` naming another adapter than
    ``lora_path`` is refused."""
    c = worker.client
    body = {"prompt": "hi", "max_tokens": 1}
    r = c.post("/v1/completions", json={**body, "lora_path": "good"})
    assert r.status_code == 200 and r.json()["model"] == "good", r.text
    r = c.post("/v1/completions", json={**body, "model": "tiny-llama", "lora_path": "good"})
    assert r.status_code == 200 and r.json()["model"] == "good", r.text
    r = c.post("/v1/completions", json={**body, "model": "tiny-llama:good", "lora_path": "good"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-llama:good", r.text
    r = c.post(
        "/load_lora_adapter", json={"lora_name": "other", "lora_path": str(worker_adapter(worker))}
    )
    assert r.status_code == 200, r.text
    try:
        r = c.post("/v1/completions", json={**body, "model": "good", "lora_path": "other"})
        assert error_of(r, 400)["param"] == "lora_path"
    finally:
        assert c.post("/unload_lora_adapter", json={"lora_name": "other"}).status_code == 200


def worker_adapter(worker: WorkerProcess) -> str:
    """The path the worker loaded ``good`` from."""
    models = worker.client.get("/v1/models").json()["data"]
    return next(m["root"] for m in models if m["id"] == "good")


def test_a_model_card_by_name_and_the_default_length_of_a_null_max_tokens(
    worker: WorkerProcess,
) -> None:
    c = worker.client
    card = c.get("/v1/models/good").json()
    assert card["id"] == "good" and card["parent"] == "tiny-llama", card
    assert c.get("/v1/models/tiny-llama").json()["id"] == "tiny-llama"
    assert error_of(c.get("/v1/models/nope"), 404)["param"] == "model"
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
