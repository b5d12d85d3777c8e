"""Pinning (at most K - 1 per worker), LRU eviction and placement choice."""

from __future__ import annotations

import pytest

from loraplane.controlplane.slots import (
    NoCapacity,
    PinLimitExceeded,
    Resident,
    WorkerSlots,
    check_pin,
    choose_evictions,
    plan_placement,
)

pytestmark = pytest.mark.unit


def worker(
    name: str = "w0", k: int = 4, m: int = 4, resident: tuple[Resident, ...] = (), **kw: object
) -> WorkerSlots:
    return WorkerSlots(name, k, m, resident, **kw)  # type: ignore[arg-type]


def test_at_most_k_minus_one_pinned() -> None:
    w = worker(k=3, m=6, resident=(Resident("a", True, 0), Resident("b", True, 0)))
    with pytest.raises(PinLimitExceeded) as info:
        check_pin(w, "c")
    assert "at most max_loras_per_batch - 1 = 2" in str(info.value)
    assert "a, b" in str(info.value)
    check_pin(w, "a")  # re-pinning one already pinned is fine


def test_k_equal_one_allows_no_pinning() -> None:
    with pytest.raises(PinLimitExceeded):
        check_pin(worker(k=1, m=1), "a")


def test_eviction_takes_least_recently_used_unpinned_idle_adapter() -> None:
    w = worker(
        m=4,
        resident=(
            Resident("pinned-old", True, 1.0),
            Resident("busy-old", False, 2.0, inflight=3),
            Resident("idle-newer", False, 10.0),
            Resident("idle-older", False, 5.0),
        ),
    )
    assert choose_evictions(w) == ["idle-older"]
    assert choose_evictions(w, needed=2) == ["idle-older", "idle-newer"]


def test_no_eviction_needed_when_there_is_room() -> None:
    assert choose_evictions(worker(m=4, resident=(Resident("a", False, 0),))) == []


def test_no_capacity_when_everything_is_pinned_or_busy() -> None:
    w = worker(k=2, m=2, resident=(Resident("p", True, 0), Resident("b", False, 0, inflight=1)))
    with pytest.raises(
        NoCapacity, match=r"holds 2/2 adapters \(1 pinned, 1 with requests in flight, 0 loading"
    ):
        choose_evictions(w)


def test_eviction_skips_adapters_that_are_not_settled_and_goes_by_priority() -> None:
    """An adapter still loading, being unloaded or in an operation of its own is not a victim
    (evicting it would race that operation); a higher priority is evicted later."""
    w = worker(
        m=4,
        resident=(
            Resident("loading-oldest", False, 0.0, settled=False),
            Resident("important-old", False, 1.0, priority=10),
            Resident("plain-newer", False, 9.0),
            Resident("plain-new", False, 8.0),
        ),
    )
    assert choose_evictions(w, needed=2) == ["plain-new", "plain-newer"]
    assert choose_evictions(w, needed=3) == ["plain-new", "plain-newer", "important-old"]
    with pytest.raises(NoCapacity, match=r"1 loading, unloading or in an operation"):
        choose_evictions(w, needed=4)


def test_protected_adapter_is_not_evicted() -> None:
    w = worker(m=2, k=2, resident=(Resident("a", False, 0), Resident("b", False, 1)))
    assert choose_evictions(w, protect=["a"]) == ["b"]


def test_placement_all_targets_every_ready_worker() -> None:
    workers = [worker("w0"), worker("w1"), worker("w2", ready=False)]
    plan = plan_placement(workers, "x", count=None, pinned=False)
    assert [t.worker for t in plan.targets] == ["w0", "w1"]
    assert plan.skipped == {"w2": "not ready"}


def test_placement_count_prefers_holders_then_free_slots_then_load() -> None:
    workers = [
        worker("busy", m=4, inflight=9),
        worker("full", m=4, resident=(Resident("a", False, 0), Resident("b", False, 0))),
        worker(
            "holder",
            m=4,
            resident=(Resident("x", False, 0), Resident("c", False, 0), Resident("d", False, 0)),
        ),
        worker("idle", m=4, inflight=0),
    ]
    plan = plan_placement(workers, "x", count=3, pinned=False)
    assert [t.worker for t in plan.targets] == ["holder", "idle", "busy"]
    assert plan.targets[0].already_loaded is True


def test_placement_evicts_lru_on_a_full_worker() -> None:
    full = worker("w0", k=2, m=2, resident=(Resident("old", False, 1), Resident("new", False, 9)))
    plan = plan_placement([full], "x", count=1, pinned=False)
    assert plan.targets[0].evict == ("old",)


def test_pinned_placement_all_fails_on_a_worker_at_the_pin_limit() -> None:
    at_limit = worker("w1", k=2, m=4, resident=(Resident("p", True, 0),))
    with pytest.raises(PinLimitExceeded, match="w1"):
        plan_placement([worker("w0", k=2), at_limit], "x", count=None, pinned=True)


def test_pinned_placement_count_skips_workers_at_the_limit() -> None:
    at_limit = worker("w1", k=2, m=4, resident=(Resident("p", True, 0),))
    plan = plan_placement([at_limit, worker("w0", k=2)], "x", count=1, pinned=True)
    assert [t.worker for t in plan.targets] == ["w0"]


def test_placement_count_larger_than_ready_workers_is_no_capacity() -> None:
    with pytest.raises(NoCapacity, match="placement count 3 needs 3 ready workers"):
        plan_placement([worker("w0"), worker("w1")], "x", count=3, pinned=False)


def test_no_workers_is_no_capacity() -> None:
    with pytest.raises(NoCapacity, match="no workers registered"):
        plan_placement([], "x", count=None, pinned=False)


def test_worker_slots_validate_their_limits() -> None:
    with pytest.raises(ValueError, match="max_loaded_loras"):
        WorkerSlots("w", 4, 2)
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        WorkerSlots("w", 0, 2)
