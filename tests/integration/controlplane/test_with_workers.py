"""The control plane driving real `loraplane worker serve` processes (CPU, tiny model).

Acceptance of issue 6: fail-first partial failures leave nothing loaded anywhere; a worker
killed and restarted empty gets its adapters back while the registry never reports an adapter
loaded where the worker does not list it; a control plane killed mid-load settles the
operation at restart; routing, on-demand loads, LRU eviction and the pin limit.

Topologies: tp=1 dp=1 and tp=2 dp=2 (DP attention); a topology the worker cannot run yet is
skipped with the worker's own message.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from cp_kit import ADMIN, ControlPlane, PrivateRedis, WorkerProc, metric_value, wait_for
from fastapi.testclient import TestClient
from pydantic import SecretStr

from loraplane.controlplane.app import create_app
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.integration
TOPOLOGIES = [pytest.param((1, 1), id="tp1dp1"), pytest.param((2, 2), id="tp2dp2")]
ADAPTERS = ("a0", "a1", "a2", "a3", "a4", "stray")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, adapters dir): a tiny llama and rank-4 adapters written by our fixtures."""
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    root = tmp_path_factory.mktemp("cp-workers")
    model = make_model(
        root / "tiny-llama", "llama", seed=0, hidden_size=64, num_layers=2, vocab_size=512
    )
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        make_adapter(
            model,
            adapters / name,
            rank=4,
            alpha=8.0,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            seed=i,
        )
    return model, adapters


@pytest.fixture(scope="module", params=TOPOLOGIES)
def fleet(
    request: pytest.FixtureRequest,
    tiny: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[WorkerProc]]:
    """Two workers for the whole module; each test starts from empty workers."""
    tp, dp = request.param
    model, adapters = tiny
    tmp = tmp_path_factory.mktemp("worker-logs")
    workers = [
        WorkerProc(model, tmp, tp=tp, dp=dp, k=3, m=4, rank=16, roots=(adapters,)) for _ in range(2)
    ]
    try:
        for worker in workers:
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def workers(fleet: list[WorkerProc]) -> Iterator[list[WorkerProc]]:
    for worker in fleet:
        if worker.process is None or worker.process.poll() is not None:
            worker.start()
    yield fleet
    for worker in fleet:  # leave them empty, faults disarmed, for the next test
        if worker.process is None or worker.process.poll() is not None:
            worker.start()
        for op in ("load", "unload"):
            for group in range(worker.dp):
                worker.fault(op, group, "", count=0)
        for name in worker.models() or set():
            httpx.post(worker.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def pool_spec(model: Path, workers: list[WorkerProc], **change: Any) -> dict[str, Any]:
    w = workers[0]
    return {
        "model": str(model),
        "tp": w.tp,
        "dp": w.dp,
        "max_loras_per_batch": 3,
        "max_loaded_loras": 4,
        "max_lora_rank": 16,
        **change,
    }


@pytest.fixture
def cp(settings: Settings, tiny: tuple[Path, Path]) -> Iterator[TestClient]:
    settings.sources.allowed_roots = [tiny[1]]
    settings.router.on_demand_timeout_s = 60
    with TestClient(create_app(settings)) as client:
        yield client


def join(cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc], **pool: Any) -> None:
    assert (
        cp.put(
            "/v1/pools/default/tiny", json=pool_spec(tiny[0], workers, **pool), headers=ADMIN
        ).status_code
        == 200
    )
    for i, worker in enumerate(workers):
        body = {"name": f"w{i}", "pool": "tiny", "endpoint": worker.url, "dp_size": worker.dp}
        assert cp.post("/v1/workers", json=body, headers=ADMIN).status_code in (200, 201)
    for i in range(len(workers)):
        wait_for(
            lambda i=i: cp.get(f"/v1/workers/w{i}", headers=ADMIN).json()["state"] == "ready",
            timeout=30,
            what=f"w{i} ready",
        )


def register(cp: TestClient, tiny: tuple[Path, Path], name: str, **fields: Any) -> httpx.Response:
    body = {"name": name, "pool": "tiny", "source": {"uri": f"file://{tiny[1] / name}"}, **fields}
    return cp.post("/v1/adapters", json=body, headers=ADMIN)


def adapter(cp: TestClient, name: str) -> dict[str, Any]:
    body: dict[str, Any] = cp.get(f"/v1/adapters/default/{name}", headers=ADMIN).json()
    return body


def metric(cp: TestClient, name: str, **labels: str) -> float:
    for line in cp.get("/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    return 0.0


def test_partial_failure_on_one_dp_group_of_one_worker_loads_nothing_anywhere(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    last_group = workers[1].dp - 1
    workers[1].fault("load", last_group, f"group {last_group}: out of memory (injected)")
    failed = register(cp, tiny, "a0")
    assert failed.status_code == 502, failed.text
    op = failed.json()["operation"]
    assert op["state"] == "rolled_back" and op["targets"] == ["w0", "w1"]
    assert op["result"]["success"] is False
    assert op["result"]["error_message"] == f"group {last_group}: out of memory (injected)"
    assert [t["success"] for t in op["per_target"]] == [True, False]
    assert failed.json()["error"]["code"] == "fanout_failed"
    for worker in workers:
        assert "a0" not in (worker.models() or {"unreachable"})
    state = adapter(cp, "a0")
    assert state["routable"] is False and state["placements"] == [] and state["phase"] == "Failed"
    assert cp.get("/v1/placements", headers=ADMIN).json()["items"] == []

    # the same message from both workers is reported once
    for worker in workers:
        worker.fault("load", 0, "disk full (injected)")
    both = cp.post("/v1/adapters/default/a0/load", headers=ADMIN)
    assert both.status_code == 502
    assert both.json()["operation"]["result"]["error_message"] == "disk full (injected)"

    retry = cp.post("/v1/adapters/default/a0/load", headers=ADMIN)
    assert retry.status_code == 200, retry.text
    assert retry.json()["adapter"]["loaded_workers"] == ["w0", "w1"]
    assert all("a0" in (w.models() or set()) for w in workers)
    groups = {
        (p["worker"], p["dp_group"], p["state"]) for p in retry.json()["adapter"]["placements"]
    }
    assert groups == {(f"w{i}", g, "loaded") for i in range(2) for g in range(workers[0].dp)}


def test_failed_unload_is_inconsistent_until_the_reconciler_settles_it(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a1").status_code == 201
    workers[0].fault("unload", 0, "rank 0 busy (injected)", count=1000)  # the reconciler fails too
    failed = cp.post("/v1/adapters/default/a1/unload", headers=ADMIN)
    assert failed.status_code == 502, failed.text
    state = failed.json()["adapter"]
    assert (
        state["inconsistent"] is True
        and state["routable"] is False
        and state["phase"] == "Degraded"
    )
    again = register(cp, tiny, "a1")
    assert again.status_code == 409 and "not reusable" in again.json()["error"]["message"]
    routed = cp.post(
        "/v1/completions", json={"model": "a1", "prompt": "x", "max_tokens": 2}, headers=ADMIN
    )
    assert routed.status_code == 503
    time.sleep(1)  # several reconciler passes: still inconsistent while the worker refuses
    assert adapter(cp, "a1")["inconsistent"] is True
    workers[0].fault("unload", 0, "", count=0)
    wait_for(
        lambda: not adapter(cp, "a1")["inconsistent"],
        timeout=30,
        what="the reconciler to unload the leftover",
    )
    assert adapter(cp, "a1")["placements"] == [] and adapter(cp, "a1")["phase"] == "Unloaded"
    assert [w.models() for w in workers] == [set(), set()]


def test_a_failed_delete_can_be_sent_again(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a2").status_code == 201
    workers[1].fault("unload", 0, "rank 0 busy (injected)", count=1000)
    first = cp.delete("/v1/adapters/default/a2", headers=ADMIN)
    assert first.status_code == 502, first.text
    again = cp.delete("/v1/adapters/default/a2", headers=ADMIN)  # a new attempt, not a 409
    assert again.status_code == 502, again.text
    assert again.json()["operation"]["id"] != first.json()["operation"]["id"]
    workers[1].fault("unload", 0, "", count=0)
    wait_for(
        lambda: cp.get("/v1/adapters/default/a2", headers=ADMIN).status_code == 404,
        timeout=30,
        what="the delete to finish once the worker unloads",
    )
    assert [w.models() for w in workers] == [set(), set()]


def test_router_proxies_streams_and_counts(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a2").status_code == 201
    plain = cp.post(
        "/v1/completions",
        json={
            "model": "tiny:a2",
            "prompt": "The quick brown fox",
            "max_tokens": 4,
            "temperature": 0,
        },
        headers=ADMIN,
    )
    assert plain.status_code == 200, plain.text
    assert plain.json()["model"] == "tiny:a2" and plain.json()["usage"]["completion_tokens"] == 4
    direct = httpx.post(
        workers[0].url + "/v1/completions",
        json={"model": "a2", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0},
    ).json()
    assert plain.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    with cp.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "a2",
            "prompt": "The quick brown fox",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        },
        headers=ADMIN,
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["model"] for c in chunks} == {"a2"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain.json()["choices"][0]["text"]
    chat = cp.post(
        "/v1/chat/completions",
        json={"model": "tiny:a2", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        headers=ADMIN,
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    base = cp.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, headers=ADMIN
    )
    assert base.status_code == 200
    assert adapter(cp, "a2")["last_used_at"] is not None
    text = cp.get("/metrics").text
    assert (
        'loraplane_routed_requests_total{adapter="a2",code="200",namespace="default"} 3.0' in text
    )


def test_router_passes_log_probabilities_through(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """lm-eval's loglikelihood request (token ids, echo, logprobs, max_tokens 0) and chat
    logprobs, routed: the worker's answer, equal to PEFT's log_softmax on the same files
    (on every rank layout: the logprobs come from each DP group's leader, with its ids)."""
    from loraplane.worker.check.reference import load_peft, sequence_logprobs
    from loraplane.worker.engine.tokenizer import TextTokenizer

    join(cp, tiny, workers)
    assert register(cp, tiny, "a1").status_code == 201
    ids = TextTokenizer(str(tiny[0])).encode("Paris is the capital of France")
    body = {"model": "tiny:a1", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    routed = cp.post("/v1/completions", json=body, headers=ADMIN)
    assert routed.status_code == 200, routed.text
    scored = routed.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    ref = sequence_logprobs(load_peft(tiny[0], tiny[1] / "a1", "float32", "cpu"), ids, "cpu")
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert scored[1:] == pytest.approx(want, abs=1e-3)
    chat = cp.post(
        "/v1/chat/completions",
        json={"model": "tiny:a1", "max_tokens": 3, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers=ADMIN,
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == chat.json()["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    bad = cp.post("/v1/completions", json={**body, "logprobs": 21}, headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "logprobs", bad.text


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """Not a stream that just stops, which a client would take for a complete answer."""
    join(cp, tiny, workers)
    # on one worker, so the test kills the one serving the stream (and restarts only that one)
    assert register(cp, tiny, "a2", placement={"count": 1}).status_code == 201
    (serving,) = [w for w in workers if "a2" in (w.models() or set())]
    body = {
        "model": "a2",
        "prompt": "The quick brown fox",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with cp.stream("POST", "/v1/completions", json=body, headers=ADMIN) as response:
        assert response.status_code == 200
        lines = []
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not lines:  # the first token is out: the worker goes away
                serving.kill()
            lines.append(line)
    assert lines[-1] != "data: [DONE]"
    error = json.loads(lines[-1][6:])["error"]
    assert error["type"] == "upstream_error" and "stopped mid-stream" in error["message"]


def test_on_demand_loads_evict_the_least_recently_used_and_pins_are_limited(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers[:1])  # one worker: M=4 resident, K=3 slots, at most 2 pinned
    for name in ("a0", "a1", "a2", "a3", "a4"):
        assert register(cp, tiny, name, load=False, placement={"count": 1}).status_code == 201
    worker = workers[0]

    def route(name: str) -> None:
        response = cp.post(
            "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}, headers=ADMIN
        )
        assert response.status_code == 200, response.text

    for name in ("a0", "a1", "a2", "a3"):
        route(name)
        time.sleep(0.01)
    assert worker.models() == {"a0", "a1", "a2", "a3"}
    route("a1")  # a0 is now the least recently used
    route("a4")
    assert worker.models() == {"a1", "a2", "a3", "a4"}
    assert adapter(cp, "a0")["placements"] == [] and adapter(cp, "a4")["routable"] is True
    text = cp.get("/metrics").text
    assert metric_value(text, "loraplane_evictions_total") == 1.0
    assert metric_value(text, "loraplane_evictions_total", namespace="default", pool="tiny") == 1.0
    assert (
        metric_value(
            text,
            "loraplane_on_demand_loads_total",
            namespace="default",
            pool="tiny",
            outcome="succeeded",
        )
        == 5.0
    )

    for name in ("a2", "a3"):
        pinned = cp.patch(f"/v1/adapters/default/{name}", json={"pinned": True}, headers=ADMIN)
        assert pinned.status_code == 200, pinned.text
    too_many = cp.patch("/v1/adapters/default/a4", json={"pinned": True}, headers=ADMIN)
    assert too_many.status_code == 409 and too_many.json()["error"]["code"] == "too_many_pinned"
    assert (
        "worker 'w0' already has 2 pinned adapters (a2, a3)" in too_many.json()["error"]["message"]
    )
    assert adapter(cp, "a4")["pinned"] is False
    # an adapter loaded nowhere (a0, evicted) may not take the pin either: it would when it
    # loads on w0, the pool's only worker
    nowhere = cp.patch("/v1/adapters/default/a0", json={"pinned": True}, headers=ADMIN)
    assert nowhere.status_code == 409 and nowhere.json()["error"]["code"] == "too_many_pinned"
    assert adapter(cp, "a0")["pinned"] is False
    assert sorted(httpx.get(worker.url + "/lora_state").json()["pinned"]) == ["a2", "a3"]
    route("a0")  # evicts the LRU unpinned one (a1), never a pinned one
    assert worker.models() == {"a0", "a2", "a3", "a4"}


def test_evicting_an_adapter_the_worker_lost_already_frees_its_slot(
    settings: Settings, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """An adapter unloaded behind the registry's back (drift not repaired yet: the
    reconciler's passes 10 minutes apart, pokes aside) chosen as an eviction's victim: the
    worker's "not loaded" answer means the slot is free, so the load that wanted it goes
    ahead and the victim's placement is dropped (the load failed with the eviction's error,
    as the observability workload once met it)."""
    settings.reconciler.interval_s = 600
    settings.sources.allowed_roots = [tiny[1]]
    with TestClient(create_app(settings)) as cp:
        join(cp, tiny, workers[:1])  # one worker, M = 4
        for name in ("a0", "a1", "a2", "a3"):
            assert register(cp, tiny, name).status_code == 201, name
        worker = workers[0]
        gone = httpx.post(worker.url + "/unload_lora_adapter", json={"lora_name": "a0"}, timeout=30)
        assert gone.status_code == 200, gone.text
        loaded = register(cp, tiny, "a4")  # the least recently used, a0, is the victim
        assert loaded.status_code == 201, loaded.text
        assert worker.models() == {"a1", "a2", "a3", "a4"}
        assert adapter(cp, "a0")["placements"] == []
        assert adapter(cp, "a4")["routable"] is True


def test_a_load_that_fails_on_a_full_worker_evicts_nothing(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """The worker evicts the planned victim only once it has read the new adapter: a load
    that fails there (a file it cannot read, here an injected read failure on one DP group)
    leaves the least recently used adapter loaded and routable, its placements loaded."""
    join(cp, tiny, workers[:1])  # one worker, M = 4
    for name in ("a0", "a1", "a2", "a3"):
        assert register(cp, tiny, name).status_code == 201, name
    worker = workers[0]
    worker.fault("load", worker.dp - 1, "unreadable weights (injected)")
    failed = register(cp, tiny, "a4")  # a0, the least recently used, is the planned victim
    assert failed.status_code == 502, failed.text
    assert failed.json()["operation"]["state"] == "rolled_back"
    assert worker.models() == {"a0", "a1", "a2", "a3"}
    kept = adapter(cp, "a0")
    assert kept["routable"] is True
    assert {(p["dp_group"], p["state"]) for p in kept["placements"]} == {
        (g, "loaded") for g in range(worker.dp)
    }
    body = {"model": "a0", "prompt": "hi", "max_tokens": 1}
    assert cp.post("/v1/completions", json=body, headers=ADMIN).status_code == 200
    assert metric(cp, "loraplane_evictions_total") == 0.0

    loaded = cp.post("/v1/adapters/default/a4/load", headers=ADMIN)  # now a1 goes
    assert loaded.status_code == 200, loaded.text
    assert worker.models() == {"a0", "a2", "a3", "a4"}
    assert adapter(cp, "a1")["placements"] == []
    assert metric(cp, "loraplane_evictions_total", namespace="default", pool="tiny") == 1.0


def test_a_load_rolled_back_after_it_evicted_on_one_worker_gives_the_victim_back(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """Two full workers: the new adapter loads on w0, which evicts the least recently used
    one there, and fails on w1; the rollback unloads it from w0 and loads the victim there
    again, so both workers hold what they held before and the victim stays routable on both."""
    join(cp, tiny, workers)  # two workers, M = 4 each
    for name in ("a0", "a1", "a2", "a3"):
        assert register(cp, tiny, name).status_code == 201, name
    before = {(p["worker"], p["dp_group"], p["state"]) for p in adapter(cp, "a0")["placements"]}
    assert {w for w, _, _ in before} == {"w0", "w1"}
    workers[1].fault("load", workers[1].dp - 1, "unreadable weights (injected)")
    failed = register(cp, tiny, "a4")  # a0, the least recently used, is the planned victim
    assert failed.status_code == 502, failed.text
    op = failed.json()["operation"]
    assert op["state"] == "rolled_back" and [t["success"] for t in op["per_target"]] == [
        True,
        False,
    ]
    for worker in workers:
        assert worker.models() == {"a0", "a1", "a2", "a3"}, worker
    kept = adapter(cp, "a0")
    assert kept["routable"] is True
    assert {(p["worker"], p["dp_group"], p["state"]) for p in kept["placements"]} == before
    body = {"model": "a0", "prompt": "hi", "max_tokens": 1}
    for _ in range(4):  # (either worker may serve it)
        assert cp.post("/v1/completions", json=body, headers=ADMIN).status_code == 200


def test_a_request_that_stops_waiting_for_a_cold_start_leaves_the_load_running(
    cp: TestClient, settings: Settings, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """The client gets 503 on_demand_timeout; the load goes on and is counted once, as a
    load (succeeded), and the request once, as a request the router answered itself."""
    join(cp, tiny, workers[:1])
    assert register(cp, tiny, "a0", load=False, placement={"count": 1}).status_code == 201
    settings.router.on_demand_timeout_s = 0.001  # read per request
    body = {"model": "a0", "prompt": "hi", "max_tokens": 1}
    late = cp.post("/v1/completions", json=body, headers=ADMIN)
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "on_demand_timeout"
    assert "the load continues, retry later" in late.json()["error"]["message"]
    wait_for(lambda: adapter(cp, "a0")["routable"] is True, 60, what="the load went on")
    settings.router.on_demand_timeout_s = 60
    assert cp.post("/v1/completions", json=body, headers=ADMIN).status_code == 200
    text = cp.get("/metrics").text
    loads = "loraplane_on_demand_loads_total"
    assert metric_value(text, loads, namespace="default", pool="tiny", outcome="succeeded") == 1
    assert 'outcome="timeout"' not in text
    assert metric_value(text, "loraplane_router_rejected_total", code="on_demand_timeout") == 1


def test_restarted_worker_gets_its_adapters_back_and_the_registry_never_lies(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    for name in ("a0", "a1"):
        assert register(cp, tiny, name).status_code == 201
    violations: list[str] = []
    samples = [0]
    stop = threading.Event()
    by_name = {f"w{i}": w for i, w in enumerate(workers)}

    def sample() -> None:
        while not stop.is_set():
            claimed = cp.get("/v1/placements", params={"state": "loaded"}, headers=ADMIN).json()[
                "items"
            ]
            for name, worker in by_name.items():
                listed = worker.models()
                if listed is None:
                    continue
                samples[0] += 1
                for p in claimed:
                    if p["worker"] == name and p["lora_name"] not in listed:
                        violations.append(
                            f"registry: {p['lora_name']} loaded on {name}; /v1/models: {sorted(listed)}"
                        )
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        workers[0].kill()
        wait_for(
            lambda: adapter(cp, "a0")["loaded_workers"] == ["w1"],
            timeout=30,
            what="w0 marked unreachable",
        )
        assert adapter(cp, "a0")["phase"] == "Degraded"
        assert {p["state"] for p in adapter(cp, "a0")["placements"] if p["worker"] == "w0"} == {
            "unreachable"
        }
        workers[0].start()  # same endpoint, empty
        wait_for(
            lambda: (
                adapter(cp, "a0")["loaded_workers"] == ["w0", "w1"]
                and adapter(cp, "a1")["loaded_workers"] == ["w0", "w1"]
            ),
            timeout=60,
            what="w0 restored",
        )
        assert {"a0", "a1"} <= (workers[0].models() or set())
        # a stray adapter loaded behind the registry's back is unloaded
        stray = httpx.post(
            workers[1].url + "/load_lora_adapter",
            json={"lora_name": "stray", "lora_path": str(tiny[1] / "stray"), "pinned": False},
        )
        assert stray.json()["success"] is True
        wait_for(
            lambda: "stray" not in (workers[1].models() or {"stray"}),
            timeout=30,
            what="stray unloaded",
        )
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert violations == []
    assert samples[0] > 20
    assert metric(cp, "loraplane_drift_repaired_total", kind="restored") >= 2
    assert metric(cp, "loraplane_drift_repaired_total", kind="stray_unloaded") >= 1


def test_control_plane_killed_mid_load_completes_or_rolls_back(
    db_url: str, tmp_path: Path, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    worker = workers[0]
    first = ControlPlane(db_url, tiny[1], tmp_path)
    first.start()
    try:
        http = httpx.Client(base_url=first.url, headers=ADMIN, timeout=60)
        assert (
            http.put("/v1/pools/default/tiny", json=pool_spec(tiny[0], workers)).status_code == 200
        )
        joined = http.post(
            "/v1/workers",
            json={"name": "w0", "pool": "tiny", "endpoint": worker.url, "dp_size": worker.dp},
        )
        assert joined.status_code == 201, joined.text
        wait_for(lambda: http.get("/v1/workers/w0").json()["state"] == "ready", timeout=30)
        assert worker.process is not None
        worker.process.send_signal(signal.SIGSTOP)  # the load will hang in the worker
        try:

            def post() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(
                        first.url + "/v1/adapters",
                        headers=ADMIN,
                        timeout=120,
                        json={
                            "name": "a3",
                            "pool": "tiny",
                            "source": {"uri": f"file://{tiny[1] / 'a3'}"},
                        },
                    )

            threading.Thread(target=post, daemon=True).start()
            wait_for(
                lambda: (
                    [o["state"] for o in http.get("/v1/operations").json()["items"]] == ["running"]
                ),
                timeout=30,
                what="the load to be running",
            )
            first.kill()
        finally:
            worker.process.send_signal(signal.SIGCONT)
    finally:
        first.stop()  # killed above; stopped here if the test failed before
    second = ControlPlane(db_url, tiny[1], tmp_path)
    second.start()
    try:
        http = httpx.Client(base_url=second.url, headers=ADMIN, timeout=60)
        wait_for(
            lambda: (
                http.get("/v1/operations").json()["items"][0]["state"]
                in ("succeeded", "rolled_back", "failed")
            ),
            timeout=30,
            what="the restarted control plane to settle the interrupted load",
        )
        op = http.get("/v1/operations").json()["items"][0]

        def agree() -> bool:
            state = http.get("/v1/adapters/default/a3").json()
            listed = worker.models() or set()
            return (state["routable"] and "a3" in listed) or (
                not state["routable"] and not state["inconsistent"] and "a3" not in listed
            )

        wait_for(agree, timeout=60, what="registry and worker to agree about a3")
        if op["state"] == "succeeded":
            assert http.get("/v1/adapters/default/a3").json()["loaded_workers"] == ["w0"]
    finally:
        second.stop()


def test_routing_keeps_working_while_redis_is_down(
    settings: Settings, tiny: tuple[Path, Path], workers: list[WorkerProc], tmp_path: Path
) -> None:
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    settings.redis_url = redis_server.url
    settings.sources.allowed_roots = [tiny[1]]
    try:
        with TestClient(create_app(settings)) as cp:
            join(cp, tiny, workers)
            assert register(cp, tiny, "a4").status_code == 201
            redis_server.stop()
            wait_for(lambda: cp.get("/readyz").json()["redis"] == "down", what="redis down")
            routed = cp.post(
                "/v1/completions",
                json={"model": "a4", "prompt": "hi", "max_tokens": 2},
                headers=ADMIN,
            )
            assert routed.status_code == 200, routed.text
            assert cp.post("/v1/adapters/default/a4/unload", headers=ADMIN).status_code == 200
            assert [w.models() for w in workers] == [set(), set()]
            redis_server.start()
            wait_for(
                lambda: cp.get("/readyz").json()["redis"] == "ok", timeout=15, what="redis back"
            )
    finally:
        redis_server.stop()


def test_new_version_is_loaded_before_the_old_one_goes(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a0").status_code == 201
    prompt = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    before = cp.post("/v1/completions", json={"model": "a0", **prompt}, headers=ADMIN).json()
    updated = cp.post(
        "/v1/adapters/default/a0/version",
        json={"source": {"uri": f"file://{tiny[1] / 'a1'}"}},
        headers=ADMIN,
    )
    assert updated.status_code == 200, updated.text
    state = updated.json()["adapter"]
    assert state["version"] == 2 and state["lora_name"] == "a0_v2"
    assert state["loaded_workers"] == ["w0", "w1"]
    assert {p["lora_name"] for p in state["placements"]} == {"a0_v2"}
    for worker in workers:
        assert worker.models() == {"a0_v2"}
    after = cp.post("/v1/completions", json={"model": "a0", **prompt}, headers=ADMIN).json()
    reference = httpx.post(
        workers[0].url + "/v1/completions", json={"model": "a0_v2", **prompt}, timeout=60
    ).json()
    assert after["choices"][0]["text"] == reference["choices"][0]["text"]
    assert after["model"] == "a0" and before["model"] == "a0"


def test_a_pinned_adapter_on_a_full_worker_gets_a_new_version(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """The new version needs room beside the old one, and both pinned at once would pass the
    K - 1 pin limit: the least recently used unpinned adapter makes room, the new version takes
    the pin once the old one is gone."""
    join(cp, tiny, workers[:1])  # M=4 resident, K=3 slots, at most 2 pinned
    for name in ("a0", "a1"):
        assert register(cp, tiny, name, pinned=True).status_code == 201
    for name in ("a2", "a3"):
        assert register(cp, tiny, name).status_code == 201
    worker = workers[0]
    assert worker.models() == {"a0", "a1", "a2", "a3"}
    updated = cp.post(
        "/v1/adapters/default/a0/version",
        json={"source": {"uri": f"file://{tiny[1] / 'a4'}"}},
        headers=ADMIN,
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["adapter"]["lora_name"] == "a0_v2"
    assert updated.json()["adapter"]["pinned"] is True
    held = worker.models() or set()
    assert "a0_v2" in held and "a0" not in held and "a1" in held and len(held) == 3
    assert sorted(httpx.get(worker.url + "/lora_state").json()["pinned"]) == ["a0_v2", "a1"]
    text = cp.get("/metrics").text
    assert metric_value(text, "loraplane_evictions_total", namespace="default", pool="tiny") == 1.0


def test_a_pool_change_its_adapters_contradict_is_refused_by_field(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """New limits that what is registered breaks are refused (409 naming the field and the
    adapters or workers in the way), and the pool keeps its spec."""
    join(cp, tiny, workers[:1])  # K=3: at most 2 pinned
    for name in ("a0", "a1"):
        assert register(cp, tiny, name, pinned=True).status_code == 201
    a0 = adapter(cp, "a0")
    before = cp.get("/v1/pools/default/tiny", headers=ADMIN).json()
    narrower = [m for m in a0["target_modules"][1:]] or ["gate_proj"]
    cases = [
        ({"model": "/models/another-base"}, "body.model", "conflict", "default/a0"),
        ({"max_lora_rank": a0["rank"] - 1}, "body.max_lora_rank", "conflict", "default/a0 (r="),
        ({"target_modules": narrower}, "body.target_modules", "conflict", "default/a0 (["),
        (
            {"max_loaded_loras": 1, "max_loras_per_batch": 1},
            "body.max_loaded_loras",
            "conflict",
            "w0 (2)",
        ),
        ({"max_loras_per_batch": 2}, "body.max_loras_per_batch", "too_many_pinned", "w0 (2"),
    ]
    for change, field, code, named in cases:
        spec = {**pool_spec(tiny[0], workers[:1]), **change}
        answer = cp.put("/v1/pools/default/tiny", json=spec, headers=ADMIN)
        assert answer.status_code == 409, (change, answer.text)
        error = answer.json()["error"]
        assert (error["field"], error["code"]) == (field, code), error
        assert named in error["message"], error
    assert cp.get("/v1/pools/default/tiny", headers=ADMIN).json() == before
    # the same spec again (the operator's every resync) is no change and passes
    same = cp.put("/v1/pools/default/tiny", json=pool_spec(tiny[0], workers[:1]), headers=ADMIN)
    assert same.status_code == 200, same.text
    # unpinned, the smaller K fits
    assert cp.patch("/v1/adapters/default/a1", json={"pinned": False}, headers=ADMIN).is_success
    spec = pool_spec(tiny[0], workers[:1], max_loras_per_batch=2)
    assert cp.put("/v1/pools/default/tiny", json=spec, headers=ADMIN).status_code == 200


def test_an_eviction_in_flight_is_not_undone_by_the_reconciler(
    cp: TestClient, db_url: str, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    """An operation making room unloads its victim and then drops the victim's rows; a
    reconciler pass in between must not load the victim back (the load the room was made
    for would find the worker full: a flake of the test above, seen once in CI). Here the
    eviction is held at that point: the victim's rows "unloading", unloaded from the worker,
    an operation in flight on another adapter of the pool. Once no operation runs, the rows
    are a leftover and the victim is placed again."""
    join(cp, tiny, workers[:1])
    for name in ("a0", "a2"):
        assert register(cp, tiny, name).status_code == 201
    worker = workers[0]
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE placements SET state = 'unloading' WHERE lora_name = 'a2'")
            )
            conn.execute(
                sa.text("UPDATE adapters SET busy_operation_id = 'op_held' WHERE name = 'a0'")
            )
        unloaded = httpx.post(
            worker.url + "/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30
        )
        assert unloaded.status_code == 200, unloaded.text
        passes = metric(cp, "loraplane_reconcile_passes_total", outcome="ok")
        wait_for(
            lambda: metric(cp, "loraplane_reconcile_passes_total", outcome="ok") >= passes + 3,
            timeout=30,
            what="three reconciler passes",
        )
        assert worker.models() == {"a0"}, "the reconciler loaded the evicted adapter back"
        assert {p["state"] for p in adapter(cp, "a2")["placements"]} == {"unloading"}
        # The operation ends without dropping the rows (as if it had died before its load):
        # with nothing running, a2 is placed there as before, so it is loaded back.
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE adapters SET busy_operation_id = NULL WHERE name = 'a0'"))
        wait_for(
            lambda: {p["state"] for p in adapter(cp, "a2")["placements"]} == {"loaded"},
            timeout=30,
            what="the reconciler to place the leftover victim again",
        )
        assert worker.models() == {"a0", "a2"}
    finally:
        engine.dispose()


def test_a_pin_that_failed_half_way_is_evened_out_by_the_reconciler(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a3").status_code == 201
    workers[1].fault("load", 0, "out of memory (injected)")  # w1's pinned reload fails once
    failed = cp.patch("/v1/adapters/default/a3", json={"pinned": True}, headers=ADMIN)
    assert failed.status_code == 502, failed.text
    assert adapter(cp, "a3")["pinned"] is False
    # w0 took the pin before w1 failed; the registry says unpinned, so the reconciler evens it out
    wait_for(
        lambda: httpx.get(workers[0].url + "/lora_state").json()["pinned"] == [],
        timeout=30,
        what="w0's pin flag to follow the registry",
    )
    assert all(w.models() == {"a3"} for w in workers)  # never unloaded on the way
    assert metric(cp, "loraplane_drift_repaired_total", kind="repinned") >= 1


def test_a_smaller_placement_count_unloads_the_extra_copies(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a1").status_code == 201  # placement: all -> both workers
    assert adapter(cp, "a1")["loaded_workers"] == ["w0", "w1"]
    shrunk = cp.post(
        "/v1/adapters/default/a1/load", json={"placement": {"count": 1}}, headers=ADMIN
    )
    assert shrunk.status_code == 200, shrunk.text
    state = adapter(cp, "a1")
    assert len(state["loaded_workers"]) == 1 and state["routable"] is True
    assert {p["worker"] for p in state["placements"]} == set(state["loaded_workers"])
    assert sorted(len(w.models() or set()) for w in workers) == [0, 1]


def test_namespaced_adapters_route_only_with_their_tokens(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers[:1])
    cp.put("/v1/pools/team-a/tiny", json=pool_spec(tiny[0], workers), headers=ADMIN)
    body = {
        "name": "w-team-a",
        "namespace": "team-a",
        "pool": "tiny",
        "endpoint": workers[1].url,
        "dp_size": workers[1].dp,
    }
    assert cp.post("/v1/workers", json=body, headers=ADMIN).status_code == 201
    wait_for(
        lambda: cp.get("/v1/workers/w-team-a", headers=ADMIN).json()["state"] == "ready", timeout=30
    )
    created = cp.post(
        "/v1/adapters",
        headers=ADMIN,
        json={
            "namespace": "team-a",
            "name": "sql",
            "pool": "tiny",
            "source": {"uri": f"file://{tiny[1] / 'a2'}"},
        },
    )
    assert created.status_code == 201, created.text
    assert created.json()["adapter"]["lora_name"] == "team-a.sql"
    assert workers[1].models() == {"team-a.sql"}
    tokens = {}
    for namespace in ("team-a", "default"):
        response = cp.post(
            "/v1/tokens",
            headers=ADMIN,
            json={"name": namespace, "scopes": ["route"], "namespace": namespace},
        )
        tokens[namespace] = {"Authorization": f"Bearer {response.json()['token']}"}
    ok = cp.post(
        "/v1/completions",
        headers=tokens["team-a"],
        json={"model": "tiny:sql", "prompt": "hi", "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["model"] == "tiny:sql"
    hidden = cp.post(
        "/v1/completions",
        headers=tokens["default"],
        json={"model": "tiny:sql", "prompt": "hi", "max_tokens": 2},
    )
    assert hidden.status_code == 404
    assert "adapter 'sql' not found in namespace 'default'" in hidden.json()["error"]["message"]


def test_router_refuses_non_finite_numbers_by_name_and_releases_the_worker(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers)
    assert register(cp, tiny, "a1").status_code == 201
    bodies = {
        "body.temperature": '{"model": "tiny:a1", "prompt": "hi", "temperature": NaN}',
        "body.top_p": '{"model": "tiny:a1", "prompt": "hi", "top_p": Infinity}',
        "body.max_tokens": '{"model": "tiny:a1", "prompt": "hi", "max_tokens": 1e400}',
    }
    for path in ("/v1/completions", "/v1/chat/completions"):
        for field, body in bodies.items():
            r = cp.post(
                path,
                content=body.encode(),
                headers={**ADMIN, "content-type": "application/json"},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["field"] == field, r.text
    good = cp.post(
        "/v1/completions", json={"model": "tiny:a1", "prompt": "hi", "max_tokens": 2}, headers=ADMIN
    )
    assert good.status_code == 200, good.text
    listed = cp.get("/v1/workers", headers=ADMIN).json()["items"]
    assert {w["name"]: w["inflight"] for w in listed} == {"w0": 0, "w1": 0}


class EventStream:
    """The events a token receives from /v1/events, read on a thread."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.events: list[dict[str, Any]] = []
        self.client = httpx.Client(base_url=url, headers=headers, timeout=None)
        self.subscribed = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.subscribed.wait(30), "no ': subscribed' line from /v1/events"

    def _read(self) -> None:
        with (
            contextlib.suppress(httpx.HTTPError, RuntimeError),
            self.client.stream("GET", "/v1/events") as response,
        ):
            for line in response.iter_lines():
                if line.startswith(": subscribed"):
                    self.subscribed.set()
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))

    def types(self, namespace: str) -> set[str]:
        return {e["type"] for e in list(self.events) if e.get("namespace") == namespace}

    def close(self) -> None:
        self.client.close()
        self.thread.join(10)


EVENT_TYPES = (
    "worker.registered",
    "worker.ready",
    "adapter.loaded",
    "adapter.failed",
    "adapter.evicted",
    "adapter.unloaded",
    "operation.finished",
    "placement.drift_repaired",
)


def test_events_carry_their_namespace_and_reach_only_its_readers(
    db_url: str, tiny: tuple[Path, Path], workers: list[WorkerProc], tmp_path: Path
) -> None:
    plane = ControlPlane(db_url, tiny[1], tmp_path)
    plane.env["LORAPLANE_RECONCILER__INTERVAL_S"] = "0.3"
    plane.start()
    streams: list[EventStream] = []
    try:
        api = httpx.Client(base_url=plane.url, headers=ADMIN, timeout=120)
        created = api.post(
            "/v1/tokens", json={"name": "reader-a", "scopes": ["read"], "namespace": "team-a"}
        )
        assert created.status_code == 201, created.text
        streams.append(
            EventStream(plane.url, {"Authorization": f"Bearer {created.json()['token']}"})
        )
        streams.append(EventStream(plane.url, ADMIN))
        team_a, everyone = streams
        for namespace, worker in (("default", workers[0]), ("team-a", workers[1])):
            pool = api.put(f"/v1/pools/{namespace}/tiny", json=pool_spec(tiny[0], workers))
            assert pool.status_code == 200, pool.text
            body = {
                "name": f"w-{namespace}",
                "namespace": namespace,
                "pool": "tiny",
                "endpoint": worker.url,
                "dp_size": worker.dp,
            }
            assert api.post("/v1/workers", json=body).status_code == 201
        for name in ("w-default", "w-team-a"):
            wait_for(
                lambda n=name: api.get(f"/v1/workers/{n}").json()["state"] == "ready",
                timeout=30,
                what=f"{name} ready",
            )

        def register_in(namespace: str, name: str) -> httpx.Response:
            uri = f"file://{tiny[1] / name}"
            body = {"namespace": namespace, "name": name, "pool": "tiny", "source": {"uri": uri}}
            return api.post("/v1/adapters", json=body)

        workers[0].fault("load", 0, "injected for the events test")
        assert register_in("default", "a0").status_code >= 400  # adapter.failed
        for name in ("a1", "a2", "a3", "a4"):
            assert register_in("default", name).status_code == 201
        loaded = api.post("/v1/adapters/default/a0/load", json={})  # a fifth: adapter.evicted
        assert loaded.status_code == 200, loaded.text
        for name in ("a1", "a2"):  # room on the worker for a stray
            assert api.post(f"/v1/adapters/default/{name}/unload", json={}).status_code == 200
        stray = {"lora_name": "stray", "lora_path": str(tiny[1] / "stray")}
        assert httpx.post(workers[0].url + "/load_lora_adapter", json=stray).status_code == 200
        assert register_in("team-a", "a2").status_code == 201
        wait_for(
            lambda: set(EVENT_TYPES) <= everyone.types("default"),
            timeout=30,
            what=f"every event type in default (so far {everyone.types('default')})",
        )
        wait_for(
            lambda: "adapter.loaded" in team_a.types("team-a"), timeout=30, what="team-a's load"
        )
        api.close()
    finally:
        for stream in streams:  # an open stream would hold the server's shutdown
            stream.close()
        plane.stop()
    for kind in EVENT_TYPES:
        seen = [e for e in everyone.events if e["type"] == kind]
        assert all(e.get("namespace") in ("default", "team-a") for e in seen), (kind, seen)
    leaked = [e for e in team_a.events if e.get("namespace") != "team-a"]
    assert leaked == [], leaked


def test_a_worker_closed_by_a_token_is_driven_with_the_configured_token(
    settings: Settings, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text("worker-secret")
    worker = WorkerProc(tiny[0], tmp_path, roots=(tiny[1],))
    worker.args += ["--admin-token-file", str(token_file)]
    worker.start()
    try:
        stranger = httpx.post(
            worker.url + "/load_lora_adapter",
            json={"lora_name": "a3", "lora_path": str(tiny[1] / "a3")},
        )
        assert stranger.status_code == 401, stranger.text
        settings.sources.allowed_roots = [tiny[1]]
        settings.workers.admin_token = SecretStr("worker-secret")
        with TestClient(create_app(settings)) as cp:
            join(cp, tiny, [worker])
            assert register(cp, tiny, "a3").status_code == 201
            assert adapter(cp, "a3")["routable"] is True
            routed = cp.post(
                "/v1/completions",
                json={"model": "tiny:a3", "prompt": "hi", "max_tokens": 2},
                headers=ADMIN,
            )
            assert routed.status_code == 200, routed.text
    finally:
        worker.stop()


def test_an_explicit_adapter_an_operator_unloaded_stays_unloaded(
    cp: TestClient, tiny: tuple[Path, Path], workers: list[WorkerProc]
) -> None:
    join(cp, tiny, workers[:1])
    assert register(cp, tiny, "a3", load_policy="Explicit").status_code == 201
    assert adapter(cp, "a3")["load_policy"] == "Explicit"
    assert cp.post("/v1/adapters/default/a3/unload", json={}, headers=ADMIN).status_code == 200
    body = {"model": "tiny:a3", "prompt": "hi", "max_tokens": 1}
    refused = cp.post("/v1/completions", json=body, headers=ADMIN)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_not_loaded" and error["field"] == "body.model"
    assert "default/a3" in error["message"] and "Explicit" in error["message"]
    assert workers[0].models() == set() and adapter(cp, "a3")["placements"] == []
    # the policy is the adapter's own: switched to OnDemand, routing loads it again
    patched = cp.patch("/v1/adapters/default/a3", json={"load_policy": "OnDemand"}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["adapter"]["load_policy"] == "OnDemand"
    assert cp.post("/v1/completions", json=body, headers=ADMIN).status_code == 200
    assert workers[0].models() == {"a3"}
