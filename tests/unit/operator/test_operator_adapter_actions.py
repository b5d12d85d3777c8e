"""The adapter handler against a control plane that honours Idempotency-Key: a second load in
the same generation is a new request (not a replay of the first), a retry after a lost answer
repeats its key, and control plane errors name the LoRAAdapter's fields."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from tests.unit.operator.adapter_pass import reconcile_adapter_once

from loraplane.operator import handlers
from loraplane.operator.cpclient import ControlPlaneError, ControlPlaneUnavailable

pytestmark = pytest.mark.unit

UID = "0d1e"
SPEC: dict[str, Any] = {
    "pool": "p",
    "source": {"uri": "file:///models/a"},
    "placement": {"mode": "count", "count": 2},
}


class FakeKube:
    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"spec": {"maxLorasPerBatch": 4}} if name == "p" else None

    def list_adapters(self, namespace: str) -> list[dict[str, Any]]:
        return []


class IdempotentControlPlane:
    """The adapter API as the operator uses it, with the control plane's idempotency
    (api/adapters.py `replay_or`): a key seen before with the same request answers the
    recorded operation and changes nothing; with another request it is a 409."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        self.adapter: dict[str, Any] | None = None
        self.journal: dict[str, tuple[Any, Any]] = {}
        self.keys: list[str] = []  # every mutating call's key, in order
        self.replays = 0
        self.lose_next_answer = False  # done, but the answer never reaches the operator
        self.reject_next: ControlPlaneError | None = None

    # reads
    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [{"name": w, "state": "ready"} for w in self.workers]

    def get_adapter(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.adapter)

    # mutations
    def register_adapter(self, body: dict[str, Any], key: str) -> Any:
        def apply() -> None:
            self.adapter = {
                "source": {"uri": body["source"]["uri"], "sha256": None},
                "pinned": body["pinned"],
                "priority": body["priority"],
                "placement": body["placement"],
                "loaded_workers": [],
                "placements": [],
            }
            self._load(body["placement"])

        return self._once(key, ("register", body), apply)

    def load_adapter(self, namespace: str, name: str, placement: Any, key: str) -> Any:
        def apply() -> None:
            assert self.adapter is not None
            self.adapter["placement"] = placement
            self._load(placement)

        return self._once(key, ("load", namespace, name, placement), apply)

    def _once(self, key: str, request: Any, apply: Callable[[], None]) -> Any:
        self.keys.append(key)
        if self.reject_next is not None:
            error, self.reject_next = self.reject_next, None
            raise error
        if key in self.journal:
            seen, answer = self.journal[key]
            if seen != request:
                raise ControlPlaneError(
                    409, "idempotency_mismatch", "reused key", "header.Idempotency-Key", None
                )
            self.replays += 1
            return copy.deepcopy(answer)
        apply()
        answer = {"operation": {"state": "succeeded"}, "adapter": copy.deepcopy(self.adapter)}
        self.journal[key] = (request, answer)
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise ControlPlaneUnavailable("read timed out")
        return copy.deepcopy(answer)

    def _load(self, placement: Any) -> None:
        assert self.adapter is not None
        want = len(self.workers) if placement == "all" else placement["count"]
        loaded = [w for w in self.adapter["loaded_workers"] if w in self.workers]
        loaded += [w for w in self.workers if w not in loaded][: max(want - len(loaded), 0)]
        self._set_loaded(loaded)

    def _set_loaded(self, loaded: list[str]) -> None:
        assert self.adapter is not None
        self.adapter["loaded_workers"] = loaded
        self.adapter["placements"] = [
            {"worker": w, "dp_group": 0, "state": "loaded"} for w in loaded
        ]
        self.adapter["routable"] = bool(loaded)
        self.adapter["phase"] = "Ready" if loaded else "Unloaded"

    def lose(self, worker: str) -> None:
        """`worker` restarted empty; the control plane's record says so."""
        assert self.adapter is not None
        self._set_loaded([w for w in self.adapter["loaded_workers"] if w != worker])
        self.adapter["phase"] = "Degraded"


@pytest.fixture(autouse=True)
def no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    # Posting needs a running operator; these tests only look at the status.
    monkeypatch.setattr(handlers.kopf, "event", lambda *args, **kwargs: None)


def reconcile(
    cp: IdempotentControlPlane, status: dict[str, Any], generation: int = 1
) -> dict[str, Any]:
    """One handler pass over a LoRAAdapter with `status`; returns the status it writes."""
    return reconcile_adapter_once(FakeKube(), cp, SPEC, status, uid=UID, generation=generation)


def test_a_second_load_in_the_same_generation_is_a_new_request_and_loads_again() -> None:
    cp = IdempotentControlPlane(["w0", "w1", "w2"])
    status = reconcile(cp, {})  # register (and load on 2)
    assert status["phase"] == "Ready" and status["actions"] == 1

    cp.lose("w1")
    status = reconcile(cp, status)  # load again
    assert cp.adapter is not None and len(cp.adapter["loaded_workers"]) == 2
    assert status["phase"] == "Ready" and status["actions"] == 2

    cp.lose("w0")
    status = reconcile(cp, status)  # and again: same generation, same request body
    assert cp.replays == 0, cp.keys
    assert len(cp.adapter["loaded_workers"]) == 2 and status["phase"] == "Ready"
    assert status["actions"] == 3 and status["attempts"] == 0

    register, first_load, second_load = cp.keys
    assert "-register-" in register and "-load-" in first_load
    assert first_load != second_load
    assert all(k.startswith(f"{UID}-g1-") for k in cp.keys)
    # Nothing left to do: no further calls, the counter stays.
    assert reconcile(cp, status)["actions"] == 3 and len(cp.keys) == 3


def test_the_counter_survives_a_new_generation() -> None:
    cp = IdempotentControlPlane(["w0", "w1"])
    status = reconcile(cp, {})
    cp.lose("w1")
    status = reconcile(cp, status, generation=2)
    assert status["observedGeneration"] == 2 and status["actions"] == 2


def test_a_retry_after_a_lost_answer_repeats_the_key() -> None:
    cp = IdempotentControlPlane(["w0", "w1", "w2"])
    status = reconcile(cp, {})
    cp.lose("w1")
    cp.lose_next_answer = True  # loaded, but the operator hears nothing
    after_loss = reconcile(cp, status)
    assert after_loss["actions"] == status["actions"] and after_loss["attempts"] == 0
    # The operator died before writing that status, or wrote it (unreachable is no attempt):
    # either way its next pass, from what is stored, repeats the key and gets a replay.
    for stored in (status, after_loss):
        cp.lose("w0")
        calls = len(cp.keys)
        again = reconcile(cp, stored)
        assert cp.keys[calls] == cp.keys[calls - 1]
    assert cp.replays == 2
    # The replay counts as done; the pass after it sends a new key and loads.
    status = reconcile(cp, again)
    assert cp.keys[-1] != cp.keys[-2] and status["phase"] == "Ready"
    assert cp.adapter is not None and len(cp.adapter["loaded_workers"]) == 2


def test_a_failed_attempt_is_retried_with_a_new_key() -> None:
    cp = IdempotentControlPlane(["w0", "w1"])
    cp.reject_next = ControlPlaneError(502, "fanout_failed", "w0: out of memory", None, None)
    status = reconcile(cp, {})
    assert status["attempts"] == 1 and status["actions"] == 0
    status = reconcile(cp, {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
    assert status["phase"] == "Ready" and status["actions"] == 1
    assert cp.keys[0] != cp.keys[1]


@pytest.mark.parametrize(
    ("field", "message", "expected"),
    [
        (
            "body.source.uri",
            "body.source.uri: no such directory /models/a",
            "spec.source.uri: no such directory /models/a",
        ),
        (
            "body.source.sha256",
            "body.source.sha256: expected 00 but adapter_model.safetensors has sha256 11",
            "spec.source.sha256: expected 00 but adapter_model.safetensors has sha256 11",
        ),
        (
            "body.placement.count",
            "body.placement.count: Input should be greater than or equal to 1; "
            "body.priority: Input should be less than or equal to 1000",
            "spec.placement.count: Input should be greater than or equal to 1; "
            "spec.priority: Input should be less than or equal to 1000",
        ),
        ("body.pinned", "too many pinned", "spec.pinned: too many pinned"),
        ("body.namespace", "bad label", "metadata.namespace: bad label"),
        # Only field names are renamed, not text that looks like one.
        (
            "body.source.uri",
            "body.source.uri: https://h/body.source/x is not allowed",
            "spec.source.uri: https://h/body.source/x is not allowed",
        ),
        ("body.load", "body.load: not a boolean", "body.load: not a boolean"),
    ],
)
def test_errors_name_the_loraadapter_fields(field: str, message: str, expected: str) -> None:
    cp = IdempotentControlPlane(["w0"])
    cp.reject_next = ControlPlaneError(400, "invalid_value", message, field, None)
    status = reconcile(cp, {})
    assert status["phase"] == "Failed"
    validated = next(c for c in status["conditions"] if c["type"] == "Validated")
    assert validated["message"] == expected


# ------------------------------------------------------------------ status as the truth, events


class PoolOfThree(FakeKube):
    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"spec": {"maxLorasPerBatch": 4, "replicas": 3}}


class Unreachable(IdempotentControlPlane):
    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        raise ControlPlaneUnavailable("connection refused")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    posted: list[tuple[str, str, str]] = []

    def event(_body: Any, *, type: str, reason: str, message: str) -> None:
        posted.append((type, reason, message))

    monkeypatch.setattr(handlers.kopf, "event", event)
    return posted


def test_a_lost_pod_degrades_the_adapter_until_it_is_loaded_there_again(
    events: list[tuple[str, str, str]],
) -> None:
    spec = {**SPEC, "placement": {"mode": "all"}}
    cp = IdempotentControlPlane(["w0", "w1", "w2"])

    def reconcile_all(status: dict[str, Any]) -> dict[str, Any]:
        return reconcile_adapter_once(PoolOfThree(), cp, spec, status, uid=UID)

    status = reconcile_all({})
    assert (status["phase"], status["ready"]) == ("Ready", "3/3")
    assert [e[1] for e in events] == ["Registered", "Ready"]

    events.clear()
    cp.workers = ["w0", "w2"]  # pod of w1 deleted: the pool still wants 3
    cp.lose("w1")
    cp.adapter["phase"] = "Ready"  # type: ignore[index]  # routable on the other two
    status = reconcile_all(status)
    assert (status["phase"], status["ready"]) == ("Degraded", "2/3")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ReplicasUnavailable"
    assert "2 of the pool's 3 replicas are ready" in ready["message"]
    assert ("Warning", "ReplicaLost") in [e[:2] for e in events]
    assert ("Warning", "Degraded") in [e[:2] for e in events]

    events.clear()
    cp.workers = ["w0", "w1", "w2"]  # the pod is back, empty: loaded again (a repair)
    status = reconcile_all(status)
    assert (status["phase"], status["ready"]) == ("Ready", "3/3")
    assert [e[:2] for e in events] == [
        ("Normal", "Repair"),
        ("Normal", "ReplicaLoaded"),
        ("Normal", "Ready"),
    ]


def test_an_unreachable_control_plane_is_unknown_not_a_failure(
    events: list[tuple[str, str, str]],
) -> None:
    cp = IdempotentControlPlane(["w0", "w1"])
    ready = reconcile(cp, {})
    events.clear()
    down = Unreachable(["w0", "w1"])
    status = reconcile_adapter_once(FakeKube(), down, SPEC, ready, uid=UID)
    assert status["phase"] == "Unknown"
    # The last known counts stay; no attempt is counted.
    assert status["ready"] == ready["ready"] and status["loadedReplicas"] == 2
    assert status["attempts"] == 0
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "Unknown"
    assert conditions["Ready"]["reason"] == "ControlPlaneUnavailable"
    assert conditions["Validated"]["status"] == "True"
    assert events == [("Warning", "Unknown", events[0][2])]
    assert "connection refused" in events[0][2]


def test_failed_attempts_and_version_swaps_post_events(
    events: list[tuple[str, str, str]],
) -> None:
    cp = IdempotentControlPlane(["w0", "w1"])
    cp.reject_next = ControlPlaneError(502, "fanout_failed", "w0: out of memory", None, None)
    status = reconcile(cp, {})
    (failed,) = [e for e in events if e[1] == "AttemptFailed"]
    assert failed[0] == "Warning"
    assert "attempt 1/5 failed: w0: out of memory; retrying in 2 s" in failed[2]
    status = reconcile(cp, {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
    assert status["phase"] == "Ready"

    events.clear()
    cp.new_version = lambda ns, name, source, key: cp._once(  # type: ignore[method-assign]
        key,
        ("version", source),
        lambda: cp.adapter.update(source=source),  # type: ignore[union-attr]
    )
    swapped = {**SPEC, "source": {"uri": "file:///models/a-v2"}}
    reconcile_adapter_once(FakeKube(), cp, swapped, status, uid=UID, generation=2)
    (swap,) = [e for e in events if e[1] == "VersionSwap"]
    assert swap[0] == "Normal" and "file:///models/a-v2" in swap[2]
