"""A control plane killed (SIGKILL) in the middle of a journalled load settles it when it starts
again: the operation ends rolled back or failed, never pending, and no placement is reported
loaded. The control plane runs as a real `loraplane controlplane serve` process.

The target here is a TCP listener that accepts and never answers (a hung worker), so the load
is guaranteed to be in flight when the process dies; the same scenario against real workers is
in test_with_workers.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from cp_kit import ADMIN, POOL, ControlPlane, HungWorker, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def hung_worker() -> Iterator[HungWorker]:
    worker = HungWorker()
    yield worker
    worker.close()


def rows(db_url: str, sql: str) -> list[Any]:
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql))
            return list(result.all()) if result.returns_rows else []
    finally:
        engine.dispose()


def test_killed_mid_load_is_rolled_back_at_restart(
    db_url: str,
    tmp_path: Path,
    adapters_root: Path,
    make_adapter: Callable[..., Path],
    hung_worker: HungWorker,
) -> None:
    first = ControlPlane(db_url, adapters_root, tmp_path)
    first.start()
    try:
        http = httpx.Client(base_url=first.url, headers=ADMIN, timeout=30)
        assert http.put("/v1/pools/default/tiny", json=POOL).status_code == 200
        endpoint = f"http://127.0.0.1:{hung_worker.port}"
        assert (
            http.post(
                "/v1/workers",
                json={"name": "w0", "pool": "tiny", "endpoint": endpoint, "dp_size": 2},
            ).status_code
            == 201
        )
        wait_for(lambda: http.get("/v1/workers/w0").json()["state"] == "unreachable", timeout=20)
        rows(
            db_url, "UPDATE workers SET state = 'ready' WHERE name = 'w0'"
        )  # as if it had answered
        body = {"name": "sql", "pool": "tiny", "source": {"uri": f"file://{make_adapter()}"}}

        def post() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies under it
                httpx.post(
                    first.url + "/v1/adapters",
                    json=body,
                    headers={**ADMIN, "Idempotency-Key": "k1"},
                    timeout=300,
                )

        pending = threading.Thread(target=post, daemon=True)
        pending.start()
        wait_for(
            lambda: rows(db_url, "SELECT state FROM operations") == [("running",)],
            timeout=20,
            what="the load to be journalled and running",
        )
        assert rows(db_url, "SELECT state FROM placements ORDER BY dp_group") == [
            ("loading",),
            ("loading",),
        ]
    finally:
        first.kill()
    hung_worker.close()  # the worker is gone too: recovery must not hang on it

    second = ControlPlane(db_url, adapters_root, tmp_path)
    t0 = time.monotonic()
    second.start()
    print(f"restart took {time.monotonic() - t0:.1f}s")
    try:
        http = httpx.Client(base_url=second.url, headers=ADMIN, timeout=30)
        wait_for(
            lambda: (
                http.get("/v1/operations").json()["items"][0]["state"] not in ("pending", "running")
            ),
            timeout=30,
            what="the restarted control plane to settle the interrupted load",
        )
        ops = http.get("/v1/operations").json()["items"]
        assert len(ops) == 1
        op = ops[0]
        assert op["state"] in ("failed", "rolled_back"), op
        assert "restarted" in op["error"]
        adapter = http.get("/v1/adapters/default/sql").json()
        assert adapter["routable"] is False and adapter["loaded_workers"] == []
        assert all(p["state"] != "loaded" for p in adapter["placements"])
        # the worker could not be asked, so the adapter may still be there: not reusable until settled
        assert adapter["inconsistent"] is True and adapter["phase"] == "Degraded"
        replay = http.post(
            "/v1/adapters",
            json={
                "name": "sql",
                "pool": "tiny",
                "source": {"uri": f"file://{adapters_root / 'adapter'}"},
            },
            headers={"Idempotency-Key": "k1"},
        )
        assert replay.status_code == 502 and replay.json()["operation"]["id"] == op["id"]
    finally:
        second.stop()


def test_an_idle_client_connection_outlives_a_load_balancers_idle_time(
    db_url: str, tmp_path: Path, adapters_root: Path
) -> None:
    """The control plane keeps an idle keep-alive connection open past uvicorn's default
    5 s (`LORAPLANE_KEEP_ALIVE_S`, 75 s), so a load balancer in front that keeps its idle
    connections longer does not send a request on one the control plane is closing."""
    from tests.keepalive import answers_on_an_idle_connection

    from loraplane.controlplane.settings import Settings

    assert Settings().keep_alive_s > 60
    cp = ControlPlane(db_url, adapters_root, tmp_path)
    cp.start()
    try:
        assert answers_on_an_idle_connection(cp.url, "/readyz", 6)
    finally:
        cp.stop()
