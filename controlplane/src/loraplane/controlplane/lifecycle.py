"""The adapter's and its placements' states: the one module that writes them.

An adapter has a ``desired`` state (what an operator asked for) and a stored ``phase`` (what
the operation holding it is doing); the phase a client reads is derived from both and from
the placements (``registry.adapter_phase``)::

    registered ─(load)──────────> desired=loaded,   phase=Loading   ─┐
    any ───────(unload)─────────> desired=unloaded, phase=Unloading ─┼─(operation done)─> Settled
    any ───────(delete)─────────> desired=deleted,  phase=Unloading ─┘

A placement row is one (adapter version, worker, DP group)::

    loading ──> loaded ──> unloading ──> (row deleted)
       │          │  ▲          │
       │          │  └──────────┼── a failed unload, a pin change, the reconciler's restore
       └──────────┴─────────────┴──> inconsistent (present where unwanted), failed (absent where
                                     wanted), unreachable (its worker is away)

Operations (``operations``), the use cases (``application``) and the reconciler call these
functions; none writes ``phase``, ``desired`` or a placement's ``state`` itself.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import EllipsisType
from typing import Any, Literal

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from loraplane.controlplane.models import Adapter, Placement

Desired = Literal["loaded", "unloaded", "deleted"]
StoredPhase = Literal["Pending", "Loading", "Unloading", "Settled"]
PlacementState = Literal["loading", "loaded", "unloading", "inconsistent", "failed", "unreachable"]
PLACEMENT_STATES: tuple[PlacementState, ...] = (
    "loading",
    "loaded",
    "unloading",
    "inconsistent",
    "failed",
    "unreachable",
)


def now() -> datetime:
    return datetime.now(UTC)


# -- adapter ---------------------------------------------------------------------------------
def registered(load: bool) -> dict[str, Any]:
    """The state columns of a new adapter record: wanted loaded (or not), nothing done yet."""
    return {"desired": "loaded" if load else "unloaded", "phase": "Pending", "inconsistent": False}


def start_loading(adapter: Adapter, *, registering: bool = False) -> None:
    """A load (or the registration's first load) was journalled for ``adapter``."""
    if not registering:
        adapter.desired = "loaded"
        adapter.last_error = None
    adapter.phase = "Loading"


def start_unloading(adapter: Adapter, *, delete: bool) -> None:
    """An unload (or a delete) was journalled: not routed any more, every copy going away."""
    adapter.desired = "deleted" if delete else "unloaded"
    adapter.phase = "Unloading"
    for placement in adapter.placements:
        placement.state = "unloading"


def settle(adapter: Adapter, *, error: str | None, keeps_error: bool) -> None:
    """The operation holding ``adapter`` finished; ``keeps_error``: its outcome is the
    adapter's last error (loads and pin changes; an unload's is kept by the unload itself)."""
    adapter.busy_operation_id = None
    adapter.phase = "Settled"
    if keeps_error:
        adapter.last_error = error


# -- placements ------------------------------------------------------------------------------
def new_placement(
    adapter_id: int,
    worker_id: int,
    dp_group: int,
    lora_name: str,
    version: int,
    state: PlacementState,
) -> Placement:
    return Placement(
        adapter_id=adapter_id,
        worker_id=worker_id,
        dp_group=dp_group,
        lora_name=lora_name,
        version=version,
        state=_checked(state),
    )


def mark(
    row: Placement,
    state: PlacementState,
    *,
    error: str | EllipsisType | None = ...,
    observed: bool | datetime = False,
) -> None:
    """Move one row to ``state``; ``error`` is its reason (None clears it; left out, it stays);
    ``observed``: a worker was asked, so the row records when (True: just now)."""
    row.state = _checked(state)
    if not isinstance(error, EllipsisType):
        row.error = error
    if observed is True:
        row.observed_at = now()
    elif observed:
        row.observed_at = observed


def observed_since(row: Placement, asked_at: datetime) -> bool:
    """Whether ``row`` records a look at its worker later than ``asked_at`` (an operation
    that loaded it, say): an answer the worker gave before then says nothing about it now."""
    seen = row.observed_at
    if seen is None:
        return False
    return (seen if seen.tzinfo else seen.replace(tzinfo=UTC)) > asked_at  # SQLite: naive UTC


def mark_where(session: Session, state: PlacementState, *where: ColumnElement[bool]) -> None:
    """Move every row matching ``where`` to ``state`` in one statement."""
    session.execute(
        update(Placement)
        .where(*where)
        .values(state=_checked(state))
        .execution_options(synchronize_session=False)
    )


def _checked(state: str) -> str:
    if state not in PLACEMENT_STATES:
        raise ValueError(f"placement state {state!r} is not one of {list(PLACEMENT_STATES)}")
    return state
