"""A real Prometheus (Debian binary, 1 s scrapes, deploy/prometheus/rules.yaml loaded) scrapes a
real control plane and two real workers under a short mixed workload. Every PromQL expression of
deploy/grafana/loraplane.json and of the rules must parse and return data; an alert expression
returns data once the test creates its condition (load failures, a dead worker, a dead operator
target), and otherwise the series it compares must exist. The operator does not run here (it
needs a Kubernetes API; its metrics are unit-tested): queries of its metrics
(obskit.OPERATOR_METRICS) must parse and be empty. The metrics docs/metrics.md once listed as
proposed (obskit.NEW_METRICS: per-pool labels, placements, reconcile passes, slot loads, worker
info) must have series."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from obskit import (
    ADMIN,
    NEW_METRICS,
    OPERATOR_METRICS,
    Expression,
    Proc,
    PromAPI,
    dashboard_expressions,
    free_port,
    rule_expressions,
    signal,
    some_positive,
    start_controlplane,
    start_prometheus,
    start_worker,
    uses_operator_metrics,
    variable_queries,
    wait_for,
)
from tests.procs import redis_of_this_process

pytestmark = pytest.mark.integration

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
K, M = 2, 3  # GPU slots and resident adapters per worker: small, so evictions happen
RATE_WINDOW = "10m"  # covers the whole test, as $__rate_interval would on a dashboard of it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    redis_url = os.environ.get("LORAPLANE_TEST_REDIS_URL")
    if not redis_url:
        pytest.fail(
            "LORAPLANE_TEST_REDIS_URL is not set: the integration tier needs the real Redis; run "
            '`eval "$(scripts/services.sh start)"` or `make test-integration`',
            pytrace=False,
        )
    redis_url = redis_of_this_process(redis_url)
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    tmp = tmp_path_factory.mktemp("observability")
    model = make_model(
        tmp / "tiny-llama", "llama", seed=0, hidden_size=64, num_layers=2, vocab_size=512
    )
    adapters = tmp / "adapters"
    names = ["a1", "a2", "a3", "a4", "od1", "od2", "f1", "f2", "f3", "f4", "e1"]
    for seed, name in enumerate(names):
        make_adapter(model, adapters / name, rank=4, alpha=8.0, targets=TARGETS, seed=seed + 1)

    started: list[Proc] = []
    try:
        cp = start_controlplane(tmp, f"sqlite:///{tmp / 'cp.db'}", redis_url, adapters)
        started.append(cp)
        workers = {n: start_worker(n, model, tmp, adapters, k=K, m=M) for n in ("w0", "w1")}
        started += workers.values()
        cp.wait_healthy("/readyz", 120)
        for w in workers.values():
            w.wait_healthy("/health", 180)
        prom = start_prometheus(
            tmp,
            cp.url.removeprefix("http://"),
            {n: w.url.removeprefix("http://") for n, w in workers.items()},
            f"127.0.0.1:{free_port()}",
        )
        started.append(prom)
        api = PromAPI(prom.url)
        # The workload's counters must be seen before and after it: wait for a first scrape.
        wait_for(
            lambda: len(api.vector('up{job=~"loraplane-controlplane|loraplane-worker"} == 1')) == 3,
            30,
            "Prometheus to scrape the control plane and both workers",
        )
        yield {
            "cp": cp,
            "workers": workers,
            "prom": PromAPI(prom.url),
            "adapters": adapters,
            "model": model,
            "prom_proc": prom,
        }
    finally:
        for proc in reversed(started):
            proc.stop()


def completion(
    client: httpx.Client, model: str, prompt: str, headers: dict[str, str] | None = None
) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        headers=headers or {},
    )
    assert r.status_code == 200, r.text


def register(cp: Proc, adapters: Path, name: str, *, load: bool = True) -> httpx.Response:
    response: httpx.Response = cp.client.post(
        "/v1/adapters",
        headers=ADMIN,
        json={
            "name": name,
            "pool": "tiny",
            "source": {"uri": f"file://{adapters / name}"},
            "load": load,
        },
    )
    return response


@pytest.fixture(scope="module")
def workload(stack: dict[str, Any]) -> dict[str, Any]:
    cp, workers, adapters, prom = stack["cp"], stack["workers"], stack["adapters"], stack["prom"]
    http = cp.client
    pool = {
        "model": str(stack["model"]),
        "tp": 1,
        "dp": 1,
        "max_loras_per_batch": K,
        "max_loaded_loras": M,
        "max_lora_rank": 16,
    }
    assert http.put("/v1/pools/default/tiny", headers=ADMIN, json=pool).status_code == 200, "pool"
    for name, w in workers.items():
        r = http.post(
            "/v1/workers",
            headers=ADMIN,
            json={"name": name, "pool": "tiny", "endpoint": w.url, "dp_size": 1},
        )
        assert r.status_code in (200, 201), r.text
    wait_for(
        lambda: all(
            http.get(f"/v1/workers/{n}", headers=ADMIN).json()["state"] == "ready" for n in workers
        ),
        30,
        "both workers ready",
    )

    # Loads everywhere, then mixed traffic through the router and straight to each worker;
    # three adapters over two GPU slots make workers evict from their slots.
    for name in ("a1", "a2", "a3"):
        r = register(cp, adapters, name)
        assert r.status_code == 201, r.text
    jobs: list[tuple[httpx.Client, str, dict[str, str] | None]] = []
    for _ in range(4):
        for name in ("a1", "a2", "a3"):
            jobs.append((http, f"tiny:{name}", ADMIN))
            for w in workers.values():
                jobs.append((w.client, f"tiny-llama:{name}", None))
        jobs.append((http, "tiny", ADMIN))
        jobs.append((workers["w0"].client, "tiny-llama", None))
    with ThreadPoolExecutor(6) as pool_:
        list(pool_.map(lambda j: completion(j[0], j[1], f"hello {j[1]}", j[2]), jobs))
    # A prompt of several KV pages sent twice to one worker's base model (whose series no
    # unload removes): the second takes the first one's cached pages (the prefix-cache panels).
    shared = " ".join(f"word{i}" for i in range(48))
    for _ in range(2):
        completion(workers["w0"].client, "tiny-llama", shared)
    # A routed-requests series is born at its first request, and the whole wave above can fit
    # in one scrape, leaving rate() nothing to see: one more request once a scrape has seen it.
    wait_for(
        lambda: prom.has_data('loraplane_routed_requests_total{adapter="a1"}'),
        15,
        "the routed requests scraped",
    )
    completion(http, "tiny:a1", "hello again", ADMIN)
    # The same for the prefix-cache hits: one more once a scrape of w0 has seen the first hit
    # (the base series is born at w0's first miss, and w1 has one too: neither tells).
    wait_for(
        lambda: prom.has_data(
            'loraplane_worker_prefix_cached_tokens_total{adapter="none",worker="w0"} > 0'
        ),
        15,
        "w0's prefix-cache hit scraped",
    )
    completion(workers["w0"].client, "tiny-llama", shared)
    # The workers' per-adapter series are born at each adapter's load, and a fast wave can
    # load and serve within one scrape; the dashboard's adapter list needs them scraped.
    wait_for(
        lambda: all(
            prom.has_data(f'loraplane_worker_requests_total{{adapter="{name}"}}')
            for name in ("a1", "a2", "a3")
        ),
        15,
        "the workers' per-adapter series scraped",
    )
    # One the router refuses before any worker (no such adapter): router_rejected_total.
    unknown = http.post(
        "/v1/completions", json={"model": "tiny:nope", "prompt": "x"}, headers=ADMIN
    )
    assert unknown.status_code == 404, unknown.text

    # A fourth adapter on workers that hold M already: the control plane evicts the LRU one.
    assert register(cp, adapters, "a4").status_code == 201
    # Cold starts: registered only, loaded on demand by the router's first request for each.
    # Two, a scrape apart: a labelled counter is born at its first increment, which rate() cannot
    # see (docs/metrics.md asks components to pre-initialise their label values).
    for name in ("od1", "od2"):
        assert register(cp, adapters, name, load=False).status_code == 201
    completion(http, "tiny:od1", "cold start", ADMIN)
    wait_for(
        lambda: prom.has_data("loraplane_on_demand_loads_total"), 15, "the first cold start scraped"
    )
    completion(http, "tiny:od2", "cold start", ADMIN)

    # Load failures: every load on w0 fails while the fault is armed (the reconciler may load
    # something in between, so no fixed count); each load then is rolled back on w1.
    def arm_w0(count: int) -> None:
        r = workers["w0"].client.post(
            "/debug/fault",
            json={
                "op": "load",
                "dp_group": 0,
                "count": count,
                "message": "injected by the observability test",
            },
        )
        assert r.status_code == 200, r.text

    arm_w0(1000)
    try:
        for name in ("f1", "f2", "f3", "f4"):
            r = register(cp, adapters, name)
            assert r.status_code == 502, r.text
            assert r.json()["operation"]["state"] == "rolled_back", r.json()["operation"]
    finally:
        arm_w0(0)  # disarm

    # Drift: unload an adapter behind the control plane's back; the reconciler restores it.
    loaded = {
        m["id"] for m in workers["w1"].client.get("/v1/models").json()["data"] if m.get("parent")
    }
    victim = sorted(loaded)[0]
    r = workers["w1"].client.post("/unload_lora_adapter", json={"lora_name": victim})
    assert r.status_code == 200 and r.json()["success"], r.text
    wait_for(
        lambda: prom.has_data("loraplane_drift_repaired_total > 0"),
        30,
        "the reconciler to repair drift",
    )
    # Everything above has been scraped once Prometheus sees the latest routed request.
    wait_for(
        lambda: (
            prom.has_data('loraplane_routed_requests_total{adapter="od2"}')
            and prom.has_data('sum(loraplane_operations_total{outcome="rolled_back"}) >= 4')
        ),
        30,
        "the scrapes",
    )

    # Slot evictions that rate() sees. The wave's evictions may all fall inside one scrape of
    # counters born at the adapters' loads, and the adapters evicted then have been unloaded
    # since (a4 and the cold starts took their places: their series are gone). So each worker
    # now serves its resident adapters one after another: three residents over two slots
    # evict, on counters that have been scraped and stay.
    def resident(w: Any) -> list[str]:
        return sorted(m["id"] for m in w.client.get("/v1/models").json()["data"] if m.get("parent"))

    # A worker may hold fewer than M now: a load rolled back above may have evicted an adapter
    # to make room on w1 that nothing brings back (not drift: the registry agrees). One more
    # adapter, loaded everywhere, fills every worker to M (LRU evictions where full).
    assert register(cp, adapters, "e1").status_code == 201
    wait_for(  # (the drift repair may still be loading its adapter back)
        lambda: all(len(resident(w)) > K for w in workers.values()),
        30,
        f"more than {K} adapters resident on every worker",
    )

    def evict_then_look() -> bool:
        # A round that evicts only counters born within the last scrape (an adapter the
        # drift repair just loaded back) shows no increase yet: the next round evicts again.
        for name, w in workers.items():
            adapters_here = resident(w)
            for adapter in [*adapters_here, adapters_here[0]]:
                completion(w.client, f"tiny-llama:{adapter}", f"evict on {name}")
        return bool(
            prom.has_data(
                "count(sum by (worker) (increase(loraplane_worker_adapter_evictions_total[10m]))"
                " > 0) == 2"
            )
        )

    wait_for(evict_then_look, 60, "slot evictions on both workers scraped", interval=2.0)
    time.sleep(2)
    return stack


def check_returns_data(prom: PromAPI, item: Expression, problems: list[str]) -> None:
    body = prom.query(item.expr)
    if body["status"] != "success":
        problems.append(
            f"{item.where}: does not parse/evaluate: {body.get('error')}\n    {item.expr}"
        )
        return
    result = body["data"]["result"]
    if uses_operator_metrics(item.expr):
        if result:
            problems.append(
                f"{item.where}: returns data, but no operator ({OPERATOR_METRICS}) runs here"
            )
        return
    if not result:
        problems.append(f"{item.where}: returns no data\n    {item.expr}")
    elif any(
        f in item.expr for f in ("rate(", "increase(", "histogram_quantile(")
    ) and not some_positive(result):
        problems.append(
            f"{item.where}: only zero/NaN values after the workload: {result}\n    {item.expr}"
        )


def test_every_dashboard_query_returns_data(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    problems: list[str] = []
    expressions = dashboard_expressions(RATE_WINDOW)
    assert len(expressions) >= 30
    for item in expressions:
        check_returns_data(prom, item, problems)
    assert not problems, "\n".join(problems)


def test_formerly_proposed_metrics_are_emitted(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    missing = [expr for expr in NEW_METRICS if not prom.has_data(expr)]
    assert not missing, missing


def test_dashboard_variables_list_the_pool_and_adapters(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    queries = variable_queries()
    expected = {"namespace": {"default"}, "pool": {"tiny"}, "adapter": {"a1", "a2", "a3", "none"}}
    for name, query in queries.items():
        # Grafana's label_values(metric{selector}, label) is /api/v1/label/<label>/values?match[]=...
        inner = query.removeprefix("label_values(").removesuffix(")")
        selector, label = (s.strip() for s in inner.rsplit(",", 1))
        selector = selector.replace("$namespace", ".*").replace("$pool", ".*")
        body = prom.http.get(f"/api/v1/label/{label}/values", params={"match[]": selector}).json()
        assert body["status"] == "success", body
        assert expected[name] <= set(body["data"]), (name, body["data"])


def test_prometheus_evaluates_every_rule_without_error(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    rules = prom.rules()
    assert {r["name"] for r in rules} == {
        e.where.removeprefix("rule: ") for e in rule_expressions()
    }
    wait_for(
        lambda: all(
            r.get("lastEvaluation", "").startswith("20") and r["health"] == "ok"
            for r in prom.rules()
        ),
        10,
        "every rule evaluated",
    )
    bad = [
        (r["name"], r["health"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"
    ]
    assert not bad, bad


def test_every_alert_reads_series_that_exist(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    problems: list[str] = []
    for item in rule_expressions():
        check_returns_data(
            prom, Expression(item.where + " (without its threshold)", signal(item.expr)), problems
        )
    assert not problems, "\n".join(problems)


def test_alerts_fire_on_the_conditions_the_test_creates(workload: dict[str, Any]) -> None:
    prom: PromAPI = workload["prom"]
    exprs = {e.where.removeprefix("rule: "): e.expr for e in rule_expressions()}
    # Four rolled-back loads in 15 minutes: fires at once (no `for`).
    assert prom.has_data(exprs["LoRAPlaneAdapterLoadFailures"])
    wait_for(
        lambda: "firing" in prom.alert_states().get("LoRAPlaneAdapterLoadFailures", set()),
        15,
        "LoRAPlaneAdapterLoadFailures to fire",
    )
    # The rolled-back adapters are Failed: the alert is pending (it needs 15 minutes to fire).
    assert prom.has_data(exprs["LoRAPlaneAdapterDegradedOrFailed"])
    wait_for(
        lambda: "pending" in prom.alert_states().get("LoRAPlaneAdapterDegradedOrFailed", set()),
        15,
        "LoRAPlaneAdapterDegradedOrFailed pending",
    )
    # No operator runs here; its scrape target answers nothing.
    assert prom.has_data(exprs["LoRAPlaneOperatorDown"])

    # A worker dies: Prometheus and the control plane's probes both notice.
    workload["workers"]["w1"].stop()
    wait_for(lambda: prom.has_data(exprs["LoRAPlaneWorkerUnreachable"]), 20, "up == 0 for w1")
    assert [s["metric"]["worker"] for s in prom.vector(exprs["LoRAPlaneWorkerUnreachable"])] == [
        "w1"
    ]
    wait_for(
        lambda: prom.has_data(exprs["LoRAPlaneRegisteredWorkerUnreachable"]),
        30,
        "the control plane to report w1 unreachable",
    )
    wait_for(
        lambda: (
            {"LoRAPlaneWorkerUnreachable", "LoRAPlaneRegisteredWorkerUnreachable"}
            <= {a for a, s in prom.alert_states().items() if "pending" in s}
        ),
        15,
        "worker alerts pending",
    )
