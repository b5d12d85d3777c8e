"""Continuous-batching admission: which waiting sequences start running this step.

Plain Python. Sequences join the running set between steps and leave it when they finish.
Each DP group has its own KV rows (`0..rows_per_group-1`); a new sequence goes to the group
with the most free rows. Admission is FIFO by arrival with one exception that cannot starve
anyone: a request without an adapter may pass a request that waits for an adapter slot (it
takes no slot). Once a request waits for a slot, no later request with an adapter is admitted
until it got one, so the running adapters drain and the LRU one gives its slot up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from loraplane.worker.engine.residency import Residency, SlotGrant


class Schedulable(Protocol):
    adapter_key: str | None
    dp_group: int
    cache_row: int
    slot: int


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
        self, dp_size: int, rows_per_group: int, max_running: int, residency: Residency
    ) -> None:
        if dp_size < 1 or rows_per_group < 1 or max_running < 1:
            raise ValueError(
                f"dp_size ({dp_size}), rows_per_group ({rows_per_group}) and max_running ({max_running}) must be >= 1"
            )
        self.dp_size = dp_size
        self.max_running = min(max_running, dp_size * rows_per_group)
        self.residency = residency
        self.free_rows: list[list[int]] = [
            list(range(rows_per_group - 1, -1, -1)) for _ in range(dp_size)
        ]
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []

    def add(self, seq: Schedulable) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Admission:
        out = Admission()
        slot_blocked = False
        keep: deque[Schedulable] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            group = max(range(self.dp_size), key=lambda g: (len(self.free_rows[g]), -g))
            if len(self.running) >= self.max_running or not self.free_rows[group]:
                keep.append(seq)
                keep.extend(self.waiting)
                self.waiting.clear()
                break
            grant: SlotGrant | None = None
            if seq.adapter_key is not None:
                if slot_blocked:
                    keep.append(seq)
                    out.waiting_for_slot += 1
                    continue
                grant = self.residency.acquire(seq.adapter_key)
                if grant is None:
                    slot_blocked = True
                    keep.append(seq)
                    out.waiting_for_slot += 1
                    continue
                if grant.load:
                    out.slot_loads.append((grant.slot, seq.adapter_key))
                if grant.evicted is not None:
                    out.evicted.append(grant.evicted)
            seq.dp_group = group
            seq.cache_row = self.free_rows[group].pop()
            seq.slot = grant.slot if grant is not None else -1
            self.running.append(seq)
            out.admitted.append(seq)
        self.waiting = keep
        return out

    def finish(self, seq: Schedulable) -> None:
        """A running sequence is done: its KV row and adapter use are released."""
        self.running.remove(seq)
        self.free_rows[seq.dp_group].append(seq.cache_row)
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
