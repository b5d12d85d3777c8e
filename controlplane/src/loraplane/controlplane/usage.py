"""When each adapter was last routed to (the cluster-level LRU order), kept in memory per
request and written to the database in one UPDATE per flush.

A routed request only records the time in a dict; a background task flushes every
``interval_s`` (off the event loop), ``flush`` runs before a load (explicit or on demand) plans
its evictions, and ``close`` flushes what is left at shutdown. A flush the database refuses
keeps its times for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from sqlalchemy import case, update

from loraplane.controlplane.db import Database
from loraplane.controlplane.events import close_within, stop_tasks
from loraplane.controlplane.models import Adapter

log = logging.getLogger(__name__)


class UsageBatch:
    def __init__(self, db: Database, interval_s: float = 1.0) -> None:
        self.db = db
        self.interval_s = interval_s
        self.flushes = 0
        self._pending: dict[int, float] = {}  # adapter id -> epoch seconds of its last request
        self._lock = asyncio.Lock()  # one flush at a time, so an older time never lands last
        self._tasks: list[asyncio.Task[None]] = []

    def touch(self, adapter_id: int) -> None:
        self._pending[adapter_id] = time.time()

    async def flush(self) -> None:
        async with self._lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, {}
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception as exc:  # the database is away: keep the times for the next flush
                log.warning("could not record %d adapters' last use: %s", len(batch), exc)
                for adapter_id, at in batch.items():
                    self._pending[adapter_id] = max(at, self._pending.get(adapter_id, at))
                return
            self.flushes += 1

    def _write(self, batch: dict[int, float]) -> None:
        with self.db.session() as session:
            session.execute(
                update(Adapter)
                .where(Adapter.id.in_(list(batch)))
                .values(last_used_at=case(batch, value=Adapter.id))
                .execution_options(synchronize_session=False)
            )

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(), name="usage-flush")]

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(Exception):  # flush() logs; the loop must not die
                await self.flush()

    async def close(self) -> None:
        await stop_tasks(self._tasks, "usage flush")
        await close_within(self.flush(), "the last usage flush")
