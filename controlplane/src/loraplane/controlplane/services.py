"""What the use cases and the routers share for the lifetime of the app (opened and closed in
``app``'s lifespan). Plain Python: the application layer takes it without knowing FastAPI."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loraplane.controlplane.auth import TokenCache
from loraplane.controlplane.db import Database
from loraplane.controlplane.events import EventBus
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.operations import Inflight, Operations
from loraplane.controlplane.reconciler import Reconciler
from loraplane.controlplane.routes import RouteTable
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.sources import SourceResolver
from loraplane.controlplane.upstream import Upstream
from loraplane.controlplane.usage import UsageBatch
from loraplane.controlplane.workers import WorkerClient


@dataclass
class Services:
    settings: Settings
    db: Database
    client: WorkerClient
    bus: EventBus
    metrics: Metrics
    inflight: Inflight
    operations: Operations
    reconciler: Reconciler
    sources: SourceResolver
    routes: RouteTable  # (namespace, model) -> the ready workers holding it, from memory
    usage: UsageBatch  # adapters' last use, written once a flush
    upstream: Upstream  # the inference proxy's HTTP client
    tokens: TokenCache  # bearer tokens' principals, from memory
    # the on-demand load running per adapter id (concurrent requests join it)
    on_demand: dict[int, asyncio.Task[str]] = field(default_factory=dict)
