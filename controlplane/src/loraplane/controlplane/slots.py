"""Slot accounting, pinning, LRU eviction and placement choice: plain Python, no I/O.

Per worker: ``max_loaded_loras`` (M) adapters may be resident, ``max_loras_per_batch`` (K)
GPU slots exist, and at most K - 1 resident adapters may be pinned so one slot always remains
for unpinned traffic. Pinned adapters are never evicted. When a worker needs room the least
recently routed unpinned adapter with no request in flight is evicted (cluster-level LRU,
kept by the router), lowest ``priority`` first; only an adapter settled as loaded there with
no operation of its own in progress is a candidate. Placement prefers workers that already hold the adapter, then the most
free slots, then the fewest requests in flight, then the name (deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loraplane.rules.pins import RULE, max_pinned, room_to_pin


@dataclass(frozen=True, slots=True)
class Resident:
    """An adapter resident on a worker, as the slot accounting sees it."""

    adapter: str  # registry key, e.g. "default/sql-expert"
    pinned: bool
    last_used: float  # seconds since epoch of the last routed request, or of its load
    inflight: int = 0  # requests being proxied with it now ("in the running batch")
    priority: int = 0  # higher is evicted later
    settled: bool = True  # loaded on every row and no operation of its own in progress


@dataclass(frozen=True, slots=True)
class WorkerSlots:
    name: str
    max_loras_per_batch: int
    max_loaded_loras: int
    resident: tuple[Resident, ...] = ()
    inflight: int = 0
    ready: bool = True

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch "
                f"({self.max_loras_per_batch})"
            )

    @property
    def max_pinned(self) -> int:
        return max_pinned(self.max_loras_per_batch)

    @property
    def pinned(self) -> tuple[str, ...]:
        return tuple(r.adapter for r in self.resident if r.pinned)

    @property
    def free(self) -> int:
        return self.max_loaded_loras - len(self.resident)

    def holds(self, adapter: str) -> bool:
        return any(r.adapter == adapter for r in self.resident)


class PinLimitExceeded(Exception):
    def __init__(self, worker: str, limit: int, pinned: Sequence[str]) -> None:
        self.worker = worker
        self.limit = limit
        self.pinned = tuple(pinned)
        super().__init__(
            f"worker {worker!r} already has {len(pinned)} pinned adapters ({', '.join(pinned) or '-'}); "
            f"{RULE} = {limit} may be pinned so one slot stays free for "
            "unpinned traffic"
        )


class NoCapacity(Exception):
    """Not enough room. ``no_worker``: some worker was not ready, or none is registered."""

    def __init__(self, message: str, *, no_worker: bool = False) -> None:
        super().__init__(message)
        self.no_worker = no_worker


def check_pin(worker: WorkerSlots, adapter: str) -> None:
    """Raise PinLimitExceeded if pinning ``adapter`` on ``worker`` would exceed K - 1."""
    pinned = [a for a in worker.pinned if a != adapter]
    if not room_to_pin(len(pinned), worker.max_loras_per_batch):
        raise PinLimitExceeded(worker.name, worker.max_pinned, pinned)


def choose_evictions(
    worker: WorkerSlots, needed: int = 1, protect: Iterable[str] = ()
) -> list[str]:
    """Adapters to evict from ``worker`` so ``needed`` more fit; LRU first, never pinned or busy.

    Raises NoCapacity naming why when not enough can be evicted.
    """
    shortfall = needed - worker.free
    if shortfall <= 0:
        return []
    protected = set(protect)
    candidates = sorted(
        (
            r
            for r in worker.resident
            if not r.pinned and r.inflight == 0 and r.settled and r.adapter not in protected
        ),
        key=lambda r: (r.priority, r.last_used, r.adapter),
    )
    if len(candidates) < shortfall:
        pinned = len(worker.pinned)
        busy = sum(1 for r in worker.resident if not r.pinned and r.inflight > 0)
        moving = sum(1 for r in worker.resident if not r.pinned and not r.settled)
        raise NoCapacity(
            f"worker {worker.name!r} holds {len(worker.resident)}/{worker.max_loaded_loras} adapters "
            f"({pinned} pinned, {busy} with requests in flight, {moving} loading, unloading or "
            f"in an operation); cannot evict {shortfall}"
        )
    return [r.adapter for r in candidates[:shortfall]]


@dataclass(frozen=True, slots=True)
class Target:
    worker: str
    evict: tuple[str, ...] = ()
    already_loaded: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    targets: tuple[Target, ...]
    skipped: dict[str, str] = field(default_factory=dict)  # worker -> why it is not a target


def rank_workers(workers: Sequence[WorkerSlots], adapter: str) -> list[WorkerSlots]:
    """Ready workers in placement preference order for ``adapter``."""
    ready = [w for w in workers if w.ready]
    return sorted(ready, key=lambda w: (not w.holds(adapter), -w.free, w.inflight, w.name))


def plan_placement(
    workers: Sequence[WorkerSlots],
    adapter: str,
    *,
    count: int | None,
    pinned: bool,
) -> Plan:
    """Choose target workers for ``adapter``: all ready workers (``count=None``) or ``count`` of them.

    Raises PinLimitExceeded (pinning on a worker that cannot take it; for ``count`` placement
    such workers are skipped instead) or NoCapacity (not enough workers can make room).
    """
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    targets: list[Target] = []
    skipped: dict[str, str] = {}
    for worker in workers:
        if not worker.ready:
            skipped[worker.name] = "not ready"
    for worker in rank_workers(workers, adapter):
        if count is not None and len(targets) == count:
            break
        try:
            if pinned:
                check_pin(worker, adapter)
            evict = [] if worker.holds(adapter) else choose_evictions(worker, 1, protect=[adapter])
        except (PinLimitExceeded, NoCapacity) as exc:
            if count is None:
                raise
            skipped[worker.name] = str(exc)
            continue
        targets.append(Target(worker.name, tuple(evict), worker.holds(adapter)))
    if not targets:
        reasons = (
            "; ".join(f"{name}: {why}" for name, why in sorted(skipped.items()))
            or "no workers registered"
        )
        raise NoCapacity(
            f"no worker can take {adapter!r} ({reasons})",
            no_worker=not skipped or "not ready" in skipped.values(),
        )
    if count is not None and len(targets) < count:
        reasons = "; ".join(f"{name}: {why}" for name, why in sorted(skipped.items()))
        raise NoCapacity(
            f"placement count {count} needs {count} ready workers with room, found {len(targets)}"
            + (f" ({reasons})" if reasons else ""),
            no_worker="not ready" in skipped.values(),
        )
    return Plan(tuple(targets), skipped)
