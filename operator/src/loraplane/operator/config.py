"""Operator settings: command-line flags with `LORAPLANE_OPERATOR_*` environment defaults."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from loraplane.operator.builders import WorkerDefaults
from loraplane.operator.status import RetryPolicy


def newest_first_priority(now_ns: int | None = None) -> int:
    """A peering priority that grows with the process's start time (milliseconds, then 3
    random digits against ties): a restarted or newly started operator outranks every record
    an older process left, so it acts at once instead of pausing until a killed process's
    record expires; an older live replica pauses in its favour."""
    start_ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    return start_ms * 1000 + secrets.randbelow(1000)


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
    # Seconds a replica's peering record counts as alive without a keep-alive (kopf renews it
    # 5-10 s earlier): how long a standby waits for a leader that died without a restart.
    peering_lifetime_s: int = 15
    namespaces: tuple[str, ...] = ()  # empty: every namespace (cluster-wide)
    health_endpoint: str | None = None
