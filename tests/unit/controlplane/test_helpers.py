"""Small pure pieces: validation-error field names, model rewriting, the in-process event bus."""

from __future__ import annotations

import asyncio
import json

import pytest

from loraplane.controlplane.api.openai import rewrite_model
from loraplane.controlplane.events import EventBus
from loraplane.controlplane.operations import request_hash
from loraplane.rules.validation import described, field_path

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("loc", "field"),
    [
        (("body", "placement", "literal['all']"), "body.placement"),
        (("body", "placement", "PlacementCount", "count"), "body.placement.count"),
        (("body", "source", "sha256"), "body.source.sha256"),
        (("query", "limit"), "query.limit"),
        (("body", "targets", 0, "name"), "body.targets.0.name"),
    ],
)
def test_validation_error_fields_drop_union_member_tags(
    loc: tuple[object, ...], field: str
) -> None:
    assert ".".join(field_path(loc, keep_body=True)) == field


def test_validation_errors_name_fields_as_written_and_merge_union_branches() -> None:
    """``stop: 5`` fails both branches for their type: one message; a list of text parts with
    one bad part is told about the part, not that it is no string; an unknown field gets the
    field meant."""
    errors = [
        {"loc": ("body", "stop", "str"), "type": "string_type", "msg": "Input should be a valid string"},
        {"loc": ("body", "stop", "list[str]"), "type": "list_type", "msg": "Input should be a valid list"},
        {"loc": ("body", "messages", 0, "content", "str"), "type": "string_type", "msg": "Input should be a valid string"},
        {"loc": ("body", "messages", 0, "content", "list[ContentPart]", 0, "text"), "type": "value_error", "msg": "Value error, holds a lone surrogate"},
        {"loc": ("body", "max_new_tokens"), "type": "extra_forbidden", "msg": "Extra inputs are not permitted"},
    ]  # fmt: skip
    assert described(errors, keep_body=False, meant={("max_new_tokens",): "max_tokens"}) == [
        ("stop", "Input should be a valid string or a valid list"),
        ("messages.0.content.0.text", "holds a lone surrogate"),
        ("max_new_tokens", "not a field of this endpoint (did you mean max_tokens?)"),
    ]


def test_rewrite_model_sets_what_the_client_sent() -> None:
    body = json.dumps({"id": "x", "model": "team-a.sql_v2", "choices": []}).encode()
    assert json.loads(rewrite_model(body, "tiny:sql"))["model"] == "tiny:sql"
    assert rewrite_model(b"not json", "m") == b"not json"
    assert rewrite_model(b'{"no_model": 1}', "m") == b'{"no_model": 1}'


def test_request_hash_is_stable_and_order_independent() -> None:
    assert request_hash("load", {"a": 1, "b": 2}) == request_hash("load", {"b": 2, "a": 1})
    assert request_hash("load", {"a": 1}) != request_hash("unload", {"a": 1})


def test_in_process_bus_delivers_to_every_subscriber() -> None:
    async def run() -> tuple[list[str], list[str]]:
        bus = EventBus(replica_id="r1")
        async with bus.subscribe() as first, bus.subscribe() as second:
            await bus.publish("worker.registered", namespace="default", worker="w0")
            await bus.publish("operation.finished", namespace="default", operation="op_1")
            a = [first.get_nowait()["type"] for _ in range(2)]
            b = [second.get_nowait()["type"] for _ in range(2)]
        await bus.publish("after.unsubscribe", namespace=None)
        return a, b

    a, b = asyncio.run(run())
    assert a == b == ["worker.registered", "operation.finished"]


def test_a_full_subscriber_does_not_block_publishers() -> None:
    async def run() -> int:
        bus = EventBus(replica_id="r1")
        async with bus.subscribe(maxsize=1) as queue:
            for i in range(5):
                await bus.publish("x", namespace=None, i=i)
            return queue.qsize()

    assert asyncio.run(run()) == 1
