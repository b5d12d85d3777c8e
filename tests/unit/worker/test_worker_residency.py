"""Slots and host memory: pinning, LRU eviction, versions. Plain Python."""

import pytest

from loraplane.worker.engine.residency import Residency, ResidencyError

pytestmark = pytest.mark.unit


def loaded(k: int, m: int, names: list[str], pinned: tuple[str, ...] = ()) -> Residency:
    r = Residency(k, m)
    for n in names:
        r.add(n, n, f"/{n}", 1, pinned=n in pinned)
    return r


def test_free_slots_are_used_before_anything_is_evicted() -> None:
    r = loaded(2, 4, ["a", "b"])
    ga, gb = r.acquire("a"), r.acquire("b")
    assert ga is not None and gb is not None
    assert {ga.slot, gb.slot} == {0, 1} and ga.load and gb.load and ga.evicted is None


def test_lru_unpinned_not_running_is_evicted() -> None:
    r = loaded(3, 6, ["a", "b", "c", "d"])
    for n in ["a", "b", "c"]:
        r.acquire(n)
        r.release(n)
    r.acquire("a")  # a is used again: b is now least recently used
    r.release("a")
    grant = r.acquire("d")
    assert grant is not None and grant.evicted == "b" and grant.load
    assert r.adapters["b"].slot is None
    assert r.adapters["d"].slot == grant.slot


def test_running_adapter_is_never_evicted_and_acquire_waits() -> None:
    r = loaded(2, 4, ["a", "b", "c"])
    r.acquire("a")
    r.acquire("b")
    assert r.acquire("c") is None  # both running
    assert not r.can_acquire("c")
    r.release("a")
    grant = r.acquire("c")
    assert grant is not None and grant.evicted == "a"


def test_pinned_adapter_is_never_evicted() -> None:
    r = loaded(2, 4, ["p", "a", "b"], pinned=("p",))
    r.acquire("p")
    r.release("p")  # p is the least recently used from here on
    for n in ["a", "b", "a", "b"]:
        grant = r.acquire(n)
        assert grant is not None and grant.evicted != "p"
        r.release(n)
    assert r.adapters["p"].slot is not None


def test_at_most_k_minus_one_pinned() -> None:
    r = loaded(3, 6, ["p1", "p2"], pinned=("p1", "p2"))
    with pytest.raises(ResidencyError, match="at most max_loras_per_batch - 1 = 2"):
        r.add("p3", "p3", "/p3", 1, pinned=True)
    r.add("x", "x", "/x", 1)
    with pytest.raises(ResidencyError, match="pinned"):
        r.set_pinned("x", True)
    assert not r.adapters["x"].pinned


def test_host_capacity_m_is_enforced() -> None:
    r = loaded(1, 2, ["a", "b"])
    with pytest.raises(ResidencyError, match="max_loaded_loras \\(2\\)"):
        r.add("c", "c", "/c", 1)
    r.check_add("c", False, freeing=1)  # room once a victim goes (a load with evict)
    with pytest.raises(ResidencyError, match="max_loaded_loras \\(2\\)"):
        r.check_add("c", False, freeing=0)


def test_new_version_replaces_current_and_old_one_stays_while_held() -> None:
    r = loaded(2, 2, ["a"])
    r.hold("a")
    grant = r.acquire("a")
    assert grant is not None
    removable = r.add("a@v2", "a", "/a2", 2)  # replacing does not count against M
    assert removable == []  # a request still holds version 1
    current = r.current("a")
    assert current is not None and current.key == "a@v2"
    assert r.adapters["a"].retired and r.adapters["a"].slot == grant.slot
    r.release("a")
    assert r.unhold("a") is True
    assert r.remove("a") == grant.slot
    assert r.slots[grant.slot] is None


def test_remove_refuses_a_held_version() -> None:
    r = loaded(1, 1, ["a"])
    r.hold("a")
    with pytest.raises(ResidencyError, match="still used"):
        r.remove("a")


def test_lru_order_lists_slot_holders_oldest_first() -> None:
    r = loaded(3, 3, ["a", "b", "c"])
    for n in ["c", "a", "b"]:
        r.acquire(n)
        r.release(n)
    assert r.lru_order() == ["c", "a", "b"]
