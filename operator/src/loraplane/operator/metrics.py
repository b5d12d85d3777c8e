"""Prometheus metrics of the operator (prefix `loraplane_operator_`), served on `--metrics-port`.

One registry per `OperatorMetrics` so tests can make several. What is measured:

- `loraplane_operator_leader`: 1 while this replica acts, 0 while kopf peering pauses it.
  kopf 1.45 keeps its pause state (a `ToggleSet` inside `spawn_tasks`) out of reach of
  handlers and memo, and a paused replica runs no handler, so no handler can report it.
  What kopf does expose is the log line of each transition: with mandatory peering every
  peering toggle starts *on* (paused) and `kopf._core.engines.peering.process_peering_event`
  logs "Resuming operations ..." when it turns it off and "Pausing operations ..." /
  "Pausing all operators ..." when it turns it on. `PeeringWatcher` is a logging handler on
  that logger: the gauge starts at 0 (1 with `--standalone`, where kopf never pauses) and
  follows those transitions. It is approximate only for a namespaced operator watching several
  namespaces (one peering toggle per namespace, one log stream): the last transition wins.
- `loraplane_operator_adapters{namespace,pool,phase}`: the `status.phase` this replica last
  wrote for each LoRAAdapter (a standby replica writes none, so it reports none).
- `loraplane_operator_reconciles_total{kind,outcome}` and `_reconcile_seconds{kind}`: every
  reconcile pass of a LoRAPool or LoRAAdapter (create/update/resume and the resync timers).
- `loraplane_operator_controlplane_up`: 1 after a call answered, 0 after a call that found
  the control plane unreachable (or answering 5xx); absent until the first call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplane.operator.status import PHASES

KINDS = ("lorapool", "loraadapter")
OUTCOMES = ("ok", "temporary_error", "permanent_error")
PEERING_LOGGER = "kopf._core.engines.peering"
RECONCILE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 150)

F = TypeVar("F", bound=Callable[..., Any])


class _State(Collector):
    """Adapter phases and control plane reachability, rendered at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.adapters: dict[tuple[str, str], tuple[str, str]] = {}  # (ns, name) -> (pool, phase)
        self.controlplane_up: bool | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            adapters = list(self.adapters.items())
            up = self.controlplane_up
        family = GaugeMetricFamily(
            "loraplane_operator_adapters",
            "LoRAAdapter resources by the status.phase this replica wrote",
            labels=["namespace", "pool", "phase"],
        )
        counts: dict[tuple[str, str, str], int] = {}
        for (namespace, _name), (pool, _phase) in adapters:
            for phase in PHASES:  # every phase of a known pool, 0 when empty
                counts.setdefault((namespace, pool, phase), 0)
        for (namespace, _name), (pool, phase) in adapters:
            counts[(namespace, pool, phase)] = counts.get((namespace, pool, phase), 0) + 1
        for labels, count in sorted(counts.items()):
            family.add_metric(list(labels), count)
        yield family
        if up is not None:
            yield GaugeMetricFamily(
                "loraplane_operator_controlplane_up",
                "1 when the operator's last control plane call got an answer",
                value=1 if up else 0,
            )


class OperatorMetrics:
    def __init__(self, standalone: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.leader = Gauge(
            "loraplane_operator_leader",
            "1 while this replica acts, 0 while kopf peering pauses it",
            registry=r,
        )
        self.leader.set(1 if standalone else 0)
        self.reconciles = Counter(
            "loraplane_operator_reconciles",
            "Reconcile passes by resource kind and outcome",
            ["kind", "outcome"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "loraplane_operator_reconcile_seconds",
            "Duration of one reconcile pass",
            ["kind"],
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        for kind in KINDS:  # born at 0: rate()/increase() see the first error
            self.reconcile_seconds.labels(kind)
            for outcome in OUTCOMES:
                self.reconciles.labels(kind, outcome)
        self._state = _State()
        r.register(self._state)

    # --- updates ---------------------------------------------------------------------------

    def adapter_phase(self, namespace: str, name: str, pool: str, phase: str) -> None:
        with self._state._lock:
            self._state.adapters[(namespace, name)] = (pool, phase)

    def forget_adapter(self, namespace: str, name: str) -> None:
        with self._state._lock:
            self._state.adapters.pop((namespace, name), None)

    def controlplane_reachable(self, up: bool) -> None:
        with self._state._lock:
            self._state.controlplane_up = up

    def instrument(self, kind: str, handler: F) -> F:
        """`handler` counted and timed as one reconcile pass of `kind` (its name and signature
        are kept, so kopf's handler ids, and the progress annotations keyed by them, do not
        change)."""

        @functools.wraps(handler)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            outcome = "permanent_error"
            try:
                result = handler(*args, **kwargs)
                outcome = "ok"
                return result
            except kopf.TemporaryError:
                outcome = "temporary_error"
                raise
            except kopf.PermanentError:
                raise
            except Exception:
                outcome = "temporary_error"  # kopf retries other exceptions (backoff)
                raise
            finally:
                self.reconciles.labels(kind, outcome).inc()
                self.reconcile_seconds.labels(kind).observe(time.perf_counter() - started)

        return wrapper  # type: ignore[return-value]

    def watch_peering(self) -> PeeringWatcher:
        """Follow kopf's pause/resume transitions (see the module docstring)."""
        watcher = PeeringWatcher(self.leader)
        logger = logging.getLogger(PEERING_LOGGER)
        logger.addHandler(watcher)
        # The INFO transitions must reach the handler whatever the root level is.
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        return watcher

    def serve(self, port: int, host: str = "0.0.0.0") -> Any:
        """Serve `GET /metrics` on a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class PeeringWatcher(logging.Handler):
    """Sets the leader gauge from kopf's peering log records."""

    PAUSING = ("Pausing operations", "Pausing all operators")
    RESUMING = ("Resuming operations",)

    def __init__(self, gauge: Gauge) -> None:
        super().__init__(level=logging.DEBUG)
        self.gauge = gauge

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if message.startswith(self.PAUSING):
            self.gauge.set(0)
        elif message.startswith(self.RESUMING):
            self.gauge.set(1)

    def detach(self) -> None:
        logging.getLogger(PEERING_LOGGER).removeHandler(self)
