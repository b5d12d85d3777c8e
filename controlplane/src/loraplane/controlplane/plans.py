"""What an operation will do, decided before any worker is touched: frozen dataclasses.

A use case builds a plan, the journal stores it (``Operation.plan``, JSON) and the runner (or,
after a restart, the settling pass) reads it back with `plan_from_json`. ``to_json`` and
``from_json`` are the only places a plan is a dict; the JSON keys are those of the journal
rows written so far, so a replica reads operations an older one journalled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from loraplane.controlplane.models import Worker


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """A worker as an operation addresses it (the row may be gone by the time it runs)."""

    id: int
    name: str
    endpoint: str
    dp_size: int

    @classmethod
    def of(cls, worker: Worker) -> WorkerRef:
        return cls(worker.id, worker.name, worker.endpoint, worker.dp_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.id,
            "worker": self.name,
            "endpoint": self.endpoint,
            "dp_size": self.dp_size,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> WorkerRef:
        return cls(
            int(body["worker_id"]), str(body["worker"]), str(body["endpoint"]), int(body["dp_size"])
        )


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """One worker a load goes to: the adapters it evicts first, or that it holds it already
    (on every DP group), in which case nothing is sent to it."""

    worker: WorkerRef
    evict: tuple[str, ...] = ()
    already_loaded: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            **self.worker.to_json(),
            "evict": list(self.evict),
            "already_loaded": self.already_loaded,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> LoadTarget:
        return cls(
            WorkerRef.from_json(body),
            tuple(str(name) for name in body.get("evict") or ()),
            bool(body.get("already_loaded")),
        )


def _load_targets(body: Mapping[str, Any]) -> tuple[LoadTarget, ...]:
    return tuple(LoadTarget.from_json(t) for t in body.get("targets") or ())


def _workers(items: Any) -> tuple[WorkerRef, ...]:
    return tuple(WorkerRef.from_json(t) for t in items or ())


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load ``lora_name`` (``path``) onto every target, all or nothing; then unload the copies
    on ``shrink`` (a placement count smaller than what it holds)."""

    adapter_id: int
    lora_name: str
    path: str
    pinned: bool
    targets: tuple[LoadTarget, ...] = ()
    shrink: tuple[WorkerRef, ...] = ()

    @property
    def workers(self) -> tuple[WorkerRef, ...]:
        return tuple(t.worker for t in self.targets)

    @property
    def already_loaded(self) -> frozenset[str]:
        return frozenset(t.worker.name for t in self.targets if t.already_loaded)

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter_id": self.adapter_id,
            "lora_name": self.lora_name,
            "path": self.path,
            "pinned": self.pinned,
            "targets": [t.to_json() for t in self.targets],
            "shrink": [w.to_json() for w in self.shrink],
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> LoadPlan:
        return cls(
            int(body["adapter_id"]),
            str(body["lora_name"]),
            str(body["path"]),
            bool(body["pinned"]),
            _load_targets(body),
            _workers(body.get("shrink")),
        )


@dataclass(frozen=True, slots=True)
class NewVersion:
    """The adapter's record once a new version has replaced the old one."""

    version: int
    source_uri: str
    source_sha256: str | None
    path: str
    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source_uri": self.source_uri,
            "source_sha256": self.source_sha256,
            "path": self.path,
            "digest": self.digest,
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "base_model": self.base_model,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> NewVersion:
        return cls(
            int(body["version"]),
            str(body["source_uri"]),
            body.get("source_sha256"),
            str(body["path"]),
            str(body["digest"]),
            int(body["rank"]),
            float(body["alpha"]),
            tuple(body.get("target_modules") or ()),
            body.get("base_model"),
        )


@dataclass(frozen=True, slots=True)
class VersionPlan:
    """Make before break: load ``lora_name`` (the new version) beside ``old_lora_name`` on the
    workers that hold the old one, switch the record to ``new``, unload the old version."""

    adapter_id: int
    lora_name: str
    path: str
    pinned: bool
    targets: tuple[LoadTarget, ...]
    old_lora_name: str
    old_targets: tuple[WorkerRef, ...]
    new: NewVersion

    @property
    def workers(self) -> tuple[WorkerRef, ...]:
        return tuple(t.worker for t in self.targets)

    @property
    def load(self) -> LoadPlan:
        """The loading half (unpinned: the pin moves over once the old version is gone)."""
        return LoadPlan(self.adapter_id, self.lora_name, self.path, False, self.targets)

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter_id": self.adapter_id,
            "lora_name": self.lora_name,
            "path": self.path,
            "pinned": self.pinned,
            "targets": [t.to_json() for t in self.targets],
            "old_lora_name": self.old_lora_name,
            "old_targets": [w.to_json() for w in self.old_targets],
            "new": self.new.to_json(),
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> VersionPlan:
        return cls(
            int(body["adapter_id"]),
            str(body["lora_name"]),
            str(body["path"]),
            bool(body["pinned"]),
            _load_targets(body),
            str(body["old_lora_name"]),
            _workers(body.get("old_targets")),
            NewVersion.from_json(body["new"]),
        )


@dataclass(frozen=True, slots=True)
class UnloadTarget:
    worker: WorkerRef
    lora_names: tuple[str, ...]  # every version of the adapter the worker holds


@dataclass(frozen=True, slots=True)
class UnloadPlan:
    """Unload every version of the adapter from every worker holding one; ``then='delete'``
    deletes the record once nothing is left anywhere."""

    adapter_id: int
    targets: tuple[UnloadTarget, ...]
    then: Literal["keep", "delete"] = "keep"

    @property
    def workers(self) -> tuple[WorkerRef, ...]:
        return tuple(t.worker for t in self.targets)

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter_id": self.adapter_id,
            "targets": [
                {**t.worker.to_json(), "lora_names": list(t.lora_names)} for t in self.targets
            ],
            "then": self.then,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> UnloadPlan:
        return cls(
            int(body["adapter_id"]),
            tuple(
                UnloadTarget(WorkerRef.from_json(t), tuple(t["lora_names"]))
                for t in body.get("targets") or ()
            ),
            "delete" if body.get("then") == "delete" else "keep",
        )


@dataclass(frozen=True, slots=True)
class PinPlan:
    """Reload ``lora_name`` with the new ``pinned`` flag on every worker that holds it."""

    adapter_id: int
    lora_name: str
    path: str
    pinned: bool
    targets: tuple[WorkerRef, ...]

    @property
    def workers(self) -> tuple[WorkerRef, ...]:
        return self.targets

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter_id": self.adapter_id,
            "lora_name": self.lora_name,
            "path": self.path,
            "pinned": self.pinned,
            "targets": [w.to_json() for w in self.targets],
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PinPlan:
        return cls(
            int(body["adapter_id"]),
            str(body["lora_name"]),
            str(body["path"]),
            bool(body["pinned"]),
            _workers(body.get("targets")),
        )


Plan = LoadPlan | VersionPlan | UnloadPlan | PinPlan

PLAN_OF_KIND: dict[str, type[LoadPlan] | type[VersionPlan] | type[UnloadPlan] | type[PinPlan]] = {
    "register": LoadPlan,
    "load": LoadPlan,
    "update_version": VersionPlan,
    "unload": UnloadPlan,
    "delete": UnloadPlan,
    "pin": PinPlan,
    "unpin": PinPlan,
}


def plan_from_json(kind: str, body: Mapping[str, Any]) -> Plan:
    """The plan of a journalled operation of ``kind``."""
    try:
        plan_type = PLAN_OF_KIND[kind]
    except KeyError:
        raise ValueError(
            f"operation kind {kind!r} has no plan; known kinds: {sorted(PLAN_OF_KIND)}"
        ) from None
    return plan_type.from_json(body)
