"""Where adapters live: host memory (up to M) and GPU slots (K). Plain Python, no tensors.

An adapter version is known by its `key` (the name the executor holds its weights under).
Every version in host memory is a `ResidentAdapter`; at most K of them hold a slot. Pinned
adapters are never evicted and at most K - 1 may be pinned, so one slot always remains for
unpinned traffic. When a slot is needed and none is free, the least recently used unpinned
adapter that no running sequence uses gives its slot up (it stays in host memory).

A superseded or unloaded version is `retired`: no new request can pick it, but sequences
already holding a reference keep it (and its slot) until they finish; then it is removed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from loraplane.rules import pins
from loraplane.rules.pins import max_pinned, room_to_pin


class ResidencyError(ValueError):
    """A residency limit would be broken; the message names the limit and the value."""


@dataclass(slots=True)
class ResidentAdapter:
    key: str  # executor name of this version
    name: str  # the name clients use
    path: str
    version: int
    pinned: bool = False
    slot: int | None = None
    last_used: int = 0  # logical clock of the last acquire or release
    running: int = 0  # running sequences using it now
    refs: int = 0  # sequences (waiting or running) that hold this version
    retired: bool = False
    slot_since: int = 0  # logical clock when it last took a slot


@dataclass(frozen=True, slots=True)
class SlotGrant:
    slot: int
    load: bool  # the slot must be filled with this adapter's weights before the next forward
    evicted: str | None = None  # key of the adapter that gave the slot up


class Residency:
    def __init__(self, num_slots: int, max_loaded: int) -> None:
        if num_slots < 1:
            raise ResidencyError(f"max_loras_per_batch must be >= 1, got {num_slots}")
        if max_loaded < num_slots:
            raise ResidencyError(
                f"max_loaded_loras ({max_loaded}) must be >= max_loras_per_batch ({num_slots})"
            )
        self.num_slots = num_slots
        self.max_loaded = max_loaded
        self.slots: list[str | None] = [None] * num_slots
        self.adapters: dict[str, ResidentAdapter] = {}
        self._clock = 0

    # --- host tier -----------------------------------------------------------------------

    @property
    def loaded_names(self) -> set[str]:
        return {a.name for a in self.adapters.values() if not a.retired}

    @property
    def pinned_names(self) -> list[str]:
        return sorted(a.name for a in self.adapters.values() if a.pinned and not a.retired)

    def current(self, name: str) -> ResidentAdapter | None:
        """The version new requests for `name` get, if any."""
        for a in self.adapters.values():
            if a.name == name and not a.retired:
                return a
        return None

    def check_add(self, name: str, pinned: bool, freeing: int = 0) -> None:
        """Raise ResidencyError if adding (or replacing) `name` would break M or the pin limit,
        once ``freeing`` loaded adapters (unpinned, not `name`) have been unloaded."""
        replacing = self.current(name)
        if replacing is None and len(self.loaded_names) - freeing >= self.max_loaded:
            raise ResidencyError(
                f"max_loaded_loras ({self.max_loaded}) adapters are already loaded "
                f"({sorted(self.loaded_names)}); unload one first or start the worker with a larger --max-loaded-loras"
            )
        if pinned:
            others = [n for n in self.pinned_names if n != name]
            if not room_to_pin(len(others), self.num_slots):
                raise ResidencyError(
                    f"pinned: {pins.RULE} = {max_pinned(self.num_slots)} adapters may be pinned "
                    f"and {others} already are; unpin one, pin fewer or raise --max-loras-per-batch"
                )

    def add(self, key: str, name: str, path: str, version: int, pinned: bool = False) -> list[str]:
        """Register a version as current; retire the previous one. Returns keys now removable."""
        if key in self.adapters:
            raise ResidencyError(f"adapter key {key!r} is already registered")
        self.check_add(name, pinned)
        removable = []
        old = self.current(name)
        if old is not None:
            removable = self.retire(old.key)
        self.adapters[key] = ResidentAdapter(
            key, name, path, version, pinned=pinned, last_used=self._tick()
        )
        return removable

    def set_pinned(self, name: str, pinned: bool) -> None:
        adapter = self.current(name)
        if adapter is None:
            raise ResidencyError(f"adapter {name!r} is not loaded")
        if pinned and not adapter.pinned:
            self.check_add(name, True)
        adapter.pinned = pinned

    def retire(self, key: str) -> list[str]:
        """No new request may pick `key`; returns [key] if nothing holds it (remove it now)."""
        adapter = self.adapters[key]
        adapter.retired = True
        adapter.pinned = False
        return [key] if adapter.refs == 0 else []

    def remove(self, key: str) -> int | None:
        """Forget a version nobody holds; returns the slot it freed, if any."""
        adapter = self.adapters.pop(key)
        if adapter.refs:
            self.adapters[key] = adapter
            raise ResidencyError(f"adapter {key!r} is still used by {adapter.refs} request(s)")
        if adapter.slot is not None:
            self.slots[adapter.slot] = None
        return adapter.slot

    # --- references from requests --------------------------------------------------------

    def hold(self, key: str) -> None:
        """A request was accepted for this version (it may still wait for a slot)."""
        self.adapters[key].refs += 1

    def unhold(self, key: str) -> bool:
        """A request let go of this version; True if it is retired and now removable."""
        adapter = self.adapters[key]
        adapter.refs -= 1
        assert adapter.refs >= 0, f"refs of {key!r} went negative"
        return adapter.retired and adapter.refs == 0

    # --- GPU slots -----------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _victim(self, prefer: Collection[str] = ()) -> ResidentAdapter | None:
        """The idle unpinned slot holder to evict: one of ``prefer`` (adapters being
        drained for a waiting request) if any is idle, else the least recently used."""
        candidates = [
            a
            for a in self.adapters.values()
            if a.slot is not None and not a.pinned and a.running == 0
        ]
        return min(candidates, key=lambda a: (a.key not in prefer, a.last_used), default=None)

    def can_acquire(self, key: str) -> bool:
        adapter = self.adapters[key]
        return adapter.slot is not None or None in self.slots or self._victim() is not None

    def acquire(self, key: str, prefer: Collection[str] = ()) -> SlotGrant | None:
        """A slot for a sequence that starts running with `key`; None if every slot is busy.
        An eviction takes an idle adapter of ``prefer`` first."""
        adapter = self.adapters[key]
        grant: SlotGrant | None
        if adapter.slot is not None:
            grant = SlotGrant(adapter.slot, load=False)
        elif None in self.slots:
            grant = SlotGrant(self.slots.index(None), load=True)
        else:
            victim = self._victim(prefer)
            if victim is None:
                return None
            assert victim.slot is not None
            grant = SlotGrant(victim.slot, load=True, evicted=victim.key)
            victim.slot = None
        if grant.load:
            adapter.slot_since = self._clock + 1
        adapter.slot = grant.slot
        self.slots[grant.slot] = key
        adapter.running += 1
        adapter.last_used = self._tick()
        return grant

    def release(self, key: str) -> None:
        """A running sequence with `key` finished (its slot stays filled, now evictable)."""
        adapter = self.adapters[key]
        adapter.running -= 1
        assert adapter.running >= 0, f"running count of {key!r} went negative"
        adapter.last_used = self._tick()

    @property
    def slots_used(self) -> int:
        return sum(k is not None for k in self.slots)

    def lru_order(self) -> list[str]:
        """Keys holding a slot, least recently used first."""
        return [
            a.key
            for a in sorted(self.adapters.values(), key=lambda a: a.last_used)
            if a.slot is not None
        ]
