"""Continuous-batching admission: which waiting sequences start running this step.

Plain Python. Sequences join the running set between steps and leave it when they finish.
Each DP group has its own page-table rows (`0..rows_per_group-1`, a cap on its running
sequences) and, when the scheduler is given pools, its own KV pages (`engine/pages.py`): a
sequence is admitted with a reservation of every page it can need (`kv_tokens` positions,
ADR 0015), so a running sequence never waits for pages. A new sequence goes to the group with
the most free rows (with pools: the most available pages among groups with a free row). A
sequence whose pages are not free yet waits, and so do the ones after it (FIFO: a long
request is not passed over for ever by short ones). Admission is FIFO by arrival, with LoRA-fair draining when more
adapters are wanted than there are slots (ADR 0013):

- A request whose adapter holds a slot, and a request without an adapter, is admitted as
  soon as a KV row is free, even past requests that wait for a slot.
- A request whose adapter has no slot takes a free slot, or the slot of an idle unpinned
  adapter. If there is none, its adapter is *blocked*, and one running unpinned adapter per
  blocked adapter is *drained*: no new request of a draining adapter is admitted, so its
  running requests finish and its slot goes to the blocked adapter that waited longest.
  The victim is the slot holder the queue needs least: fewest waiting requests, then the
  one that has held its slot longest (so slots rotate), then fewest running.
- Requests of one adapter keep their order; a blocked adapter's wait is bounded by its
  victim's running requests, and blocked adapters get freed slots in order of arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, cast

from loraplane.worker.engine.pages import PageLease, PagePool
from loraplane.worker.engine.residency import Residency, SlotGrant


class Schedulable(Protocol):
    adapter_key: str | None
    dp_group: int
    cache_row: int
    slot: int


class Paged(Schedulable, Protocol):
    """A sequence of a scheduler with page pools."""

    kv_tokens: int  # KV positions to reserve at admission
    kv: PageLease | None

    @property
    def shareable_prompt(self) -> list[int]:
        """The prompt whose cached prefix (under its adapter_key) it may take."""
        ...


@dataclass(slots=True)
class Admission:
    admitted: list[Schedulable] = field(default_factory=list)
    slot_loads: list[tuple[int, str]] = field(
        default_factory=list
    )  # (slot, key) to fill before the step
    evicted: list[str] = field(default_factory=list)
    waiting_for_slot: int = 0


class Scheduler:
    def __init__(
        self,
        dp_size: int,
        rows_per_group: int,
        max_running: int,
        residency: Residency,
        pools: list[PagePool] | None = None,
    ) -> None:
        if dp_size < 1 or rows_per_group < 1 or max_running < 1:
            raise ValueError(
                f"dp_size ({dp_size}), rows_per_group ({rows_per_group}) and max_running ({max_running}) must be >= 1"
            )
        self.dp_size = dp_size
        self.max_running = min(max_running, dp_size * rows_per_group)
        self.residency = residency
        if pools is not None and len(pools) != dp_size:
            raise ValueError(f"one page pool per DP group: {dp_size} groups, {len(pools)} pools")
        self.pools = pools
        self.free_rows: list[list[int]] = [
            list(range(rows_per_group - 1, -1, -1)) for _ in range(dp_size)
        ]
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []
        # adapters whose new requests wait so that their slot drains for a blocked adapter
        self.draining: set[str] = set()

    def add(self, seq: Schedulable) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Admission:
        out = Admission()
        blocked: list[str] = []  # adapters without a slot, by their first waiting request
        keep: deque[Schedulable] = deque()
        self.draining = {
            k
            for k in self.draining
            if k in self.residency.adapters and self.residency.adapters[k].slot is not None
        }
        rows_full = False
        for seq in self.waiting:
            key = seq.adapter_key
            if not rows_full:
                group = max(range(self.dp_size), key=self._group_order)
                rows_full = len(self.running) >= self.max_running or not self.free_rows[group]
                if not rows_full and self.pools is not None:
                    paged = cast(Paged, seq)
                    pool = self.pools[group]
                    cost = pool.cost(paged.kv_tokens, paged.adapter_key, paged.shareable_prompt)
                    rows_full = cost > pool.available
            if rows_full:
                keep.append(seq)
                continue
            grant: SlotGrant | None = None
            if key is not None:
                if key in self.draining or key in blocked:
                    keep.append(seq)
                    out.waiting_for_slot += 1
                    continue
                grant = self.residency.acquire(key, prefer=self.draining)
                if grant is None:
                    blocked.append(key)
                    keep.append(seq)
                    out.waiting_for_slot += 1
                    continue
                if grant.load:
                    out.slot_loads.append((grant.slot, key))
                if grant.evicted is not None:
                    out.evicted.append(grant.evicted)
                    self.draining.discard(grant.evicted)
            seq.dp_group = group
            if self.pools is not None:
                paged = cast(Paged, seq)
                paged.kv = self.pools[group].lease(
                    paged.kv_tokens, paged.adapter_key, paged.shareable_prompt
                )
                assert paged.kv is not None  # (checked above)
            seq.cache_row = self.free_rows[group].pop()
            seq.slot = grant.slot if grant is not None else -1
            self.running.append(seq)
            out.admitted.append(seq)
        self.waiting = keep
        self._plan_drains(blocked)
        return out

    def _group_order(self, g: int) -> tuple[int, ...]:
        """The group a new sequence goes to is the largest by this key."""
        if self.pools is None:
            return (len(self.free_rows[g]), -g)
        return (bool(self.free_rows[g]), self.pools[g].available, len(self.free_rows[g]), -g)

    def _plan_drains(self, blocked: list[str]) -> None:
        """As many draining adapters as blocked ones (fewer if fewer can drain): new
        victims when more are blocked, and the draining adapters the queue needs most
        released when fewer are."""
        if not blocked:
            self.draining.clear()
            return
        queued: dict[str, int] = {}
        for seq in self.waiting:
            if seq.adapter_key is not None:
                queued[seq.adapter_key] = queued.get(seq.adapter_key, 0) + 1

        def need(key: str) -> tuple[int, int, int]:
            a = self.residency.adapters[key]
            return (queued.get(key, 0), a.slot_since, a.running)

        if len(self.draining) > len(blocked):
            self.draining = set(sorted(self.draining, key=need)[: len(blocked)])
            return
        candidates = sorted(
            (
                a.key
                for a in self.residency.adapters.values()
                if a.slot is not None
                and not a.pinned
                and not a.retired  # a retired version frees its slot when its requests end
                and a.key not in self.draining
            ),
            key=need,
        )
        self.draining.update(candidates[: len(blocked) - len(self.draining)])

    def finish(self, seq: Schedulable) -> None:
        """A running sequence is done: its row, KV pages and adapter use are released."""
        self.running.remove(seq)
        self.free_rows[seq.dp_group].append(seq.cache_row)
        if self.pools is not None:
            paged = cast(Paged, seq)
            if paged.kv is not None:
                self.pools[seq.dp_group].release(paged.kv)
                paged.kv = None
        if seq.adapter_key is not None:
            self.residency.release(seq.adapter_key)

    def drop_waiting(self, seq: Schedulable) -> bool:
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def distinct_adapters(self) -> int:
        """Adapters of the running sequences (the engine's step may leave out some whose
        slot is still loading: it counts its own)."""
        return len({s.adapter_key for s in self.running if s.adapter_key is not None})
