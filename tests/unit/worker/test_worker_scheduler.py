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


def test_a_blocked_adapter_drains_one_slot_while_the_others_keep_running() -> None:
    _, s = setup(k=2)
    a1, b1 = Req("a"), Req("b")
    s.add(a1)
    s.add(b1)
    s.schedule()  # a took its slot first: a has held its slot longest
    c, later_b, base = Req("c"), Req("b"), Req(None)
    for q in (c, later_b, base):
        s.add(q)
    adm = s.schedule()
    # c waits for a slot, the others do not wait for c
    assert adm.admitted == [later_b, base]
    assert adm.waiting_for_slot == 1
    assert s.draining == {"a"}  # the slot held longest drains for c
    a2, b2 = Req("a"), Req("b")
    s.add(a2)
    s.add(b2)
    adm = s.schedule()
    assert adm.admitted == [b2]  # a is draining: its new request waits
    assert list(s.waiting) == [c, a2]
    s.finish(a1)
    adm = s.schedule()
    assert adm.admitted == [c]
    assert adm.evicted == ["a"]
    assert c.slot == a1.slot
    # a2 now waits for a slot of its own: b has held its slot longest and drains
    assert list(s.waiting) == [a2]
    assert s.draining == {"b"}


def test_requests_of_one_adapter_keep_their_order_and_run_together() -> None:
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
        order.append([q.adapter_key for q in adm.admitted])
        if not s.waiting:
            break
    assert order == [["b", "b"], ["c"]]


def test_pinned_adapters_are_never_drained() -> None:
    r = Residency(2, 3)
    for n in ("p", "a", "b"):
        r.add(n, n, f"/{n}", 1, pinned=n == "p")
    s = Scheduler(1, 8, 8, r)
    p, a = Req("p"), Req("a")
    s.add(p)
    s.add(a)
    s.schedule()
    s.add(Req("b"))
    s.schedule()
    assert s.draining == {"a"}


def simulate(
    policy_slots: int, adapters: int, clients: int, steps_per_request: int, steps: int, seed: int
) -> tuple[list[int], float]:
    """Closed-loop clients on a fake clock (one tick per engine step): each client sends a
    request for a random adapter, it runs ``steps_per_request`` ticks once admitted, then
    the client sends the next. Returns every request's wait in ticks and the mean number
    of running requests per tick."""
    import random

    rng = random.Random(seed)
    names = tuple(f"a{i}" for i in range(adapters))
    _, s = setup(k=policy_slots, names=names, rows=clients, max_running=clients)
    arrived: dict[int, int] = {}
    left: dict[int, int] = {}
    reqs = [Req(rng.choice(names)) for _ in range(clients)]
    for q in reqs:
        s.add(q)
        arrived[id(q)] = 0
    waits: list[int] = []
    running_sum = 0
    for tick in range(steps):
        for q in s.schedule().admitted:
            waits.append(tick - arrived.pop(id(q)))
            left[id(q)] = steps_per_request
        running_sum += len(s.running)
        for q in list(s.running):
            left[id(q)] -= 1
            if left[id(q)] == 0:
                s.finish(q)
                nxt = Req(rng.choice(names))
                s.add(nxt)
                arrived[id(nxt)] = tick + 1
    # a request still waiting at the end counts with its wait so far
    waits += [steps - t for t in arrived.values()]
    return waits, running_sum / steps


def test_more_adapters_than_slots_every_wait_is_bounded_and_rows_keep_running() -> None:
    # 16 adapters on 8 slots, 32 clients, 128-token requests (the serving benchmark's case)
    waits, mean_running = simulate(8, 16, 32, 128, 6000, seed=1)
    assert len(waits) > 1000
    # a blocked adapter waits for one victim's requests to end, plus its turn among the
    # blocked adapters ahead of it: never more than a few request lengths
    # (draining every adapter for the first blocked one instead: up to 4 lengths, p50 2)
    assert max(waits) <= 2 * 128
    # most requests start at once (their adapter has a slot), and most rows keep running
    # (0.71 of the clients here; 0.37 when every adapter drained for the first blocked one)
    assert sorted(waits)[len(waits) // 2] == 0
    assert mean_running >= 0.6 * 32


def test_one_slot_per_adapter_wanted_still_serves_everyone() -> None:
    waits, _ = simulate(2, 12, 12, 20, 4000, seed=2)
    assert max(waits) <= 12 * 20


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
