"""Prometheus metrics, prefix ``loraplane_``; one registry per app so tests can run many apps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Label values known up front (counters start at 0 for them).
OPERATION_KINDS = ("register", "load", "unload", "delete", "pin", "unpin", "update_version")
OPERATION_OUTCOMES = ("succeeded", "failed", "rolled_back", "error")
ON_DEMAND_OUTCOMES = ("succeeded", "failed", "rolled_back", "no_capacity")
# The error codes the router answers with before any worker does (api/openai.py).
ROUTER_REJECT_CODES = (
    "invalid_value",
    "forbidden_namespace",
    "not_found",
    "no_worker",
    "no_capacity",
    "inconsistent",
    "on_demand_failed",
    "on_demand_timeout",
    "operation_in_progress",  # another replica claimed the adapter for its own on-demand load
)
DRIFT_KINDS = ("restored", "stray_unloaded", "placed", "repinned")
RECONCILE_OUTCOMES = ("ok", "error", "standby")
WORKER_STATES = ("pending", "ready", "unreachable")
ADAPTER_PHASES = ("Pending", "Loading", "Ready", "Degraded", "Failed", "Unloading", "Unloaded")
PLACEMENT_STATES = ("loaded", "loading", "unloading", "failed", "inconsistent", "unreachable")
FANOUT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.operations = Counter(
            "loraplane_operations",
            "Registry operations by kind and outcome, per pool",
            ["namespace", "pool", "kind", "outcome"],
            registry=r,
        )
        self.fanout_latency = Histogram(
            "loraplane_fanout_latency_seconds",
            "Wall time of one load/unload fan-out to all target workers",
            ["op"],
            buckets=FANOUT_BUCKETS,
            registry=r,
        )
        self.drift_repaired = Counter(
            "loraplane_drift_repaired",
            "Drift the reconciler repaired, by kind",
            ["kind"],
            registry=r,
        )
        self.routed_requests = Counter(
            "loraplane_routed_requests",
            "Requests the router proxied, by namespace, adapter and HTTP status",
            ["namespace", "adapter", "code"],
            registry=r,
        )
        self.router_rejected = Counter(
            "loraplane_router_rejected",
            "Routed requests answered with an error before any worker answered, by error code "
            "(not labelled by adapter: the model string is the client's)",
            ["code"],
            registry=r,
        )
        self.on_demand_loads = Counter(
            "loraplane_on_demand_loads",
            "On-demand loads started by the router, by pool and outcome",
            ["namespace", "pool", "outcome"],
            registry=r,
        )
        self.on_demand_wait = Histogram(
            "loraplane_on_demand_wait_seconds",
            "How long a routed request waited for an on-demand load",
            buckets=FANOUT_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "loraplane_evictions",
            "LRU evictions of unpinned adapters from a worker's host memory",
            ["namespace", "pool", "worker"],
            registry=r,
        )
        self.workers = Gauge(
            "loraplane_workers",
            "Registered workers by pool and state",
            ["namespace", "pool", "state"],
            registry=r,
        )
        self.adapters = Gauge(
            "loraplane_adapters",
            "Registered adapters by pool and phase",
            ["namespace", "pool", "phase"],
            registry=r,
        )
        self.placements = Gauge(
            "loraplane_placements",
            "Placement rows (adapter x worker x DP group) in the registry, by state",
            ["namespace", "pool", "worker", "state"],
            registry=r,
        )
        self.reconcile_last_success = Gauge(
            "loraplane_reconcile_last_success_timestamp_seconds",
            "Unix time of this replica's last completed reconcile pass (0: none yet)",
            registry=r,
        )
        self.reconcile_passes = Counter(
            "loraplane_reconcile_passes",
            "Reconcile passes by outcome (ok, error; standby: another replica leads)",
            ["outcome"],
            registry=r,
        )
        # 1 for the in-process bus (nothing to reach); RedisEventBus sets it from Redis.
        self.event_bus_up = Gauge(
            "loraplane_event_bus_up", "1 when the event bus (Redis) is reachable", registry=r
        )
        self.events_dropped = Counter(
            "loraplane_events_dropped", "Events not delivered to Redis (buffer full)", registry=r
        )
        # A labelled counter is born at its first increment, which rate()/increase() cannot
        # see: label values known up front start at 0 (per pool ones in `init_pool`).
        for kind in DRIFT_KINDS:
            self.drift_repaired.labels(kind)
        for outcome in RECONCILE_OUTCOMES:
            self.reconcile_passes.labels(outcome)
        for code in ROUTER_REJECT_CODES:
            self.router_rejected.labels(code)

    def init_pool(self, namespace: str, pool: str) -> None:
        """Zero the per-pool counters of a pool (idempotent, cheap: called every pass)."""
        for outcome in ON_DEMAND_OUTCOMES:
            self.on_demand_loads.labels(namespace, pool, outcome)
        for kind in OPERATION_KINDS:
            for outcome in OPERATION_OUTCOMES:
                self.operations.labels(namespace, pool, kind, outcome)
