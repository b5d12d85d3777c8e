"""schemathesis driven from a plain test (its pytest plugin is not used): every operation of a
live server's OpenAPI schema, positive and negative examples, each answer checked."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode


def fuzz(
    url: str,
    headers: dict[str, str],
    check: Callable[[Any, Any], None],
    *,
    examples: int,
    skip: Collection[str] = (),
) -> list[str]:
    """Run `check(case, response)` over `examples` generated requests per operation and mode
    of the schema at ``url/openapi.json``; returns the labels of the operations exercised."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    labels: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in skip:
            continue
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                response = case.call(base_url=url, headers=headers, timeout=120)
                check(case, response)

            try:
                run()
            except Unsatisfiable:  # nothing to break: an operation without inputs
                if mode is GenerationMode.POSITIVE:
                    raise
    return labels
