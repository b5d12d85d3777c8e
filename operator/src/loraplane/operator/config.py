"""Operator settings: command-line flags with `LORAPLANE_OPERATOR_*` environment defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane.operator.builders import WorkerDefaults
from loraplane.operator.status import RetryPolicy


@dataclass(frozen=True)
class OperatorConfig:
    # Where the control plane is: a URL, or (for clusters without Service routing, like
    # the local development cluster) a pod label selector resolved to a ready pod's IP.
    controlplane_url: str = "http://loraplane-controlplane:8080"
    controlplane_selector: str | None = None
    controlplane_namespace: str | None = None
    controlplane_port: int = 8080
    admin_token: str | None = None
    resync_interval_s: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    worker: WorkerDefaults = field(default_factory=WorkerDefaults)
    peering_name: str = "loraplane"
    standalone: bool = False
    priority: int = 0
    namespaces: tuple[str, ...] = ()  # empty: every namespace (cluster-wide)
    health_endpoint: str | None = None
