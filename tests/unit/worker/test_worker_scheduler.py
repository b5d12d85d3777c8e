"""Admission: KV rows per DP group, K distinct adapters per batch, FIFO without starvation."""

from dataclasses import dataclass

import pytest

from loraplane.worker.engine.residency import Residency
from loraplane.worker.engine.scheduler import Scheduler

pytestmark = pytest.mark.unit


@dataclass(eq=False)
class Req:
    adapter_key: str | None
    name: str = ""
    dp_group: int = -1
    cache_row: int = -1
    slot: int = -1


def setup(
    k: int = 2,
    names: tuple[str, ...] = ("a", "b", "c"),
    dp: int = 1,
    rows: int = 8,
    max_running: int = 8,
):
    r = Residency(k, max(k, len(names)))
    for n in names:
        r.add(n, n, f"/{n}", 1)
    return r, Scheduler(dp, rows, max_running, r)


def test_mixed_adapters_and_base_share_a_batch() -> None:
    _, s = setup()
    reqs = [Req("a"), Req(None), Req("b"), Req("a")]
    for q in reqs:
        s.add(q)
    adm = s.schedule()
    assert adm.admitted == reqs
    assert sorted(slot for slot, _ in adm.slot_loads) == [0, 1]
    assert reqs[0].slot == reqs[3].slot != reqs[2].slot and reqs[1].slot == -1
    assert s.distinct_adapters() == 2


def test_at_most_k_distinct_adapters_run_and_the_rest_wait() -> None:
    _, s = setup(k=2)
    for q in [Req("a"), Req("b"), Req("c")]:
        s.add(q)
    adm = s.schedule()
    assert [q.adapter_key for q in adm.admitted] == ["a", "b"]
    assert adm.waiting_for_slot == 1
    assert s.distinct_adapters() == 2


def test_blocked_request_is_not_starved_by_later_adapter_traffic() -> None:
    _, s = setup(k=2)
    a, b = Req("a"), Req("b")
    s.add(a)
    s.add(b)
    s.schedule()
    c = Req("c")
    s.add(c)
    later_a = Req("a")  # same adapter as a running one: must not overtake c
    base = Req(None)  # no adapter: may pass, it takes no slot
    s.add(later_a)
    s.add(base)
    adm = s.schedule()
    assert adm.admitted == [base]
    assert list(s.waiting) == [c, later_a]
    s.finish(a)
    adm = s.schedule()
    assert adm.admitted[0] is c
    assert adm.evicted == ["a"]
    # later_a now needs a slot again; b is still running, c running: it waits its turn
    assert later_a in s.waiting


def test_fifo_among_waiting_for_slots() -> None:
    _, s = setup(k=1, names=("a", "b", "c"))
    first = Req("a")
    s.add(first)
    s.schedule()
    queue = [Req("b"), Req("c"), Req("b")]
    for q in queue:
        s.add(q)
    order = []
    running = [first]
    for _ in range(10):
        for q in running:
            s.finish(q)
        adm = s.schedule()
        running = list(adm.admitted)
        order += [q.adapter_key for q in adm.admitted]
        if not s.waiting:
            break
    assert order == ["b", "c", "b"]


def test_kv_rows_bound_admission_and_spread_over_dp_groups() -> None:
    _, s = setup(dp=2, rows=2, max_running=8)
    reqs = [Req(None) for _ in range(5)]
    for q in reqs:
        s.add(q)
    adm = s.schedule()
    assert len(adm.admitted) == 4
    assert sorted((q.dp_group, q.cache_row) for q in adm.admitted) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert list(s.waiting) == [reqs[4]]
    s.finish(reqs[1])
    adm = s.schedule()
    assert adm.admitted == [reqs[4]]
    assert (reqs[4].dp_group, reqs[4].cache_row) == (reqs[1].dp_group, reqs[1].cache_row)


def test_max_running_caps_the_batch() -> None:
    _, s = setup(rows=8, max_running=2)
    for _ in range(3):
        s.add(Req(None))
    assert len(s.schedule().admitted) == 2
