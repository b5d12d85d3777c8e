"""Prometheus metrics, prefix ``loraplane_``; one registry per app so tests can run many apps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FANOUT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.operations = Counter(
            "loraplane_operations",
            "Registry operations by kind and outcome",
            ["kind", "outcome"],
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
        self.on_demand_loads = Counter(
            "loraplane_on_demand_loads",
            "On-demand loads started by the router, by outcome",
            ["outcome"],
            registry=r,
        )
        self.on_demand_wait = Histogram(
            "loraplane_on_demand_wait_seconds",
            "How long a routed request waited for an on-demand load",
            buckets=FANOUT_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "loraplane_evictions", "LRU evictions of unpinned adapters", registry=r
        )
        self.workers = Gauge(
            "loraplane_workers", "Registered workers by state", ["state"], registry=r
        )
        self.adapters = Gauge(
            "loraplane_adapters", "Registered adapters by phase", ["phase"], registry=r
        )
        self.event_bus_up = Gauge(
            "loraplane_event_bus_up", "1 when the event bus (Redis) is reachable", registry=r
        )
        self.events_dropped = Counter(
            "loraplane_events_dropped", "Events not delivered to Redis (buffer full)", registry=r
        )
