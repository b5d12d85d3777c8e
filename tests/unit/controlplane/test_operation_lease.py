"""Operation leases: a replica settles only the operations nobody runs any more.

Two ``Operations`` on one SQLite registry stand for two control-plane replicas (a rolling
update on a shared database). What a user would notice: an adapter claimed by an operation
that nothing runs stays refused (409 "operation in progress") until a restart, or a replica
that starts beside a live one rolls back the load that replica is running.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from loraplane.controlplane.db import Database
from loraplane.controlplane.events import EventBus
from loraplane.controlplane.merge import UpdateResult
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.models import Adapter, Operation, Pool
from loraplane.controlplane.operations import Inflight, Operations
from loraplane.controlplane.plans import LoadPlan, WorkerRef
from loraplane.controlplane.workers import WorkerClient

pytestmark = pytest.mark.unit

# Long enough that a pause of the test's process (a loaded 2-core CI machine stalled one for
# over 0.3 s between a renewal and the check after it) does not look like a
# missed renewal; the waits below are fractions of it.
LEASE_S = 1.5


def registry(tmp_path: Path) -> Database:
    db = Database(f"sqlite:///{tmp_path / 'cp.db'}")
    db.migrate()
    with db.session() as session:
        pool = Pool(
            namespace="default",
            name="tiny",
            model="/models/tiny",
            max_loras_per_batch=2,
            max_loaded_loras=4,
            max_lora_rank=16,
        )
        session.add(pool)
        session.flush()
        for name in ("sql", "tone", "chat"):
            session.add(
                Adapter(
                    namespace="default",
                    name=name,
                    pool_id=pool.id,
                    source_uri=f"file:///adapters/{name}",
                    path=f"/adapters/{name}",
                    digest="0" * 64,
                    rank=8,
                    alpha=16.0,
                    target_modules=["q_proj"],
                )
            )
    return db


def replica(db: Database, http: httpx.AsyncClient, owner: str) -> Operations:
    client = WorkerClient(http, load_timeout_s=5, probe_timeout_s=1)
    return Operations(db, client, EventBus(), Metrics(), Inflight(), owner=owner, lease_s=LEASE_S)


def journal_load(ops: Operations, name: str = "sql") -> str:
    """A load with no target (it succeeds when settled), journalled and claimed by ``ops``."""
    with ops.db.session() as session:
        adapter = session.query(Adapter).filter_by(name=name).one()
        plan = LoadPlan(adapter.id, name, adapter.path, pinned=False)
        op = ops.journal(session, key=None, hash_="h", kind="load", adapter=adapter, plan=plan)
        return op.id


def state_of(db: Database, op_id: str) -> tuple[str, str | None, str | None]:
    with db.session() as session:
        op = session.get(Operation, op_id)
        assert op is not None
        adapter = session.get(Adapter, op.plan["adapter_id"])
        assert adapter is not None
        return op.state, op.owner, adapter.busy_operation_id


def test_a_live_replicas_operation_is_left_alone_and_an_expired_one_is_settled_once(
    tmp_path: Path,
) -> None:
    db = registry(tmp_path)

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            old, new, third = (replica(db, http, n) for n in ("pod-old", "pod-new", "pod-3"))
            op_id = journal_load(old)
            old.running.add(op_id)  # pod-old is running it (a slow load)
            assert await new.settle_interrupted() == []  # a fresh lease: not new's to touch
            for _ in range(4):  # pod-old renews for longer than a lease
                await asyncio.sleep(LEASE_S / 3)
                await old.renew()
            assert await new.settle_interrupted() == []
            assert state_of(db, op_id) == ("pending", "pod-old", op_id)

            old.running.discard(op_id)  # pod-old dies: nobody renews any more
            await asyncio.sleep(LEASE_S * 1.2)
            first, second = await asyncio.gather(
                new.settle_interrupted(), third.settle_interrupted()
            )
            assert sorted(first + second) == [op_id]  # settled by exactly one replica
            state, owner, busy = state_of(db, op_id)
            assert state == "succeeded" and owner in ("pod-new", "pod-3")
            assert busy is None  # the adapter takes new operations again

    asyncio.run(run())


def test_own_operations_are_settled_once_they_miss_a_renewal(tmp_path: Path) -> None:
    """The default owner is the host name, which a restarted container keeps: what the previous
    process left is settled as soon as it has missed a renewal (half a lease), and so is an
    operation an unexpected error dropped. One a live process of the same name runs (it renews
    every third of a lease) is never taken, nor one this process runs."""
    db = registry(tmp_path)

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            before = replica(db, http, "pod-0")
            left = journal_load(before)
            sibling = journal_load(before, "tone")
            before.running.add(sibling)  # still alive: renews
            after = replica(db, http, "pod-0")  # the same name, another process
            assert await after.settle_interrupted() == []  # too early to tell
            for _ in range(2):
                await asyncio.sleep(LEASE_S / 3)
                await before.renew()
            assert await after.settle_interrupted() == [left]
            assert state_of(db, left)[0] == "succeeded"
            assert state_of(db, sibling)[0] == "pending"

            dropped = journal_load(after, "chat")
            after.running.add(dropped)
            for _ in range(2):  # both processes keep renewing what they run
                await asyncio.sleep(LEASE_S / 3)
                await before.renew()
                await after.renew()
            assert await after.settle_interrupted() == []  # runs here: not abandoned
            with db.session() as session:  # marked running, then the run died of a bug
                session.execute(
                    update(Operation).where(Operation.id == dropped).values(state="running")
                )
            after.running.discard(dropped)
            await asyncio.sleep(LEASE_S * 0.6)  # no renewal for more than half a lease
            await before.renew()
            assert await after.settle_interrupted() == [dropped]
            assert state_of(db, dropped)[2] is None

    asyncio.run(run())


def test_an_unexpected_error_in_one_call_waits_for_the_other_workers_calls(
    tmp_path: Path,
) -> None:
    """After a bug or a lost database in one worker's call, the operation is settled from what
    the workers hold. A load still running on another worker must end first, or it lands
    after that look: a copy the registry has no row for."""
    ended: list[str] = []

    async def call(target: WorkerRef) -> UpdateResult:
        if target.name == "w-cancelled":  # a call cancelled on its own: not what to settle on
            raise asyncio.CancelledError
        if target.name == "w-bad":
            raise RuntimeError("the database went away")
        await asyncio.sleep(0.3)
        ended.append(target.name)
        return UpdateResult(True)

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            ops = replica(registry(tmp_path), http, "cp-a")
            targets = [
                WorkerRef(3, "w-cancelled", "x", 1),
                WorkerRef(1, "w-bad", "x", 1),
                WorkerRef(2, "w-slow", "x", 1),
            ]
            with pytest.raises(RuntimeError, match="the database went away"):
                await ops._fanout("load", targets, call)
            assert ended == ["w-slow"]

    asyncio.run(main())
