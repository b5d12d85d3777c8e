"""Phase, conditions and the next action for an adapter, from observed state only."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from loraplane.operator import status
from loraplane.operator.status import AdapterView, RetryPolicy

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
SPEC = {"pool": "p", "source": {"uri": "file:///models/a"}, "pinned": False, "priority": 0}
POLICY = RetryPolicy(max_attempts=3, base_delay_s=2, max_delay_s=60)


def cp_adapter(**over: Any) -> dict[str, Any]:
    return {
        "source": {"uri": "file:///models/a", "sha256": None},
        "pinned": False,
        "priority": 0,
        "placement": "all",
        "phase": "Ready",
        "routable": True,
        "loaded_workers": ["w0", "w1"],
        "placements": [
            {"worker": "w0", "dp_group": 1, "state": "loaded"},
            {"worker": "w0", "dp_group": 0, "state": "loaded"},
            {"worker": "w1", "dp_group": 0, "state": "loaded"},
            {"worker": "w1", "dp_group": 1, "state": "loaded"},
        ],
        "rank": 8,
        "digest": "ab" * 32,
        **over,
    }


def plan(
    cp: dict[str, Any] | None, st: dict[str, Any] | None = None, workers=("w0", "w1"), spec=SPEC
):
    return status.plan_adapter(spec, "all", st or {}, 1, cp, list(workers), POLICY, NOW)


def test_plan_registers_an_unknown_adapter_and_does_nothing_when_in_sync() -> None:
    assert plan(None).action == "register"
    assert plan(cp_adapter()).action == "none"


def test_plan_applies_spec_changes_in_place() -> None:
    assert (
        plan(cp_adapter(), spec={**SPEC, "source": {"uri": "file:///models/b"}}).action
        == "update_version"
    )
    assert plan(cp_adapter(), spec={**SPEC, "pinned": True}).action == "patch"
    assert plan(cp_adapter(), spec={**SPEC, "loadPolicy": "Explicit"}).action == "patch"
    explicit = {**cp_adapter(), "load_policy": "Explicit"}
    assert plan(explicit, spec={**SPEC, "loadPolicy": "Explicit"}).action != "patch"
    placed = status.plan_adapter(SPEC, {"count": 1}, {}, 1, cp_adapter(), ["w0", "w1"], POLICY, NOW)
    assert placed.action == "load"


def test_plan_loads_onto_a_new_replica() -> None:
    result = plan(cp_adapter(), workers=("w0", "w1", "w2"))
    assert result.action == "load" and "w2" in result.reason


def test_plan_backs_off_then_gives_up_at_the_bound() -> None:
    failed = cp_adapter(phase="Failed", routable=False, loaded_workers=[])
    just_now = {"observedGeneration": 1, "attempts": 2, "lastAttemptTime": status.now_iso(NOW)}
    assert plan(failed, just_now).action == "wait"
    later = {**just_now, "lastAttemptTime": status.now_iso(NOW - dt.timedelta(seconds=10))}
    assert plan(failed, later).action == "load"
    exhausted = {**later, "attempts": 3}
    assert plan(failed, exhausted).action == "give_up"
    # A new generation starts counting again.
    assert plan(failed, {**exhausted, "observedGeneration": 0}).action == "load"


def test_retry_delays_double_and_are_capped() -> None:
    assert [RetryPolicy(base_delay_s=2, max_delay_s=10).delay(n) for n in range(5)] == [
        0,
        2,
        4,
        8,
        10,
    ]


def ready_view(**over: Any) -> AdapterView:
    return AdapterView(
        **{
            "generation": 3,
            "cp_adapter": cp_adapter(),
            "ready_workers": ["w0", "w1"],
            "placement": "all",
            **over,
        }
    )


def conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_ready_adapter_status() -> None:
    st = status.adapter_status(ready_view(), {}, "2026-01-01T00:00:00Z")
    assert st["phase"] == "Ready"
    assert st["loadedReplicas"] == 2 and st["ready"] == "2/2" and st["observedGeneration"] == 3
    assert st["rank"] == 8
    conds = conditions(st)
    assert {k: v["status"] for k, v in conds.items()} == {
        "Validated": "True", "Loaded": "True", "Ready": "True", "Degraded": "False",
    }  # fmt: skip
    assert all(
        {"type", "status", "reason", "message", "lastTransitionTime"} <= c.keys()
        for c in conds.values()
    )
    assert st["replicaStates"][0] == {
        "worker": "w0",
        "state": "loaded",
        "dpGroups": [{"dpGroup": 0, "state": "loaded"}, {"dpGroup": 1, "state": "loaded"}],
    }


def test_failed_dp_group_is_never_ready_and_carries_the_merged_error() -> None:
    error = "dp group 1: shape mismatch in q_proj | dp group 1: rolled back"
    cp = cp_adapter(
        phase="Failed",
        routable=False,
        loaded_workers=[],
        placements=[{"worker": "w0", "dp_group": 1, "state": "failed", "error": "shape mismatch"}],
    )
    degraded = status.adapter_status(
        ready_view(cp_adapter=cp, attempts=1, last_error=error), {}, "t"
    )
    assert degraded["phase"] == "Degraded"
    assert conditions(degraded)["Degraded"]["message"] == error
    assert conditions(degraded)["Ready"]["status"] == "False"
    failed = status.adapter_status(
        ready_view(cp_adapter=cp, attempts=3, last_error=error, gave_up=True), {}, "t"
    )
    assert failed["phase"] == "Failed"
    assert conditions(failed)["Ready"]["reason"] == "RetriesExhausted"
    assert error in conditions(failed)["Ready"]["message"]
    assert failed["replicaStates"][0]["state"] == "failed"


def test_invalid_and_pending_specs() -> None:
    bad = status.adapter_status(
        ready_view(invalid=("PreflightFailed", "body.source.uri: r=512 > 64")), {}, "t"
    )
    assert bad["phase"] == "Failed"
    assert conditions(bad)["Validated"]["status"] == "False"
    assert conditions(bad)["Validated"]["reason"] == "PreflightFailed"
    waiting = status.adapter_status(
        ready_view(pending=("PoolNotFound", "spec.pool: nope")), {}, "t"
    )
    assert waiting["phase"] == "Pending"
    assert conditions(waiting)["Validated"]["message"] == "spec.pool: nope"


def test_partially_loaded_is_not_ready() -> None:
    st = status.adapter_status(ready_view(ready_workers=["w0", "w1", "w2"]), {}, "t")
    assert st["phase"] == "Loading" and st["ready"] == "2/3"


def test_transition_time_changes_only_with_the_status() -> None:
    first = status.merge_conditions([], [status.condition("Ready", False, "Loading", "m", 1)], "t1")
    same = status.merge_conditions(
        first, [status.condition("Ready", False, "Other", "m2", 2)], "t2"
    )
    flipped = status.merge_conditions(
        same, [status.condition("Ready", True, "Routable", "m", 2)], "t3"
    )
    assert [c["lastTransitionTime"] for c in (first[0], same[0], flipped[0])] == ["t1", "t1", "t3"]


def test_only_k_minus_one_adapters_keep_their_pin_oldest_first() -> None:
    def adapter(name: str, created: str, pinned: bool = True) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"pinned": pinned},
        }

    adapters = [
        adapter("c", "3"),
        adapter("a", "1"),
        adapter("b", "2"),
        adapter("d", "0", pinned=False),
    ]
    excess = status.excess_pinned(adapters, max_loras_per_batch=3)
    assert list(excess) == ["c"]
    assert "at most maxLorasPerBatch-1 = 2" in excess["c"] and "a, b" in excess["c"]
    assert status.excess_pinned(adapters, 4) == {}


def test_pool_status_reports_dp_group_health_and_slot_use() -> None:
    pods = [
        {"name": "p-0", "ip": "10.0.0.1", "ready": True, "worker": "p-0"},
        {"name": "p-1", "ip": "", "ready": False, "worker": "p-1"},
    ]
    workers = [
        {
            "name": "p-0",
            "state": "ready",
            "slots": {"loaded": 2, "pinned": 1},
            "dp_groups": [
                {
                    "dp_group": 0,
                    "adapters": ["a", "b"],
                    "slots_used": 2,
                    "slots_total": 4,
                    "kv_pages_used": 30,
                    "kv_pages_total": 100,
                },
                {
                    "dp_group": 1,
                    "adapters": ["a", "b"],
                    "slots_used": 2,
                    "slots_total": 4,
                    "kv_pages_used": 5,
                    "kv_pages_total": 100,
                },
            ],
        }
    ]
    st = status.pool_status(1, 2, pods, workers, {}, "t")
    assert st["readyReplicas"] == 1 and st["registeredWorkers"] == 1
    assert (st["slotsUsed"], st["slotsTotal"]) == (4, 8)
    assert (st["kvPagesUsed"], st["kvPagesTotal"]) == (35, 200)
    assert st["workers"][0]["dpGroups"][1] == {
        "dpGroup": 1, "healthy": True, "slotsUsed": 2, "slotsTotal": 4, "kvPagesUsed": 5,
        "kvPagesTotal": 100, "adapters": ["a", "b"],
    }  # fmt: skip
    assert st["workers"][1]["state"] == "unregistered"
    assert conditions(st)["Ready"]["status"] == "False"


def test_pool_phase_and_reason_follow_its_replicas() -> None:
    pod = {"name": "p-0", "ip": "10.0.0.1", "ready": True, "worker": "p-0"}
    worker = {"name": "p-0", "state": "ready"}
    lost = {"name": "p-1", "ip": "", "ready": False, "worker": "p-1"}
    ready = status.pool_status(1, 1, [pod], [worker], {}, "t")
    assert (ready["phase"], ready["reason"]) == ("Ready", "AllReplicasReady")
    degraded = status.pool_status(1, 2, [pod, lost], [worker], ready, "t")
    assert (degraded["phase"], degraded["reason"]) == ("Degraded", "ReplicasNotReady")
    assert status.pool_events(ready, degraded)[0][:2] == ("Warning", "Degraded")
    assert status.pool_status(1, 1, [lost], [], {}, "t")["phase"] == "Pending"
    unknown = status.pool_unknown(1, 1, [pod], ready, "t", "control plane unreachable: refused")
    assert (unknown["phase"], unknown["reason"]) == ("Unknown", "ControlPlaneUnavailable")
    assert unknown["registeredWorkers"] == 1 and unknown["workers"] == ready["workers"]
    assert conditions(unknown)["Ready"]["status"] == "Unknown"
    assert status.pool_events(ready, unknown)[0][:2] == ("Warning", "Unknown")
    invalid = status.pool_problem(2, ready, "t", "InvalidSpec", "metadata.name: too long")
    assert (invalid["phase"], invalid["reason"]) == ("Failed", "InvalidSpec")
    assert conditions(invalid)["Validated"]["status"] == "False"
