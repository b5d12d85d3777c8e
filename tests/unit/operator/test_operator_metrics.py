"""The operator's Prometheus metrics, without a cluster: kopf's own peering code drives the leader
gauge, the handlers' status writes drive the adapter gauge, the control plane client drives
`controlplane_up`, and instrumented handlers count and time their passes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import urllib.request
from typing import Any

import httpx
import kopf
import pytest
from kopf._cogs.aiokits.aiotoggles import Toggle
from kopf._core.engines.peering import Identity, process_peering_event
from prometheus_client.parser import text_string_to_metric_families

from loraplane.operator import handlers
from loraplane.operator.config import OperatorConfig, newest_first_priority
from loraplane.operator.cpclient import (
    ControlPlaneClient,
    ControlPlaneError,
    ControlPlaneUnavailable,
)
from loraplane.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.unit


def samples(metrics: OperatorMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render())
        for s in family.samples
        if s.name == name
    }


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics, name).get(tuple(sorted(labels.items())))


# ------------------------------------------------------------------ leader (kopf peering)


def peering_event(peers: dict[str, int]) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    return {
        "type": "MODIFIED",
        "object": {
            "metadata": {"name": "loraplane"},
            "status": {
                opid: {"priority": prio, "lifetime": 60, "lastseen": now}
                for opid, prio in peers.items()
            },
        },
    }


async def feed(conflicts: Toggle, peers: dict[str, int], priority: int = 10) -> None:
    settings = kopf.OperatorSettings()
    settings.peering.name = "loraplane"
    settings.peering.priority = priority
    woken = asyncio.Event()
    woken.set()  # do not sleep until other peers expire (that would PATCH the peering object)
    await process_peering_event(
        raw_event=peering_event(peers),  # type: ignore[arg-type]
        namespace=None,
        resource=None,  # type: ignore[arg-type]  # only used to clean up or touch
        identity=Identity("me"),
        settings=settings,
        autoclean=False,
        stream_pressure=woken,
        conflicts_found=conflicts,
    )


def test_leader_follows_kopf_peering_pause_and_resume() -> None:
    metrics = OperatorMetrics(standalone=False)
    watcher = metrics.watch_peering()
    try:

        async def scenario() -> list[float | None]:
            seen = [value(metrics, "loraplane_operator_leader")]
            conflicts = Toggle(True)  # mandatory peering: paused until the first peering event
            await feed(conflicts, {"me": 10, "low": 5})  # highest priority: kopf resumes
            assert conflicts.is_off()
            seen.append(value(metrics, "loraplane_operator_leader"))
            await feed(conflicts, {"me": 10, "high": 20})  # a higher priority peer: kopf pauses
            assert conflicts.is_on()
            seen.append(value(metrics, "loraplane_operator_leader"))
            await feed(conflicts, {"me": 10})  # it is gone: resume
            seen.append(value(metrics, "loraplane_operator_leader"))
            await feed(conflicts, {"me": 10, "twin": 10})  # same priority: kopf pauses everyone
            seen.append(value(metrics, "loraplane_operator_leader"))
            return seen

        assert asyncio.run(scenario()) == [0.0, 1.0, 0.0, 1.0, 0.0]
    finally:
        watcher.detach()


def test_a_restarted_operator_does_not_wait_for_its_killed_predecessor() -> None:
    # kopf's own peering code: the killed process's record is still alive (not expired), and
    # the restarted process (a later start, so a higher default priority) acts at once; the
    # older replica of two pauses in favour of the newer one.
    killed = newest_first_priority(now_ns=1_000_000_000_000)
    restarted = newest_first_priority(now_ns=1_000_000_000_000 + 2_000_000_000)
    assert restarted > killed

    async def scenario() -> tuple[bool, bool]:
        new = Toggle(True)  # mandatory peering: paused until the first peering event
        await feed(new, {"me": restarted, "killed": killed}, priority=restarted)
        old = Toggle(False)
        await feed(old, {"me": killed, "newer": restarted}, priority=killed)
        return new.is_on(), old.is_on()

    assert asyncio.run(scenario()) == (False, True)


def test_standalone_operator_always_leads() -> None:
    assert value(OperatorMetrics(standalone=True), "loraplane_operator_leader") == 1.0


# ------------------------------------------------------------------ reconcile passes


def test_instrumented_handlers_count_outcomes_and_keep_their_identity() -> None:
    metrics = OperatorMetrics()
    # Every kind x outcome exists at 0 before anything happens.
    counts = samples(metrics, "loraplane_operator_reconciles_total")
    assert len(counts) == 6 and set(counts.values()) == {0.0}

    def reconcile_pool(fail: type[Exception] | None = None, **_: Any) -> str:
        if fail is not None:
            raise fail("boom")
        return "done"

    wrapped = metrics.instrument("lorapool", reconcile_pool)
    assert wrapped.__name__ == "reconcile_pool"
    assert wrapped.__qualname__ == reconcile_pool.__qualname__  # kopf's handler id
    assert wrapped(memo=None) == "done"
    for exc in (kopf.TemporaryError, kopf.PermanentError, RuntimeError):
        with pytest.raises(exc):
            wrapped(fail=exc)

    def count(outcome: str) -> float | None:
        return value(
            metrics, "loraplane_operator_reconciles_total", kind="lorapool", outcome=outcome
        )

    assert (count("ok"), count("temporary_error"), count("permanent_error")) == (1, 2, 1)
    assert value(metrics, "loraplane_operator_reconcile_seconds_count", kind="lorapool") == 4
    assert value(metrics, "loraplane_operator_reconcile_seconds_count", kind="loraadapter") == 0


# ------------------------------------------------------------------ adapter phases


class FakeKube:
    def __init__(self, pools: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.pools = pools

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pools.get((namespace, name))

    def list_adapters(self, namespace: str) -> list[dict[str, Any]]:
        return []


class FakeControlPlane:
    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        raise ControlPlaneUnavailable("connection refused")


def run_reconcile(
    metrics: OperatorMetrics, kube: FakeKube, name: str, pool: str, old_phase: str
) -> kopf.Patch:
    runtime = handlers.Runtime(OperatorConfig(), kube, FakeControlPlane())  # type: ignore[arg-type]
    memo = kopf.Memo(runtime=runtime, metrics=metrics)
    spec = {"pool": pool, "source": {"uri": "file:///a"}}
    status = {"phase": old_phase, "observedGeneration": 1}
    body = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1},
        "spec": spec,
        "status": status,
    }
    patch = kopf.Patch()
    kwargs = dict(
        name=name,
        namespace="ml",
        uid=f"uid-{name}",
        spec=kopf.Spec(kopf.Body(body)),
        status=kopf.Status(kopf.Body(body)),
        meta=kopf.Meta(kopf.Body(body)),
        body=kopf.Body(body),
        patch=patch,
        memo=memo,
        logger=None,
    )
    handler = metrics.instrument("loraadapter", handlers.reconcile_adapter)
    with contextlib.suppress(kopf.TemporaryError):
        handler(**kwargs)
    return patch


def test_adapter_gauge_follows_the_phase_the_handler_writes() -> None:
    metrics = OperatorMetrics()
    kube = FakeKube({("ml", "p"): {"spec": {"maxLorasPerBatch": 4}}})
    # No such pool: Pending. The pool exists but the control plane is down: Unknown, the
    # handler fails temporarily, and controlplane_up is not known (this fake is no client).
    # (Old phases equal to the new ones: no Event is posted, which needs a running operator.)
    patch = run_reconcile(metrics, kube, "a", "missing", "Pending")
    assert patch["status"]["phase"] == "Pending"
    patch = run_reconcile(metrics, kube, "b", "p", "Unknown")
    assert patch["status"]["phase"] == "Unknown"
    gauge = samples(metrics, "loraplane_operator_adapters")
    assert gauge[(("namespace", "ml"), ("phase", "Pending"), ("pool", "missing"))] == 1
    assert gauge[(("namespace", "ml"), ("phase", "Unknown"), ("pool", "p"))] == 1
    assert gauge[(("namespace", "ml"), ("phase", "Ready"), ("pool", "p"))] == 0
    assert (
        value(
            metrics,
            "loraplane_operator_reconciles_total",
            kind="loraadapter",
            outcome="temporary_error",
        )
        == 1
    )
    assert value(metrics, "loraplane_operator_reconciles_total", kind="loraadapter", outcome="ok")

    # Status builders' phases land in the gauge; a deleted adapter leaves it.
    handlers.record_adapter_phase(metrics, "ml", "b", {"pool": "p"}, "Ready")
    handlers.record_adapter_phase(metrics, "ml", "c", {"pool": "p"}, "Ready")
    assert (
        value(metrics, "loraplane_operator_adapters", namespace="ml", pool="p", phase="Ready") == 2
    )
    metrics.forget_adapter("ml", "b")
    metrics.forget_adapter("ml", "c")
    metrics.forget_adapter("ml", "a")
    assert samples(metrics, "loraplane_operator_adapters") == {}


# ------------------------------------------------------------------ control plane reachability


def client(metrics: OperatorMetrics, handler: Any) -> ControlPlaneClient:
    return ControlPlaneClient(
        lambda: "http://cp",
        "t",
        transport=httpx.MockTransport(handler),
        on_reachable=metrics.controlplane_reachable,
    )


def test_controlplane_up_follows_the_client_calls() -> None:
    metrics = OperatorMetrics()
    assert value(metrics, "loraplane_operator_controlplane_up") is None  # unknown: absent

    def ok(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"items": []})

    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def overloaded(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"code": "unavailable", "message": "db"}})

    client(metrics, ok).list_workers("ml", "p")
    assert value(metrics, "loraplane_operator_controlplane_up") == 1
    with pytest.raises(ControlPlaneUnavailable):
        client(metrics, down).list_workers("ml", "p")
    assert value(metrics, "loraplane_operator_controlplane_up") == 0
    with pytest.raises(ControlPlaneError):  # an error answer is still an answer
        client(metrics, not_found).put_pool("ml", "p", {}, key="k")
    assert value(metrics, "loraplane_operator_controlplane_up") == 1
    with pytest.raises(ControlPlaneUnavailable):
        client(metrics, overloaded).list_workers("ml", "p")
    assert value(metrics, "loraplane_operator_controlplane_up") == 0


# ------------------------------------------------------------------ the HTTP endpoint


def test_metrics_endpoint_serves_prometheus_text() -> None:
    metrics = OperatorMetrics(standalone=True)
    server, thread = metrics.serve(0, "127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert "loraplane_operator_leader 1.0" in text
        assert 'loraplane_operator_reconciles_total{kind="lorapool",outcome="ok"} 0.0' in text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
