"""The router's route table and batched last-use writes, against a real SQLite registry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select
from tests.unit.controlplane.test_operation_lease import registry

from loraplane.controlplane.db import Database
from loraplane.controlplane.errors import ApiError
from loraplane.controlplane.events import EventBus
from loraplane.controlplane.models import Adapter, Placement, Pool, Worker
from loraplane.controlplane.operations import WorkerRef
from loraplane.controlplane.routes import (
    Candidate,
    Destination,
    RouteTable,
    changes_routing,
    watch_writes,
)
from loraplane.controlplane.usage import UsageBatch

pytestmark = pytest.mark.unit

W0 = WorkerRef(1, "w0", "http://w0", 1)
ROUTABLE = Destination((Candidate(W0, "a0"),), 1, "a0", "a0")
NOWHERE = Destination((), 1, "a0", "a0")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    """The lease tests' registry (adapters sql, tone, chat), with ``sql`` and ``tone`` loaded
    on a ready worker."""
    database = registry(tmp_path)
    with database.session() as session:
        pool = session.scalar(select(Pool))
        worker = Worker(name="w0", pool=pool, endpoint="http://w0", dp_size=1, state="ready")
        session.add(worker)
        for adapter in session.scalars(select(Adapter).where(Adapter.name != "chat")):
            session.add(
                Placement(
                    adapter=adapter,
                    worker=worker,
                    dp_group=0,
                    lora_name=adapter.name,
                    version=1,
                    state="loaded",
                )
            )
    yield database
    database.close()


@pytest.mark.parametrize(
    ("statement", "routing"),
    [
        ("UPDATE placements SET state=? WHERE placements.id = ?", True),
        ("UPDATE placements SET observed_at=?, error=? WHERE placements.id = ?", False),
        ("INSERT INTO placements (adapter_id, worker_id) VALUES (?, ?)", True),
        ("DELETE FROM placements WHERE placements.adapter_id = ?", True),
        ("UPDATE workers SET last_seen_at=?, observed=? WHERE workers.id = ?", False),
        ('UPDATE "workers" SET "state"=%(state)s WHERE workers.id = %(id)s', True),
        ("UPDATE adapters SET last_used_at=CASE adapters.id WHEN ? THEN ? END", False),
        ("UPDATE adapters SET desired=?, phase=? WHERE adapters.id = ?", True),
        ("INSERT INTO pools (namespace, name) VALUES (?, ?)", True),
        ("UPDATE operations SET state=? WHERE operations.id = ?", False),
        ("SELECT placements.state FROM placements", False),
    ],
)
def test_which_writes_change_routing(statement: str, routing: bool) -> None:
    assert changes_routing(statement) is routing


def test_a_routing_write_empties_the_table_and_bookkeeping_does_not(db: Database) -> None:
    emptied: list[int] = []
    watch_writes(db.engine, lambda: emptied.append(1))
    with db.session() as session:
        worker = session.scalar(select(Worker))
        assert worker is not None
        worker.last_error = "slow probe"  # not routing
    assert emptied == []
    asyncio.run(_touch_and_flush(db, [1, 2]))
    assert emptied == []
    with db.session() as session:
        placement = session.scalar(select(Placement))
        assert placement is not None
        placement.state = "unloading"
    # once as the statement runs, once when its connection goes back after the commit
    assert emptied == [1, 1]


async def _touch_and_flush(db: Database, adapter_ids: list[int]) -> None:
    usage = UsageBatch(db)
    for adapter_id in adapter_ids:
        usage.touch(adapter_id)
    await usage.flush()


def test_last_use_is_written_in_one_update_per_flush_and_at_close(db: Database) -> None:
    updates: list[str] = []

    @event.listens_for(db.engine, "after_cursor_execute")
    def _seen(_c: Any, _cur: Any, statement: str, _p: Any, _ctx: Any, _m: bool) -> None:
        if statement.startswith("UPDATE adapters"):
            updates.append(statement)

    async def run() -> None:
        usage = UsageBatch(db, interval_s=3600)
        await usage.start()
        usage.touch(1)
        usage.touch(2)
        await usage.flush()
        await usage.flush()  # nothing new: no statement
        usage.touch(2)
        await usage.close()  # the last touch is written at shutdown

    asyncio.run(run())
    assert len(updates) == 2
    with db.session() as session:
        used = {a.name: a.last_used_at for a in session.scalars(select(Adapter))}
    assert used["sql"] > 0 and used["tone"] >= used["sql"] and used["chat"] == 0


def test_only_routable_answers_are_kept() -> None:
    calls: list[str] = []

    def lookup(answer: Destination) -> Any:
        def read() -> Destination:
            calls.append("db")
            return answer

        return read

    async def run() -> None:
        table = RouteTable(ttl_s=3600)
        assert await table.get(("default", "a0"), lookup(ROUTABLE)) == ROUTABLE
        assert await table.get(("default", "a0"), lookup(NOWHERE)) == ROUTABLE  # from memory
        assert await table.get(("default", "a1"), lookup(NOWHERE)) == NOWHERE
        assert await table.get(("default", "a1"), lookup(NOWHERE)) == NOWHERE  # read again
        table.invalidate()
        assert await table.get(("default", "a0"), lookup(NOWHERE)) == NOWHERE

    asyncio.run(run())
    assert calls == ["db"] * 4


def test_a_lookup_that_read_before_an_invalidation_is_not_kept() -> None:
    reading, release = threading.Event(), threading.Event()

    def slow_lookup() -> Destination:
        reading.set()
        release.wait(10)
        return ROUTABLE  # what the database said before the write

    async def run() -> Destination:
        table = RouteTable(ttl_s=3600)
        first = asyncio.ensure_future(table.get(("default", "a0"), slow_lookup))
        await asyncio.to_thread(reading.wait, 10)
        table.invalidate()  # the unload's write lands while the lookup reads
        release.set()
        assert await first == ROUTABLE  # that request was already on its way
        return await table.get(("default", "a0"), lambda: NOWHERE)

    assert asyncio.run(run()) == NOWHERE


def test_errors_reach_the_caller_and_are_not_kept() -> None:
    answers = iter([ApiError(404, "not_found", "no such adapter"), ROUTABLE])

    def lookup() -> Destination:
        answer = next(answers)
        if isinstance(answer, ApiError):
            raise answer
        return answer

    async def run() -> None:
        table = RouteTable()
        with pytest.raises(ApiError, match="no such adapter"):
            await table.get(("default", "a0"), lookup)
        assert await table.get(("default", "a0"), lookup) == ROUTABLE

    asyncio.run(run())


def test_every_registry_event_empties_the_table() -> None:
    async def run() -> Destination:
        bus = EventBus()
        table = RouteTable(ttl_s=3600)
        await table.start(bus)
        try:
            await table.get(("default", "a0"), lambda: ROUTABLE)
            await bus.publish("adapter.unloaded", namespace="default", adapter_id=1)
            for _ in range(10):  # let the table's subscriber run
                await asyncio.sleep(0)
            return await table.get(("default", "a0"), lambda: NOWHERE)
        finally:
            await table.close()

    assert asyncio.run(run()) == NOWHERE
