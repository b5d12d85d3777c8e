"""Shutdown of the control plane's background loops is prompt and never hangs.

The reconciler sleeps until its interval ends or a poke wakes it. A cancel that lands as a
poke wakes it (an event arrives during shutdown) must still stop it: with ``asyncio.wait_for``
as the sleep, Python 3.11 returned the wake-up and swallowed the cancel, the loop ran on, and
``close()`` waited for it forever (a control-plane shutdown hung this way once in CI).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from loraplane.controlplane import events
from loraplane.controlplane.db import Database
from loraplane.controlplane.events import EventBus, stop_tasks
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.reconciler import Reconciler
from loraplane.controlplane.workers import WorkerClient

pytestmark = pytest.mark.unit


def test_reconciler_stops_when_a_poke_meets_the_cancel(tmp_path: Path) -> None:
    async def run() -> None:
        db = Database(f"sqlite:///{tmp_path / 'cp.db'}")
        db.migrate()
        async with httpx.AsyncClient() as http:
            client = WorkerClient(http, load_timeout_s=5, probe_timeout_s=1)
            reconciler = Reconciler(db, client, EventBus(), Metrics(), interval_s=30.0)
            for _ in range(50):
                await reconciler.start()
                while reconciler.passes == 0:  # let the first pass end: it now sleeps
                    await asyncio.sleep(0.001)
                reconciler.poke()  # the wake-up and the cancel reach the loop together
                async with asyncio.timeout(2):
                    await reconciler.close()
                assert reconciler._task is not None and reconciler._task.done()
                reconciler.passes = 0
        db.close()

    asyncio.run(run())


def test_a_task_that_ignores_its_cancel_is_left_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(events, "CLOSE_TIMEOUT_S", 0.2)

    done = asyncio.Event()

    async def stubborn() -> None:
        while not done.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    async def run() -> None:
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        async with asyncio.timeout(2):  # bounded: shutdown goes on
            await stop_tasks([task], "test loop")
        assert not task.done()
        done.set()  # the test's own cleanup
        task.cancel()
        await asyncio.wait([task], timeout=2)
        assert task.done()

    with caplog.at_level(logging.WARNING, logger="loraplane.controlplane.events"):
        asyncio.run(run())
    assert "test loop: task stubborn did not stop within" in caplog.text
