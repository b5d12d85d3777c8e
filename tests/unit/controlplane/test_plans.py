"""Plans round-trip through the journal's JSON unchanged, in the shape older replicas wrote."""

from __future__ import annotations

from typing import Any

import pytest

from loraplane.controlplane.plans import (
    LoadPlan,
    PinPlan,
    UnloadPlan,
    VersionPlan,
    plan_from_json,
)

pytestmark = pytest.mark.unit

W1 = {"worker_id": 1, "worker": "w1", "endpoint": "http://w1:8000", "dp_size": 2}
W2 = {"worker_id": 2, "worker": "w2", "endpoint": "http://w2:8000", "dp_size": 1}
LOAD = {
    "adapter_id": 7,
    "lora_name": "team-a.sql",
    "path": "/adapters/sql",
    "pinned": True,
    "targets": [
        {**W1, "evict": ["old"], "already_loaded": False},
        {**W2, "evict": [], "already_loaded": True},
    ],
    "shrink": [W2],
}
NEW = {
    "version": 2,
    "source_uri": "file:///adapters/sql2",
    "source_sha256": None,
    "path": "/adapters/sql2",
    "digest": "ab" * 32,
    "rank": 8,
    "alpha": 16.0,
    "target_modules": ["q_proj", "v_proj"],
    "base_model": None,
}
JOURNAL: list[tuple[str, dict[str, Any], type]] = [
    ("load", LOAD, LoadPlan),
    ("register", {**LOAD, "targets": [], "shrink": []}, LoadPlan),
    (
        "update_version",
        {
            **{k: v for k, v in LOAD.items() if k != "shrink"},
            "lora_name": "team-a.sql_v2",
            "old_lora_name": "team-a.sql",
            "old_targets": [W1],
            "new": NEW,
        },
        VersionPlan,
    ),
    (
        "delete",
        {"adapter_id": 7, "targets": [{**W1, "lora_names": ["a", "a_v2"]}], "then": "delete"},
        UnloadPlan,
    ),
    (
        "pin",
        {"adapter_id": 7, "lora_name": "a", "path": "/p", "pinned": False, "targets": [W2]},
        PinPlan,
    ),
]


@pytest.mark.parametrize(("kind", "body", "plan_type"), JOURNAL, ids=[k for k, _, _ in JOURNAL])
def test_a_journalled_plan_reads_back_as_written(
    kind: str, body: dict[str, Any], plan_type: type
) -> None:
    plan = plan_from_json(kind, body)
    assert isinstance(plan, plan_type)
    assert plan.to_json() == body


def test_a_register_journalled_without_shrink_reads_as_a_load_with_none() -> None:
    body = {"adapter_id": 7, "lora_name": "sql", "path": "/p", "pinned": False, "targets": []}
    plan = plan_from_json("register", body)
    assert isinstance(plan, LoadPlan) and plan.targets == () and plan.shrink == ()


def test_the_targets_name_the_workers_the_operation_touches() -> None:
    plan = plan_from_json("load", LOAD)
    assert isinstance(plan, LoadPlan)
    assert [w.name for w in plan.workers] == ["w1", "w2"]
    assert plan.already_loaded == {"w2"} and plan.targets[0].evict == ("old",)


def test_an_unknown_kind_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'resize' has no plan; known kinds: \['delete', "):
        plan_from_json("resize", {"adapter_id": 1})
