"""The router's per-request path against a real control plane process and a stub upstream
(``bench/router_bench.py``): inflight counts on every way out of a request, the route table
never routing to a placement that is gone, and streams that keep flowing while the database
is slow."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from cp_kit import ControlPlane, wait_for
from router_kit import (
    ADMIN,
    DelayProxy,
    Stub,
    inflight,
    routed_control_plane,
    router_bench,
    wait_for_value,
    write_adapter,
)

pytestmark = pytest.mark.integration

DELAY_S = 0.2
PASSES_OK = 'loraplane_reconcile_passes_total{outcome="ok"}'
STREAM = {"model": "bench:a0", "prompt": "hi", "max_tokens": 4, "stream": True}


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[Stub]:
    stub = Stub(tmp_path, tokens=40, gap_ms=50)
    yield stub
    stub.stop()


def raw_request(port: int, body: bytes) -> socket.socket:
    """Send a routed request on a raw socket (to hang up on it at will)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
        + f"Authorization: {ADMIN['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_a_client_that_leaves_is_no_longer_counted_and_its_worker_request_ends(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """Before the worker answered (the worker's request is closed, so it stops generating for
    nobody) and mid-stream: either way the worker's inflight count comes back to 0."""
    cp = routed_control_plane(db_url, tmp_path, stub)
    try:
        waiting = raw_request(cp.port, b'{"model": "bench:a0", "stream": true, "stub_delay_s": 60}')
        wait_for_value(lambda: stub.stats()["open"], 1, "the stub holding the request")
        assert inflight(cp) == 1
        waiting.close()
        wait_for_value(lambda: stub.stats()["abandoned"], 1, "the stub's request to end")
        assert stub.stats()["open"] == 0
        wait_for_value(lambda: inflight(cp), 0, "w0's inflight count")

        flowing = raw_request(cp.port, b'{"model": "bench:a0", "stream": true}')
        assert b"data: {" in flowing.recv(65536) or b"data: {" in flowing.recv(65536)
        assert inflight(cp) == 1
        flowing.close()
        wait_for_value(lambda: inflight(cp), 0, "w0's inflight count after a mid-stream hang-up")
        wait_for_value(lambda: stub.stats()["open"], 0, "the stub's stream to end")
        served = httpx.post(cp.url + "/v1/completions", json=STREAM, headers=ADMIN, timeout=30)
        assert served.status_code == 200 and "data: [DONE]" in served.text
        assert inflight(cp) == 0
    finally:
        cp.stop()


def test_worker_errors_reach_the_client_and_the_worker_is_released(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """A worker's 500 is passed on, streamed or not; a worker that drops the connection
    mid-stream ends the stream with an error event. None stays counted on the worker."""
    cp = routed_control_plane(db_url, tmp_path, stub)
    try:
        for stream in (False, True):
            body = {**STREAM, "stream": stream, "stub_status": 500}
            failed = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN)
            assert failed.status_code == 500, failed.text
            assert failed.json()["error"]["message"] == "stub answers 500"
        body = {**STREAM, "stub_cut_after": 2}
        cut = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN, timeout=30)
        assert cut.status_code == 200
        events = [line[6:] for line in cut.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 3 and "data: [DONE]" not in cut.text
        assert json.loads(events[-1])["error"]["type"] == "upstream_error"
        assert inflight(cp) == 0
    finally:
        cp.stop()


def test_an_unloaded_adapter_is_never_routed_from_memory(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """Routed once (so the route table holds it), then unloaded: the next request is refused
    by the registry (Explicit: it is not loaded by routing) without reaching the worker."""
    cp = routed_control_plane(db_url, tmp_path, stub, explicit=True)
    try:
        body = {**STREAM, "stream": False}
        assert httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN).status_code == 200
        unloaded = httpx.post(cp.url + "/v1/adapters/default/a0/unload", headers=ADMIN, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        refused = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "adapter_not_loaded"
        assert stub.stats()["completions"] == 1  # the worker was never asked for it again
    finally:
        cp.stop()


def test_a_worker_that_lost_the_adapter_sends_the_request_back_through_the_registry(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """The worker restarted without the adapter while the route table still says it holds it:
    the worker's 404 never reaches the client. The placement is marked lost and the request
    placed again from the database (an on-demand load, while the reconciler, poked, repairs
    the same adapter): the request waits for the load and is served, and the adapter is back
    on the worker."""
    cp = routed_control_plane(db_url, tmp_path, stub)
    try:
        body = {**STREAM, "stream": False}
        assert httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN).status_code == 200
        stub.unload("a0")
        again = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN, timeout=60)
        assert again.status_code == 200, again.text
        wait_for_value(
            lambda: [m["id"] for m in httpx.get(stub.url + "/v1/models").json()["data"]][1:],
            ["a0"],
            "a0 loaded on the worker again",
        )
        served = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN, timeout=60)
        assert served.status_code == 200, served.text
        assert inflight(cp) == 0
    finally:
        cp.stop()


def reconcile_passes(cp: ControlPlane) -> float:
    """The control plane's completed reconcile passes (its metrics)."""
    metrics = httpx.get(cp.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith(PASSES_OK))
    return float(line.rsplit(" ", 1)[1])


def routable(cp: ControlPlane, model: str) -> bool:
    models = httpx.get(cp.url + "/v1/models", headers=ADMIN).json()["data"]
    return bool(next(m for m in models if m["id"] == model)["routable"])


def test_a_repair_from_a_look_older_than_an_on_demand_load_leaves_the_load_alone(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """The race between the router's on-demand reload and the reconciler's repair of the same
    adapter, made deterministic by holding the stub's answers: the worker lost ``a0``; the
    request that finds out pokes the reconciler, which asks the worker what it holds (the
    answer, "no a0", is held back), and loads ``a0`` on demand (held too, then let through:
    the request is served). Only then does the reconciler get its answer, older than the
    load. It must not take it for the truth: loading ``a0`` again would make it unroutable
    until that load ended (a request meanwhile got 503 no_worker)."""
    cp = routed_control_plane(db_url, tmp_path, stub)
    try:
        body = {**STREAM, "stream": False}
        assert httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN).status_code == 200
        stub.unload("a0")
        loads, passes = stub.stats()["loads"], reconcile_passes(cp)
        stub.hold("models", "loads")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(
                httpx.post, cp.url + "/v1/completions", json=body, headers=ADMIN, timeout=60
            )
            wait_for_value(
                lambda: stub.stats()["held"],
                {"models": 1, "loads": 1, "unloads": 0},
                "the reconciler's look and the on-demand load, both held",
            )
            stub.release("loads")
            served = request.result()
        assert served.status_code == 200, served.text
        stub.hold("loads")  # a load from the reconciler now would wait here
        stub.release("models")
        wait_for(
            lambda: reconcile_passes(cp) > passes or stub.stats()["held"]["loads"],
            what="the reconciler's pass to end (or to load a0 again)",
        )
        assert routable(cp, "bench:a0"), "a0 is not routable after the reconciler's pass"
        assert stub.stats()["loads"] == loads + 1  # the on-demand load, nothing since
        assert stub.stats()["held"]["loads"] == 0
        again = httpx.post(cp.url + "/v1/completions", json=body, headers=ADMIN, timeout=60)
        assert again.status_code == 200, again.text
    finally:
        stub.release("models", "loads")
        cp.stop()


def test_a_stray_unloaded_while_an_operation_loads_it_is_restored(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """The worker holds ``a1``, which the registry places nowhere: a stray. The reconciler
    unloads it (the unload held at the stub) while ``a1`` is registered and loaded there,
    so the unload lands after that load. The registry keeps the operation's placement, and
    the next pass sees the worker without ``a1`` and loads it back."""
    cp = routed_control_plane(db_url, tmp_path, stub)
    try:
        worker = {"name": "w0", "pool": "bench", "endpoint": stub.url, "dp_size": 1}
        stub.load("a1")
        stub.hold("unloads")
        assert httpx.post(cp.url + "/v1/workers", json=worker, headers=ADMIN).status_code == 200
        wait_for_value(
            lambda: stub.stats()["held"]["unloads"], 1, "the reconciler unloading the stray"
        )
        a1 = write_adapter((tmp_path / "adapters").resolve() / "a1")
        body = {"name": "a1", "pool": "bench", "source": {"uri": f"file://{a1}"}}
        registered = httpx.post(cp.url + "/v1/adapters", json=body, headers=ADMIN, timeout=60)
        assert registered.status_code == 201, registered.text
        passes = reconcile_passes(cp)
        stub.release("unloads")
        wait_for(lambda: reconcile_passes(cp) > passes, what="the reconciler's pass to end")
        assert stub.models() == ["a0"]  # the stray's unload landed after the load
        assert httpx.post(cp.url + "/v1/workers", json=worker, headers=ADMIN).status_code == 200
        wait_for_value(stub.models, ["a0", "a1"], "a1 loaded back on the worker")
        wait_for(lambda: routable(cp, "bench:a1"), what="a1 routable")
    finally:
        stub.release("unloads")
        cp.stop()


@contextlib.contextmanager
def behind_a_slow_database(
    db_url: str, tmp_path: Path, stub: Stub
) -> Iterator[tuple[ControlPlane, DelayProxy]]:
    """A routed control plane (``routed_control_plane``) whose database is behind a
    ``DelayProxy`` (no delay until the caller sets one), without reconciler and lease passes
    (their periods beyond a test's length)."""
    url = sa.engine.make_url(db_url)
    proxy = DelayProxy(url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    cp = routed_control_plane(
        proxied,
        tmp_path,
        stub,
        LORAPLANE_RECONCILER__INTERVAL_S="3600",
        LORAPLANE_OPERATIONS__LEASE_S="3600",
    )
    try:
        yield cp, proxy
    finally:
        proxy.delay_s = 0.0
        cp.stop()
        proxy.stop()


def gaps_while_requests_arrive(cp_port: int, streams: int, stagger_s: float) -> list[float]:
    """Open ``streams`` streams ``stagger_s`` apart (each new request resolves its route and
    records its use while the others flow); the gaps between tokens of all of them."""
    model = "bench:a0"

    async def run() -> list[float]:
        sides = [router_bench.Side() for _ in range(streams)]

        async def one(index: int) -> None:
            await asyncio.sleep(index * stagger_s)
            connection = router_bench.Connection(f"http://127.0.0.1:{cp_port}")
            try:
                await router_bench.one_stream(connection, model, sides[index])
            finally:
                connection.close()

        await asyncio.gather(*(one(i) for i in range(streams)))
        errors = [e for side in sides for e in side.errors]
        assert not errors, errors
        return [gap for side in sides for gap in side.gaps]

    return asyncio.run(run())


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[94]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_streams_keep_their_pace_while_every_database_round_trip_takes_200ms(
    db_url: str, tmp_path: Path, stub: Stub
) -> None:
    """The control plane's database behind a proxy that adds 200 ms to every round trip. New
    requests keep arriving (route lookups, last-use bookkeeping) while streams flow: a single
    round trip on the event loop would stall every stream by the delay. Compared with the same
    run without the delay, the gaps' p95 grows by less than half the delay. (The p95, not the
    p99: on a shared machine one pause of the process, whatever its cause, delays every stream
    at once, 8 of the 312 gaps; a stall per request would delay far more.)

    The reconciler and the lease passes are kept out (their periods beyond the test's length):
    the stub worker answers no /lora_state, which the reconciler would take for a lost
    worker."""
    with behind_a_slow_database(db_url, tmp_path, stub) as (cp, proxy):
        baseline = gaps_while_requests_arrive(cp.port, streams=8, stagger_s=0.25)
        proxy.delay_s = DELAY_S
        delayed = gaps_while_requests_arrive(cp.port, streams=8, stagger_s=0.25)
    assert len(delayed) == len(baseline) == 8 * 39
    assert p95(delayed) < p95(baseline) + DELAY_S / 2, (
        f"gap p95 {p95(delayed) * 1000:.1f} ms with the database delayed 200 ms, "
        f"{p95(baseline) * 1000:.1f} ms without"
    )


def gaps_while_operations_run(
    cp_port: int, streams: int, stagger_s: float
) -> tuple[list[float], int]:
    """Streams of ``a0`` on ``streams`` kept-alive connections, ``stagger_s`` apart, each one
    after another until adapter ``a1`` has been loaded and unloaded again (two journalled
    operations, run by the control plane while the streams flow); the gaps between tokens of
    all of them, and the number of streams."""
    url = f"http://127.0.0.1:{cp_port}"

    async def run() -> tuple[list[float], int]:
        sides = [router_bench.Side() for _ in range(streams)]
        operations_done = asyncio.Event()

        async def flow(index: int) -> None:
            await asyncio.sleep(index * stagger_s)
            connection = router_bench.Connection(url)
            try:
                while not (operations_done.is_set() and sides[index].requests):
                    await router_bench.one_stream(connection, "bench:a0", sides[index])
                    assert not sides[index].errors, sides[index].errors
            finally:
                connection.close()

        async def operate() -> None:
            await asyncio.sleep(stagger_s)  # the first stream flows
            async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=120) as client:
                for step in ("load", "unload"):
                    done = await client.post(f"/v1/adapters/default/a1/{step}")
                    assert done.status_code == 200, done.text
            operations_done.set()

        await asyncio.gather(operate(), *(flow(i) for i in range(streams)))
        return [gap for side in sides for gap in side.gaps], sum(s.requests for s in sides)

    return asyncio.run(run())


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_streams_keep_their_pace_while_an_adapter_loads_and_unloads_against_a_slow_database(
    db_url: str, tmp_path: Path
) -> None:
    """The database 200 ms away per round trip, as above; while streams of ``a0`` flow, a
    second adapter is loaded onto their worker and unloaded again. Each operation writes its
    journal, its placements (loading, loaded, unloading, gone) and its outcome between the
    worker calls of its fan-out: one of those transactions on the event loop would stall every
    flowing stream by a few round trips. Compared with the same run without the delay, the
    gaps' p95 grows by less than half the delay.

    Tokens come 400 ms apart: a stall shows as one long gap per stream however long it lasts,
    so the gaps are few enough for the stalls of two operations to pass the p95."""
    stub = Stub(tmp_path, tokens=12, gap_ms=400)
    try:
        with behind_a_slow_database(db_url, tmp_path, stub) as (cp, proxy):
            a1 = write_adapter((tmp_path / "adapters").resolve() / "a1")
            body = {"name": "a1", "pool": "bench", "source": {"uri": f"file://{a1}"}, "load": False}
            registered = httpx.post(cp.url + "/v1/adapters", json=body, headers=ADMIN, timeout=60)
            assert registered.status_code == 201, registered.text
            baseline, _ = gaps_while_operations_run(cp.port, streams=8, stagger_s=0.25)
            proxy.delay_s = DELAY_S
            delayed, served = gaps_while_operations_run(cp.port, streams=8, stagger_s=0.25)
            models = stub.models()
    finally:
        stub.stop()
    assert models == ["a0"]  # a1 came and went
    assert len(baseline) >= 8 * 11 and len(delayed) >= 8 * 11
    assert p95(delayed) < p95(baseline) + DELAY_S / 2, (
        f"gap p95 {p95(delayed) * 1000:.1f} ms with the database delayed 200 ms while a1 "
        f"loaded and unloaded ({served} streams), {p95(baseline) * 1000:.1f} ms without"
    )


def test_the_router_bench_reports_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    """`loraplane bench router` at a small size: both sides' figures, the added latency, the
    router's CPU per stream, no errors (no timing is asserted)."""
    argv = ["--concurrency", "4", "--tokens", "4", "--gap-ms", "20", "--phase-s", "0.5"]
    assert router_bench.main([*argv, "--rounds", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 0 and report["requests"] > 0
    for side in ("direct", "routed"):
        assert report[side]["requests"] > 0
        assert report[side]["gap_ms"]["samples"] == 3 * report[side]["requests"]
    assert set(report["added"]) == {"ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"}
    assert report["router_cpu"]["streams"] >= report["routed"]["requests"]
