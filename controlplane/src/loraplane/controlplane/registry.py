"""Queries and JSON views of the registry shared by the API, operations and reconciler."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.errors import InvalidValue, excerpt, not_found
from loraplane.controlplane.models import Adapter, Operation, Placement, Pool, Worker
from loraplane.controlplane.slots import Resident, WorkerSlots
from loraplane.rules.names import DNS_LABEL_RULE, is_dns_label
from loraplane.rules.names import lora_name as lora_name  # the routes import it here


def check_label(value: str, field: str) -> str:
    if not is_dns_label(value):
        raise InvalidValue(
            f"{field}: {excerpt(value)} is not a DNS-1123 label ({DNS_LABEL_RULE})",
            field=field,
        )
    return value


def iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()


def get_pool(session: Session, namespace: str, name: str, field: str = "path.name") -> Pool:
    pool = session.scalar(select(Pool).where(Pool.namespace == namespace, Pool.name == name))
    if pool is None:
        raise not_found("pool", f"{namespace}/{name}", field=field)
    return pool


def get_worker(session: Session, name: str) -> Worker:
    worker = session.scalar(select(Worker).where(Worker.name == name))
    if worker is None:
        raise not_found("worker", name, field="path.name")
    return worker


def get_adapter(session: Session, namespace: str, name: str) -> Adapter:
    adapter = session.scalar(
        select(Adapter).where(Adapter.namespace == namespace, Adapter.name == name)
    )
    if adapter is None:
        raise not_found("adapter", f"{namespace}/{name}", field="path.name")
    return adapter


def pool_json(pool: Pool, detail: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "namespace": pool.namespace,
        "name": pool.name,
        "model": pool.model,
        "tp": pool.tp,
        "dp": pool.dp,
        "max_loras_per_batch": pool.max_loras_per_batch,
        "max_loaded_loras": pool.max_loaded_loras,
        "max_lora_rank": pool.max_lora_rank,
        "target_modules": pool.target_modules,
        "created_at": iso(pool.created_at),
        "updated_at": iso(pool.updated_at),
    }
    if detail:
        body["workers"] = sorted(w.name for w in pool.workers)
        body["adapters"] = len(pool.adapters)
    return body


def worker_loaded(worker: Worker) -> dict[str, tuple[Adapter, list[Placement]]]:
    """lora_name -> (adapter, placements) of everything registered on ``worker``."""
    held: dict[str, tuple[Adapter, list[Placement]]] = {}
    for placement in worker.placements:
        entry = held.setdefault(placement.lora_name, (placement.adapter, []))
        entry[1].append(placement)
    return held


def worker_json(worker: Worker, inflight: int = 0) -> dict[str, Any]:
    pool = worker.pool
    held = worker_loaded(worker)
    pinned = sum(1 for adapter, _ in held.values() if adapter.pinned)
    groups: list[dict[str, Any]] = []
    observed = worker.observed or {}
    observed_groups = (
        observed.get("dp_groups", observed.get("groups")) if isinstance(observed, dict) else None
    )
    for group in range(worker.dp_size):
        names = sorted(
            name
            for name, (_, rows) in held.items()
            if any(r.dp_group == group and r.state == "loaded" for r in rows)
        )
        slots_used = len(names)
        seen: dict[str, Any] = {}  # the worker's last /lora_state of this group
        if isinstance(observed_groups, list) and group < len(observed_groups):
            seen = observed_groups[group]
            slots_used = int(seen.get("slots_used", slots_used))
        groups.append(
            {
                "dp_group": group,
                "adapters": names,
                "slots_used": slots_used,
                "slots_total": pool.max_loras_per_batch,
                # the paged KV cache's pages held by requests, and all of them (0: not seen)
                "kv_pages_used": int(seen.get("kv_pages_used", 0)),
                "kv_pages_total": int(seen.get("kv_pages_total", 0)),
            }
        )
    return {
        "name": worker.name,
        "namespace": pool.namespace,
        "pool": pool.name,
        "endpoint": worker.endpoint,
        "dp_size": worker.dp_size,
        "state": worker.state,
        "served_model": worker.served_model,
        "last_seen_at": iso(worker.last_seen_at),
        "last_error": worker.last_error,
        "inflight": inflight,
        "slots": {
            "max_loras_per_batch": pool.max_loras_per_batch,
            "max_loaded_loras": pool.max_loaded_loras,
            "loaded": len(held),
            "pinned": pinned,
        },
        "dp_groups": groups,
        "registered_at": iso(worker.registered_at),
        "updated_at": iso(worker.updated_at),
    }


def routable_workers(adapter: Adapter) -> list[Worker]:
    """Ready workers on which the adapter's current version is loaded on every DP group."""
    if adapter.inconsistent or adapter.desired != "loaded":
        return []
    current = lora_name(adapter.namespace, adapter.name, adapter.version)
    by_worker: dict[int, list[Placement]] = {}
    for placement in adapter.placements:
        if placement.lora_name == current:
            by_worker.setdefault(placement.worker_id, []).append(placement)
    workers = []
    for rows in by_worker.values():
        worker = rows[0].worker
        groups = {r.dp_group for r in rows if r.state == "loaded"}
        if worker.state == "ready" and groups >= set(range(worker.dp_size)):
            workers.append(worker)
    return sorted(workers, key=lambda w: w.name)


def adapter_phase(adapter: Adapter) -> str:
    if adapter.busy_operation_id and adapter.phase in ("Loading", "Unloading"):
        return adapter.phase
    if adapter.inconsistent:
        return "Degraded"
    if adapter.desired != "loaded":
        return "Unloaded" if not adapter.placements else "Unloading"
    current = lora_name(adapter.namespace, adapter.name, adapter.version)
    targets = {p.worker_id for p in adapter.placements if p.lora_name == current}
    routable = routable_workers(adapter)
    if routable and len(routable) == len(targets):
        return "Ready"
    if routable:
        return "Degraded"
    if adapter.last_error:
        return "Failed"
    return "Pending"


def adapter_json(adapter: Adapter) -> dict[str, Any]:
    placements = sorted(adapter.placements, key=lambda p: (p.worker.name, p.dp_group, p.lora_name))
    return {
        "namespace": adapter.namespace,
        "name": adapter.name,
        "pool": adapter.pool.name,
        "source": {"uri": adapter.source_uri, "sha256": adapter.source_sha256},
        "digest": adapter.digest,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules),
        "base_model": adapter.base_model,
        "pinned": adapter.pinned,
        "placement": "all"
        if adapter.placement_count is None
        else {"count": adapter.placement_count},
        "priority": adapter.priority,
        "load_policy": adapter.load_policy,
        "version": adapter.version,
        "lora_name": lora_name(adapter.namespace, adapter.name, adapter.version),
        "phase": adapter_phase(adapter),
        "routable": bool(routable_workers(adapter)),
        "inconsistent": adapter.inconsistent,
        "loaded_workers": [w.name for w in routable_workers(adapter)],
        "placements": [placement_json(p, with_adapter=False) for p in placements],
        "last_error": adapter.last_error,
        "last_used_at": (
            iso(datetime.fromtimestamp(adapter.last_used_at, UTC)) if adapter.last_used_at else None
        ),
        "created_at": iso(adapter.created_at),
        "updated_at": iso(adapter.updated_at),
    }


def placement_json(placement: Placement, with_adapter: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if with_adapter:
        body["namespace"] = placement.adapter.namespace
        body["adapter"] = placement.adapter.name
    body.update(
        {
            "worker": placement.worker.name,
            "dp_group": placement.dp_group,
            "state": placement.state,
            "lora_name": placement.lora_name,
            "version": placement.version,
            "observed_at": iso(placement.observed_at),
            "error": placement.error,
        }
    )
    return body


def operation_json(op: Operation) -> dict[str, Any]:
    return {
        "id": op.id,
        "idempotency_key": op.idempotency_key,
        "kind": op.kind,
        "namespace": op.namespace,
        "adapter": op.adapter_name,
        "state": op.state,
        "targets": list(op.targets or []),
        "per_target": list(op.per_target or []),
        "result": op.result,
        "error": op.error,
        "error_code": op.error_code,
        "created_at": iso(op.created_at),
        "updated_at": iso(op.updated_at),
        "finished_at": iso(op.finished_at),
    }


def worker_slots(
    worker: Worker, inflight_by_adapter: dict[tuple[int, str], int], worker_inflight: int
) -> WorkerSlots:
    pool = worker.pool
    resident = []
    for name, (adapter, rows) in worker_loaded(worker).items():
        resident.append(
            Resident(
                adapter=name,
                pinned=adapter.pinned,
                last_used=adapter.last_used_at or 0.0,
                inflight=inflight_by_adapter.get((worker.id, name), 0),
                priority=adapter.priority or 0,
                settled=adapter.busy_operation_id is None
                and all(r.state == "loaded" for r in rows),
            )
        )
    return WorkerSlots(
        name=worker.name,
        max_loras_per_batch=pool.max_loras_per_batch,
        max_loaded_loras=pool.max_loaded_loras,
        resident=tuple(resident),
        inflight=worker_inflight,
        ready=worker.state == "ready",
    )
