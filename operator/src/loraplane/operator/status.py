"""Pure status logic: Kubernetes-shaped conditions, an adapter's phase from what the
control plane reports, and what the operator should do next for an adapter.

No I/O: the handlers pass in the observed state (the LoRAAdapter, the control plane's
adapter record, the pool's ready workers) and write back what these return.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loraplane.rules.pins import max_pinned

Condition = dict[str, Any]

PHASES = ("Pending", "Loading", "Ready", "Degraded", "Failed", "Unloading", "Unknown")
POOL_PHASES = ("Pending", "Ready", "Degraded", "Failed", "Unknown")
ADAPTER_CONDITIONS = ("Validated", "Loaded", "Ready", "Degraded")


def now_iso(now: dt.datetime | None = None) -> str:
    moment = now or dt.datetime.now(dt.UTC)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def condition(
    type_: str, status: bool | None, reason: str, message: str, generation: int
) -> Condition:
    """A condition without its transition time (`merge_conditions` sets it)."""
    return {
        "type": type_,
        "status": "Unknown" if status is None else ("True" if status else "False"),
        "reason": reason,
        "message": message[:32000],
        "observedGeneration": generation,
    }


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition], now: str
) -> list[Condition]:
    """`new` conditions, keeping `lastTransitionTime` of those whose status did not change;
    conditions in `old` that `new` does not mention are kept as they were."""
    previous = {c["type"]: c for c in old or []}
    merged: list[Condition] = []
    for cond in new:
        before = previous.pop(cond["type"], None)
        unchanged = before is not None and before.get("status") == cond["status"]
        merged.append(
            {
                **cond,
                "lastTransitionTime": before["lastTransitionTime"] if unchanged and before else now,
            }
        )
    merged.extend(dict(c) for c in previous.values())
    return merged


def find_condition(
    conditions: Sequence[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


# --------------------------------------------------------------------------- adapters


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: `max_attempts` failed loads per generation, then Failed."""

    max_attempts: int = 5
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0

    def delay(self, attempts: int) -> float:
        if attempts <= 0:
            return 0.0
        return float(min(self.max_delay_s, self.base_delay_s * 2 ** (attempts - 1)))


Action = Literal["register", "update_version", "patch", "load", "wait", "give_up", "none"]


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str


def _source_of(spec: Mapping[str, Any]) -> tuple[str | None, str | None]:
    source = spec.get("source") or {}
    return source.get("uri"), source.get("sha256") or None


def target_replicas(placement: str | Mapping[str, int], ready_workers: int) -> int:
    if isinstance(placement, str):
        return ready_workers
    return min(int(placement["count"]), ready_workers)


def wanted_replicas(
    placement: str | Mapping[str, int], desired: int | None, ready_workers: int
) -> int:
    """Replicas the adapter should be loaded on, of the pool's desired replicas (its
    `spec.replicas`, so a lost pod counts as missing); of its ready workers when unknown."""
    return target_replicas(placement, ready_workers if desired is None else desired)


def plan_adapter(
    spec: Mapping[str, Any],
    placement: str | Mapping[str, int],
    status: Mapping[str, Any],
    generation: int,
    cp_adapter: Mapping[str, Any] | None,
    ready_workers: Sequence[str],
    policy: RetryPolicy,
    now: dt.datetime,
) -> Plan:
    """What to do now for one adapter, from observed state only (idempotent)."""
    attempts = (
        int(status.get("attempts", 0)) if status.get("observedGeneration") == generation else 0
    )
    if cp_adapter is None:
        return _bounded(
            "register", "not registered with the control plane", attempts, status, policy, now
        )
    uri, sha = _source_of(spec)
    cp_uri, cp_sha = _source_of(cp_adapter)
    if uri != cp_uri or (sha is not None and sha != cp_sha):
        return _bounded("update_version", f"source changed to {uri}", attempts, status, policy, now)
    if (
        bool(spec.get("pinned", False)) != bool(cp_adapter.get("pinned", False))
        or int(spec.get("priority", 0)) != int(cp_adapter.get("priority", 0))
        or spec.get("loadPolicy", "OnDemand") != cp_adapter.get("load_policy", "OnDemand")
    ):
        return _bounded(
            "patch", "pinned/priority/loadPolicy changed", attempts, status, policy, now
        )
    if cp_adapter.get("placement") != placement:
        return _bounded("load", f"placement changed to {placement}", attempts, status, policy, now)
    if cp_adapter.get("phase") in ("Loading", "Unloading"):
        return Plan("wait", f"control plane reports {cp_adapter.get('phase')}")
    loaded = set(cp_adapter.get("loaded_workers") or [])
    missing = [w for w in ready_workers if w not in loaded]
    want = target_replicas(placement, len(ready_workers))
    if not ready_workers:
        return Plan("wait", "the pool has no ready workers")
    if len(loaded & set(ready_workers)) < want or cp_adapter.get("phase") in ("Failed", "Unloaded"):
        detail = f"loaded on {len(loaded & set(ready_workers))}/{want} replicas"
        if missing:
            detail += f"; missing on {', '.join(missing[:5])}"
        return _bounded("load", detail, attempts, status, policy, now)
    return Plan("none", "in sync")


def _bounded(
    action: Action,
    reason: str,
    attempts: int,
    status: Mapping[str, Any],
    policy: RetryPolicy,
    now: dt.datetime,
) -> Plan:
    if attempts >= policy.max_attempts:
        return Plan("give_up", f"{reason}; gave up after {attempts} failed attempts")
    last = parse_time(status.get("lastAttemptTime"))
    if attempts and last is not None:
        wait_s = policy.delay(attempts) - (now - last).total_seconds()
        if wait_s > 0:
            return Plan("wait", f"{reason}; backing off {wait_s:.0f} s after attempt {attempts}")
    return Plan(action, reason)


def replica_states(cp_adapter: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Per-replica, per-DP-group state from the control plane's placements."""
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for placement in (cp_adapter or {}).get("placements") or []:
        group: dict[str, Any] = {
            "dpGroup": int(placement.get("dp_group", 0)),
            "state": placement.get("state", ""),
        }
        if placement.get("error"):
            group["error"] = str(placement["error"])
        by_worker.setdefault(str(placement.get("worker")), []).append(group)
    states = []
    for worker, groups in sorted(by_worker.items()):
        groups.sort(key=lambda g: g["dpGroup"])
        kinds = {g["state"] for g in groups}
        state = (
            "loaded"
            if kinds == {"loaded"}
            else next(
                (
                    k
                    for k in ("failed", "inconsistent", "unreachable", "unloading", "loading")
                    if k in kinds
                ),
                sorted(kinds)[0] if kinds else "unknown",
            )
        )
        states.append({"worker": worker, "state": state, "dpGroups": groups})
    return states


@dataclass(frozen=True)
class AdapterView:
    """What the operator knows about one adapter after a reconcile step."""

    generation: int
    cp_adapter: Mapping[str, Any] | None
    ready_workers: Sequence[str]
    placement: str | Mapping[str, int]
    attempts: int = 0
    # Successful control-plane actions over the object's life (never reset); part of every
    # Idempotency-Key so a later action repeating an earlier request is not a replay.
    actions: int = 0
    last_error: str | None = None
    invalid: tuple[str, str] | None = None  # (reason, message): the spec cannot work
    pending: tuple[str, str] | None = None  # (reason, message): waits for something else
    gave_up: bool = False
    # The pool's spec.replicas: READY counts loaded replicas against it. None: not read.
    desired_replicas: int | None = None
    # Why the control plane could not be asked: the phase is Unknown, not a failure.
    unreachable: str | None = None
    # What this pass did, for an Event: (type, reason, message).
    event: tuple[str, str, str] | None = None


def replica_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Events for replicas that gained or lost the adapter between two statuses (a load, a
    repair after a restart, a lost pod, an eviction), from their `replicaStates`."""

    def loaded(status: Mapping[str, Any]) -> set[str]:
        return {
            str(r["worker"]) for r in status.get("replicaStates") or [] if r["state"] == "loaded"
        }

    if old.get("phase") is None or new.get("phase") == "Unknown":
        return []
    before, after = loaded(old), loaded(new)
    events = []
    if after - before:
        events.append(("Normal", "ReplicaLoaded", f"loaded on {', '.join(sorted(after - before))}"))
    if before - after:
        events.append(
            (
                "Warning",
                "ReplicaLost",
                f"no longer loaded on {', '.join(sorted(before - after))} (the worker went "
                "away or restarted, or the adapter was evicted)",
            )
        )
    return events


def adapter_status(view: AdapterView, old: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The whole `status` of a LoRAAdapter (phase, conditions, counts) for `view`."""
    if view.unreachable is not None:
        return _unknown_status(view, old, now)
    gen = view.generation
    cp = view.cp_adapter or {}
    loaded_workers = [w for w in cp.get("loaded_workers") or [] if w in set(view.ready_workers)]
    want = wanted_replicas(view.placement, view.desired_replicas, len(view.ready_workers))
    loaded = len(loaded_workers)
    # Was serving on every wanted replica and now is on fewer: a lost or not yet ready pod,
    # a scale-up not loaded yet, an eviction. (Never Ready yet: still Loading.)
    short = loaded < want and old.get("phase") in ("Ready", "Degraded", "Unknown")
    error = view.last_error or cp.get("last_error")
    conditions: list[Condition]
    if view.invalid is not None:
        reason, message = view.invalid
        phase = "Failed"
        conditions = [
            condition("Validated", False, reason, message, gen),
            condition("Loaded", False, reason, "not loaded: the spec is invalid", gen),
            condition("Ready", False, reason, message, gen),
            condition("Degraded", False, reason, "not loaded", gen),
        ]
    elif view.pending is not None:
        reason, message = view.pending
        phase = "Pending"
        conditions = [
            condition("Validated", False, reason, message, gen),
            condition("Loaded", False, reason, "waiting: " + message, gen),
            condition("Ready", False, reason, message, gen),
            condition("Degraded", False, reason, "not loaded", gen),
        ]
    else:
        validated = condition(
            "Validated", True, "Valid", "spec accepted by the control plane's preflight", gen
        )
        if view.cp_adapter is None and error:
            validated = condition("Validated", None, "NotRegistered", error, gen)
        ready = bool(cp.get("routable")) and loaded >= max(want, 1) and not view.gave_up
        if ready:
            phase = "Ready"
        elif view.gave_up:
            phase = "Failed"
        elif (short and not error) or (
            error and (view.attempts > 0 or cp.get("phase") in ("Failed", "Degraded"))
        ):
            phase = "Degraded"
        elif cp.get("phase") == "Degraded" or (loaded and loaded < want):
            phase = "Degraded" if loaded and cp.get("phase") == "Degraded" else "Loading"
        elif cp.get("phase") == "Unloading":
            phase = "Unloading"
        else:
            phase = "Loading" if view.ready_workers else "Pending"
        loaded_msg = f"loaded on {loaded}/{want} replicas" + (
            f": {', '.join(loaded_workers)}" if loaded else ""
        )
        if view.gave_up:
            reason = "RetriesExhausted"
            fail_msg = f"gave up after {view.attempts} failed attempts: {error or 'unknown error'}"
        elif short and not error:
            reason = "ReplicasUnavailable"
            fail_msg = f"{loaded_msg} the pool wants"
            if view.desired_replicas is not None and len(view.ready_workers) < want:
                fail_msg += (
                    f"; {len(view.ready_workers)} of the pool's {view.desired_replicas} "
                    "replicas are ready"
                )
        else:
            reason = "LoadFailed" if error else "Loading"
            fail_msg = error or loaded_msg
        conditions = [
            validated,
            condition(
                "Loaded",
                loaded >= max(want, 1),
                "Loaded" if loaded >= max(want, 1) else reason,
                loaded_msg if loaded >= max(want, 1) else fail_msg,
                gen,
            ),
            condition(
                "Ready",
                ready,
                "Routable" if ready else reason,
                "routable on every target replica" if ready else fail_msg,
                gen,
            ),
            condition(
                "Degraded",
                phase in ("Degraded", "Failed"),
                reason if phase in ("Degraded", "Failed") else "AsExpected",
                fail_msg if phase in ("Degraded", "Failed") else "no failures",
                gen,
            ),
        ]
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": gen,
        "replicas": len(view.ready_workers),
        "loadedReplicas": loaded,
        "ready": f"{loaded}/{want}",
        "replicaStates": [
            # Loaded on a worker that is not ready (its pod gone or restarting) serves nothing.
            {**r, "state": "notReady"}
            if r["state"] == "loaded" and r["worker"] not in view.ready_workers
            else r
            for r in replica_states(view.cp_adapter)
        ],
        "attempts": view.attempts,
        "actions": view.actions,
        "conditions": merge_conditions(old.get("conditions"), conditions, now),
    }
    for key, cp_key in (
        ("digest", "digest"),
        ("rank", "rank"),
        ("alpha", "alpha"),
        ("targetModules", "target_modules"),
        ("loraName", "lora_name"),
        ("version", "version"),
    ):
        if cp.get(cp_key) is not None:
            status[key] = cp[cp_key]
    status["lastError"] = (error or "") if phase != "Ready" else ""
    return status


def _unknown_status(view: AdapterView, old: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The control plane did not answer: nothing is known to have changed, so the counts stay
    as last seen and the conditions say Unknown (not a failure: no attempt is counted)."""
    message = f"control plane unreachable, last known state kept: {view.unreachable}"
    reason = "ControlPlaneUnavailable"
    conditions = [
        condition(kind, None, reason, message, view.generation)
        for kind in ("Loaded", "Ready", "Degraded")
    ]
    status = {k: v for k, v in old.items() if k not in ("conditions", "lastAttemptTime")}
    status.update(
        phase="Unknown",
        observedGeneration=view.generation,
        attempts=view.attempts,
        actions=view.actions,
        lastError=message,
        conditions=merge_conditions(old.get("conditions"), conditions, now),
    )
    return status


# --------------------------------------------------------------------------- pools


def pool_status(
    generation: int,
    replicas: int,
    pods: Sequence[Mapping[str, Any]],
    cp_workers: Sequence[Mapping[str, Any]],
    old: Mapping[str, Any],
    now: str,
    problem: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A LoRAPool's status from its pods (`name`, `ip`, `ready`, `worker`) and the control
    plane's workers of the pool (the API's worker objects)."""
    by_name = {w.get("name"): w for w in cp_workers}
    workers: list[dict[str, Any]] = []
    slots_used = slots_total = kv_used = kv_total = 0
    for pod in sorted(pods, key=lambda p: str(p["name"])):
        cp = by_name.get(pod["worker"]) or {}
        groups = []
        for group in cp.get("dp_groups") or []:
            used, total = int(group.get("slots_used", 0)), int(group.get("slots_total", 0))
            slots_used, slots_total = slots_used + used, slots_total + total
            pages = int(group.get("kv_pages_used", 0)), int(group.get("kv_pages_total", 0))
            kv_used, kv_total = kv_used + pages[0], kv_total + pages[1]
            groups.append(
                {
                    "dpGroup": int(group.get("dp_group", 0)),
                    "healthy": cp.get("state") == "ready",
                    "slotsUsed": used,
                    "slotsTotal": total,
                    "kvPagesUsed": pages[0],
                    "kvPagesTotal": pages[1],
                    "adapters": list(group.get("adapters") or []),
                }
            )
        slots = cp.get("slots") or {}
        workers.append(
            {
                "name": pod["worker"],
                "pod": pod["name"],
                "podIP": pod.get("ip") or "",
                "ready": bool(pod.get("ready")),
                "state": cp.get("state", "unregistered"),
                "loaded": int(slots.get("loaded", 0)),
                "pinned": int(slots.get("pinned", 0)),
                "dpGroups": groups,
            }
        )
    ready = sum(1 for p in pods if p.get("ready"))
    registered = sum(1 for w in workers if w["state"] == "ready")
    if problem is not None:
        phase, reason = "Failed", problem[0]
        conditions = [
            condition("Validated", False, problem[0], problem[1], generation),
            condition("Ready", False, problem[0], problem[1], generation),
        ]
    else:
        all_ready = ready == replicas and registered == replicas
        reason = "AllReplicasReady" if all_ready else "ReplicasNotReady"
        # Nothing serving yet is Pending; some but not all replicas serving is Degraded.
        phase = "Ready" if all_ready else ("Degraded" if registered else "Pending")
        conditions = [
            condition("Validated", True, "Valid", "spec accepted", generation),
            condition(
                "Ready",
                all_ready,
                reason,
                f"{ready}/{replicas} pods ready, {registered}/{replicas} workers ready in the control plane",
                generation,
            ),
        ]
    return {
        "phase": phase,
        "reason": reason,
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "registeredWorkers": registered,
        "slotsUsed": slots_used,
        "slotsTotal": slots_total,
        "kvPagesUsed": kv_used,
        "kvPagesTotal": kv_total,
        "workers": workers,
        "conditions": merge_conditions(old.get("conditions"), conditions, now),
    }


def pool_problem(
    generation: int, old: Mapping[str, Any], now: str, reason: str, message: str
) -> dict[str, Any]:
    """A pool's status when its spec is refused (`InvalidSpec`: phase Failed) or the control
    plane refused the pool (phase Degraded); the rest of the status stays as it was."""
    return {
        "phase": "Failed" if reason == "InvalidSpec" else "Degraded",
        "reason": reason,
        "observedGeneration": generation,
        "conditions": merge_conditions(
            old.get("conditions"),
            [
                # Only a bad spec is known invalid; other problems leave it Unknown.
                condition(
                    "Validated",
                    False if reason == "InvalidSpec" else None,
                    reason,
                    message,
                    generation,
                ),
                condition("Ready", False, reason, message, generation),
            ],
            now,
        ),
    }


def pool_unknown(
    generation: int,
    replicas: int,
    pods: Sequence[Mapping[str, Any]],
    old: Mapping[str, Any],
    now: str,
    message: str,
) -> dict[str, Any]:
    """A pool's status while the control plane does not answer: pods as seen, phase Unknown,
    the workers' state as last known."""
    base = pool_status(generation, replicas, pods, [], old, now)
    reason = "ControlPlaneUnavailable"
    base.update(phase="Unknown", reason=reason, workers=old.get("workers") or base["workers"])
    base["registeredWorkers"] = old.get("registeredWorkers", 0)
    base["conditions"] = merge_conditions(
        base["conditions"], [condition("Ready", None, reason, message, generation)], now
    )
    return base


def pool_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """A phase change of a LoRAPool as an Event (Warning when it is worse than Ready)."""
    before, after = old.get("phase"), new.get("phase")
    if before == after or after is None:
        return []
    ready = find_condition(new.get("conditions"), "Ready") or {}
    kind = "Normal" if after in ("Ready", "Pending") else "Warning"
    return [(kind, str(after), f"{before or 'None'} -> {after}: {ready.get('message', '')}")]


def excess_pinned(
    adapters: Sequence[Mapping[str, Any]], max_loras_per_batch: int
) -> dict[str, str]:
    """Pinned adapters of one pool beyond K-1, oldest first keep their pin: name → message.

    `adapters` are LoRAAdapter objects of the pool (metadata + spec)."""
    pinned = sorted(
        (
            a
            for a in adapters
            if (a.get("spec") or {}).get("pinned") and not a["metadata"].get("deletionTimestamp")
        ),
        key=lambda a: (a["metadata"].get("creationTimestamp") or "", a["metadata"]["name"]),
    )
    allowed = max_pinned(max_loras_per_batch)
    keep = [a["metadata"]["name"] for a in pinned[:allowed]]
    return {
        a["metadata"]["name"]: (
            f"spec.pinned: pool allows at most maxLorasPerBatch-1 = {allowed} pinned adapters "
            f"per worker; already pinned: {', '.join(keep) or 'none'}"
        )
        for a in pinned[allowed:]
    }
