"""Registry events over a real Redis; stopping Redis for a while does not stop reads, writes or
routing, and the events published meanwhile arrive once it is back.

The test runs its own redis-server on a free port so the shared one (scripts/services.sh) is
left alone.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cp_kit import ADMIN, POOL, PrivateRedis, wait_for
from fastapi.testclient import TestClient

from loraplane.controlplane.app import create_app
from loraplane.controlplane.events import CHANNEL
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.integration


class Subscriber:
    """Collects the events published on the channel, from a thread."""

    def __init__(self, url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.pubsub = redis.Redis.from_url(url).pubsub()
        self.pubsub.subscribe(CHANNEL)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stopped = False
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                message = self.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            except redis.RedisError:
                return
            if message is not None:
                self.events.append(json.loads(message["data"]))

    def seen(self, type_: str, **fields: Any) -> bool:
        return any(
            e["type"] == type_ and all(e.get(k) == v for k, v in fields.items())
            for e in self.events
        )

    def close(self) -> None:
        self.stopped = True
        self.thread.join(timeout=5)
        self.pubsub.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_redis_outage_keeps_the_registry_working_and_events_resume(
    settings: Settings, private_redis: PrivateRedis, make_adapter: Callable[..., Path]
) -> None:
    settings.redis_url = private_redis.url
    with TestClient(create_app(settings)) as client:
        before = Subscriber(private_redis.url)
        try:
            client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN)
            client.post(
                "/v1/workers",
                json={"name": "w0", "pool": "tiny", "endpoint": "http://127.0.0.1:9", "dp_size": 2},
                headers=ADMIN,
            )
            wait_for(
                lambda: before.seen("worker.registered", worker="w0"),
                what="worker.registered over Redis",
            )
            assert client.get("/readyz").json()["redis"] == "ok"
        finally:
            before.close()

        private_redis.stop()
        wait_for(
            lambda: client.get("/readyz").json() == {"database": "ok", "redis": "down"},
            what="readyz to report redis down",
        )
        started = time.monotonic()
        assert client.get("/v1/pools", headers=ADMIN).status_code == 200
        registered = client.post(
            "/v1/adapters",
            json={
                "name": "during-outage",
                "pool": "tiny",
                "source": {"uri": f"file://{make_adapter()}"},
            },
            headers=ADMIN,
        )
        assert registered.status_code == 201, registered.text
        routed = client.post(
            "/v1/completions", json={"model": "tiny:during-outage", "prompt": "x"}, headers=ADMIN
        )
        assert routed.status_code == 503 and routed.json()["error"]["code"] == "no_worker"
        assert time.monotonic() - started < 5, "registry calls waited for Redis"
        op_id = registered.json()["operation"]["id"]

        private_redis.start()
        after = Subscriber(private_redis.url)
        try:
            wait_for(
                lambda: after.seen("operation.finished", operation=op_id),
                timeout=15,
                what="the event published during the outage to arrive after Redis came back",
            )
            wait_for(
                lambda: client.get("/readyz").json()["redis"] == "ok",
                what="readyz to report redis ok",
            )
            client.post("/v1/adapters/default/during-outage/unload", headers=ADMIN)
            wait_for(
                lambda: after.seen("operation.finished", kind="unload"),
                what="a fresh event after recovery",
            )
        finally:
            after.close()


def test_events_reach_the_in_process_stream_without_redis(
    settings: Settings, make_adapter: Callable[..., Path]
) -> None:
    with TestClient(create_app(settings)) as client:
        client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN)
        bus = client.app.state.services.bus  # type: ignore[attr-defined]
        received: list[dict[str, Any]] = []

        async def collect() -> None:
            async with bus.subscribe() as queue:
                task = asyncio.create_task(register_later())
                while True:
                    event = await queue.get()
                    received.append(event)
                    if event["type"] == "operation.finished":
                        await task
                        return

        async def register_later() -> None:
            import httpx

            transport = httpx.ASGITransport(app=client.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://cp") as http:
                await http.post(
                    "/v1/adapters",
                    json={
                        "name": "x",
                        "pool": "tiny",
                        "source": {"uri": f"file://{make_adapter()}"},
                    },
                    headers=ADMIN,
                )

        client.portal.call(collect)  # type: ignore[union-attr]
        assert received[-1]["kind"] == "register" and received[-1]["state"] == "succeeded"


def test_one_replica_leads_the_reconciler_at_a_time(redis_url: str) -> None:
    from loraplane.controlplane.events import RedisEventBus

    async def run() -> list[bool]:
        role = f"test-{time.monotonic_ns()}"
        first, second = (
            RedisEventBus(redis_url, replica_id="r1"),
            RedisEventBus(redis_url, replica_id="r2"),
        )
        try:
            results = [await first.try_lead(role, 0.5), await second.try_lead(role, 0.5)]
            results.append(await first.try_lead(role, 0.5))  # the holder renews
            await asyncio.sleep(0.8)  # the holder went quiet: the lock expires
            results.append(await second.try_lead(role, 0.5))
            results.append(await first.try_lead(role, 0.5))
            return results
        finally:
            await first.close()
            await second.close()

    assert asyncio.run(run()) == [True, False, True, True, False]


def test_a_replica_that_stops_leading_stops_exporting_the_registry_gauges(
    redis_url: str, tmp_path: Path
) -> None:
    """Only the leader writes `loraplane_adapters`/`workers`/`placements`; a former leader's
    frozen values would add to the new leader's in every `sum()` (alerts that never clear)."""
    import httpx

    from loraplane.controlplane.db import Database
    from loraplane.controlplane.events import RedisEventBus
    from loraplane.controlplane.metrics import Metrics
    from loraplane.controlplane.models import Pool
    from loraplane.controlplane.reconciler import Reconciler
    from loraplane.controlplane.workers import WorkerClient

    db = Database(f"sqlite:///{tmp_path / 'cp.db'}")
    db.migrate()
    with db.session() as session:
        session.add(
            Pool(namespace="default", name="tiny", model="/m", max_loras_per_batch=2,
                 max_loaded_loras=4, max_lora_rank=16)
        )  # fmt: skip

    def series(metrics: Metrics) -> int:
        return sum(
            len(family.samples)
            for family in metrics.registry.collect()
            if family.name in ("loraplane_adapters", "loraplane_workers", "loraplane_placements")
        )

    async def run() -> tuple[int, int, int]:
        buses = [RedisEventBus(redis_url, replica_id=r) for r in ("r1", "r2")]
        metrics = [Metrics(), Metrics()]
        async with httpx.AsyncClient() as http:
            client = WorkerClient(http, load_timeout_s=5, probe_timeout_s=1)
            first, second = (
                Reconciler(db, client, bus, m, interval_s=0.1)
                for bus, m in zip(buses, metrics, strict=True)
            )
            try:
                await first.reconcile_all()  # r1 leads (a 2 s lock)
                led = series(metrics[0])
                await asyncio.sleep(2.3)  # r1 goes quiet; the lock expires
                await second.reconcile_all()  # r2 leads now
                await first.reconcile_all()  # r1 is standby
                return led, series(metrics[0]), series(metrics[1])
            finally:
                for bus in buses:
                    await bus.close()

    led, standby, leader = asyncio.run(run())
    assert led > 0 and leader > 0
    assert standby == 0


def test_without_redis_every_replica_leads(tmp_path: Path) -> None:
    from loraplane.controlplane.events import RedisEventBus

    async def run() -> bool:
        bus = RedisEventBus(f"redis://127.0.0.1:{PrivateRedis(tmp_path).port}/0", replica_id="r1")
        try:
            return await bus.try_lead("reconciler", 1.0)
        finally:
            await bus.close()

    assert asyncio.run(run()) is True


def test_a_token_revoked_on_one_replica_is_refused_by_another_that_knew_it(
    redis_url: str, db_url: str
) -> None:
    """Replica B accepts a token from memory after its first request (``token_cache_s``, here
    far longer than the test); revoked through replica A, B refuses it as soon as A's
    ``token.revoked`` event arrives, not when its memory expires."""

    def replica(name: str) -> Settings:
        settings = Settings(
            db_url=db_url, admin_token="admin-token", redis_url=redis_url, replica_id=name
        )
        settings.token_cache_s = 600.0
        return settings

    admin = {"Authorization": "Bearer admin-token"}
    with (
        TestClient(create_app(replica("a"))) as a,
        TestClient(create_app(replica("b"))) as b,
    ):
        made = a.post("/v1/tokens", json={"name": "reader", "scopes": ["read"]}, headers=admin)
        assert made.status_code == 201, made.text
        token = {"Authorization": f"Bearer {made.json()['token']}"}
        assert b.get("/v1/pools", headers=token).status_code == 200  # (b keeps it now)
        assert a.delete(f"/v1/tokens/{made.json()['id']}", headers=admin).status_code == 204
        wait_for(
            lambda: b.get("/v1/pools", headers=token).status_code == 401,
            10,
            what="replica b to refuse the token revoked on replica a",
        )
