"""PostgreSQL going away for a while: clear 503s meanwhile (never a stale "loaded"), readiness
says so, and everything works again once it is back.

The control plane reaches the real PostgreSQL through a TCP relay that the test cuts and
restores (the shared server itself keeps running for the other tests).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cp_kit import ADMIN, ADMIN_TOKEN, POOL, HungWorker, free_port, join_hung_worker, wait_for
from fastapi.testclient import TestClient

from loraplane.controlplane.app import create_app
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.integration


class Relay:
    """Forwards 127.0.0.1:<port> to PostgreSQL until cut; restorable on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []

    def start(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.conns = []


@pytest.fixture
def relayed_url(pg_database: str) -> Iterator[tuple[str, Relay]]:
    url = sa.engine.make_url(pg_database)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()
    relay = Relay((url.host or "127.0.0.1", url.port or 5432))
    relay.start()
    yield url.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False), relay
    relay.cut()


def test_registry_answers_503_while_postgres_is_away_and_recovers(
    relayed_url: tuple[str, Relay], tmp_path: object
) -> None:
    url, relay = relayed_url
    settings = Settings(db_url=url, admin_token="integration-admin-token")
    settings.reconciler.interval_s = 0.2
    with TestClient(create_app(settings)) as client:
        assert client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN).status_code == 200
        relay.cut()
        away = client.get("/v1/pools", headers=ADMIN)
        assert away.status_code == 503, away.text
        assert away.json()["error"]["code"] == "database_unavailable"
        assert away.headers["retry-after"] == "2"
        routed = client.post(
            "/v1/completions", json={"model": "tiny:x", "prompt": "hi"}, headers=ADMIN
        )
        assert routed.status_code == 503
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["database"] == "down"
        relay.start()
        back = client.get("/v1/pools", headers=ADMIN)
        assert back.status_code == 200 and [p["name"] for p in back.json()["items"]] == ["tiny"]
        assert client.get("/readyz").json()["database"] == "ok"


def test_an_operation_the_outage_interrupts_is_settled_once_the_database_is_back(
    relayed_url: tuple[str, Relay],
    pg_database: str,
    adapters_root: Path,
    make_adapter: Callable[..., Path],
) -> None:
    """A load whose outcome cannot be written (PostgreSQL went away mid-operation) must not keep
    its adapter claimed until a restart: once the database is back, the lease pass settles it
    from what the worker holds, and the adapter takes operations again."""
    url, relay = relayed_url
    direct = sa.create_engine(pg_database)  # the test's own view, around the relay

    def rows(sql: str) -> list[Any]:
        with direct.begin() as conn:
            result = conn.execute(sa.text(sql))
            return list(result.all()) if result.returns_rows else []

    settings = Settings(db_url=url, admin_token=ADMIN_TOKEN)
    settings.reconciler.enabled = False  # only the operation's own recovery may settle it
    settings.sources.allowed_roots = [adapters_root]
    settings.workers.load_timeout_s = 2
    settings.workers.probe_timeout_s = 0.5
    settings.operations.lease_s = 1.5
    worker = HungWorker()  # the load is in flight when the database goes away
    try:
        with TestClient(create_app(settings)) as client:
            join_hung_worker(client, worker, pg_database)
            answers: list[Any] = []
            adapter = {"name": "sql", "pool": "tiny", "source": {"uri": f"file://{make_adapter()}"}}
            load = threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/adapters", json=adapter, headers=ADMIN)
                ),
                daemon=True,
            )
            load.start()
            wait_for(
                lambda: rows("SELECT state FROM operations") == [("running",)],
                timeout=20,
                what="the load to be journalled and running",
            )
            relay.cut()
            load.join(timeout=60)
            assert answers and answers[0].status_code == 503, answers
            assert rows("SELECT state FROM operations") == [("running",)]  # nothing settled it
            relay.start()
            wait_for(
                lambda: rows("SELECT state FROM operations") in ([("failed",)], [("rolled_back",)]),
                timeout=30,
                what="the lease pass to settle the interrupted load",
            )
            seen = client.get("/v1/adapters/default/sql", headers=ADMIN).json()
            assert seen["routable"] is False
            assert all(p["state"] != "loaded" for p in seen["placements"])
            retry = client.post("/v1/adapters/default/sql/unload", headers=ADMIN)
            assert retry.json().get("error", {}).get("code") != "operation_in_progress", retry.text
    finally:
        worker.close()
        direct.dispose()
