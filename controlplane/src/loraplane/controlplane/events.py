"""Registry-change events: Redis pub/sub between replicas, delivered in-process first.

``publish`` always delivers to this replica's subscribers at once, then to Redis for the
others. When Redis is away, events are kept in a bounded buffer and sent, in order, once it
answers again; reads and routing never wait for Redis. Without a Redis URL the bus is
in-process only (one replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any

from loraplane.controlplane.metrics import Metrics

CHANNEL = "loraplane:events"
log = logging.getLogger(__name__)


# How long shutdown waits for a background task to stop or a connection to close; past it the
# step is logged and skipped, so a stuck Redis or worker socket can never hang a shutdown.
CLOSE_TIMEOUT_S = 5.0


async def stop_tasks(tasks: list[asyncio.Task[None]], what: str) -> None:
    """Cancel ``tasks`` and wait for them, at most ``CLOSE_TIMEOUT_S``; log the ones left."""
    live = [t for t in tasks if not t.done()]
    for task in live:
        task.cancel()
    if not live:
        return
    done, pending = await asyncio.wait(live, timeout=CLOSE_TIMEOUT_S)
    for task in done:  # a loop that died of an error was logged by it; mark it retrieved
        if not task.cancelled():
            task.exception()
    for task in pending:
        log.warning(
            "%s: task %s did not stop within %.0f s of being cancelled; leaving it",
            what,
            task.get_name(),
            CLOSE_TIMEOUT_S,
        )


async def close_within(step: Awaitable[Any], what: str) -> None:
    """Await the closing coroutine ``step`` for at most ``CLOSE_TIMEOUT_S``; log a timeout or
    an error instead of raising (shutdown goes on with the next step)."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await step
    except TimeoutError:
        log.warning("%s did not close within %.0f s; going on", what, CLOSE_TIMEOUT_S)
    except Exception as exc:
        log.warning("%s failed to close: %r", what, exc)


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class EventBus:
    """In-process bus; ``RedisEventBus`` extends it across replicas."""

    def __init__(self, metrics: Metrics | None = None, replica_id: str | None = None) -> None:
        self.metrics = metrics
        self.replica_id = replica_id or default_replica_id()
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        if metrics is not None:
            # The in-process bus is always up; RedisEventBus overrides it from Redis.
            metrics.event_bus_up.set(1)

    @property
    def state(self) -> str:
        return "disabled"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _deliver(self, event: dict[str, Any]) -> None:
        for queue in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(event)

    async def publish(self, type_: str, *, namespace: str | None, **fields: Any) -> dict[str, Any]:
        """``namespace``: whose event it is (a namespaced reader sees only its own); None for
        an event of no namespace (a worker already deleted), seen only by cluster-wide readers."""
        event = {
            "type": type_,
            "at": datetime.now(UTC).isoformat(),
            "origin": self.replica_id,
            "namespace": namespace,
            **fields,
        }
        self._deliver(event)
        return event

    async def try_lead(self, role: str, ttl_s: float) -> bool:
        """Whether this replica should do ``role`` now; one replica alone always leads."""
        return True

    @contextlib.asynccontextmanager
    async def subscribe(self, maxsize: int = 1000) -> AsyncIterator[asyncio.Queue[dict[str, Any]]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize)
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)


class RedisEventBus(EventBus):
    def __init__(
        self,
        url: str,
        metrics: Metrics | None = None,
        replica_id: str | None = None,
        buffer_size: int = 10_000,
        retry_s: float = 0.5,
    ) -> None:
        super().__init__(metrics, replica_id)
        import redis.asyncio as aioredis

        self.url = url
        self._redis = aioredis.from_url(
            url, socket_connect_timeout=1, socket_timeout=2, health_check_interval=5
        )
        self._pending: deque[dict[str, Any]] = deque(maxlen=buffer_size)
        self._up = False
        if metrics is not None:
            metrics.event_bus_up.set(0)  # until the first ping answers
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()

    @property
    def state(self) -> str:
        return "ok" if self._up else "down"

    def _set_up(self, up: bool) -> None:
        if up != self._up:
            log.warning("event bus redis %s: %s", "up" if up else "down", self.url)
        self._up = up
        if self.metrics is not None:
            self.metrics.event_bus_up.set(1 if up else 0)

    async def start(self) -> None:
        try:
            await self._redis.ping()  # type: ignore[misc]  # redis>=7 types ping() as "Awaitable[bool] | bool"
            self._set_up(True)
        except Exception:
            self._set_up(False)
        self._tasks = [
            asyncio.create_task(self._sender(), name="events-sender"),
            asyncio.create_task(self._listener(), name="events-listener"),
        ]

    async def close(self) -> None:
        await stop_tasks(self._tasks, "event bus")
        await close_within(self._redis.aclose(), "event bus redis client")

    async def publish(self, type_: str, *, namespace: str | None, **fields: Any) -> dict[str, Any]:
        event = await super().publish(type_, namespace=namespace, **fields)
        if len(self._pending) == self._pending.maxlen and self.metrics is not None:
            self.metrics.events_dropped.inc()
        self._pending.append(event)
        self._wake.set()
        return event

    async def try_lead(self, role: str, ttl_s: float) -> bool:
        """A short-lived Redis lock per role (SET NX PX, renewed by its holder). Without Redis
        every replica leads: the work it guards must be idempotent."""
        key = f"loraplane:leader:{role}"
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            if await self._redis.set(key, self.replica_id, nx=True, px=ttl_ms):
                return True
            holder = await self._redis.get(key)
            if (
                holder is not None
                and (holder.decode() if isinstance(holder, bytes) else holder) == self.replica_id
            ):
                await self._redis.pexpire(key, ttl_ms)
                return True
            return False
        except Exception:
            return True

    async def _sender(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # asyncio.timeout: see Reconciler._loop
                    async with asyncio.timeout(self._retry_s * 4):
                        await self._wake.wait()
                if not self._pending:
                    continue
            event = self._pending[0]
            try:
                await self._redis.publish(CHANNEL, json.dumps(event))
            except Exception as exc:  # Redis away: keep the event, retry later
                log.debug("publish failed: %s", exc)
                self._set_up(False)
                await asyncio.sleep(self._retry_s)
                continue
            self._pending.popleft()
            self._set_up(True)

    async def _listener(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(CHANNEL)
                self._set_up(True)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    try:
                        event = json.loads(message["data"])
                    except (TypeError, ValueError):
                        continue
                    if isinstance(event, dict) and event.get("origin") != self.replica_id:
                        self._deliver(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("listener lost redis: %s", exc)
                self._set_up(False)
                await asyncio.sleep(self._retry_s)
            finally:
                await close_within(pubsub.aclose(), "event bus subscription")  # type: ignore[no-untyped-call]


def make_bus(redis_url: str | None, metrics: Metrics | None, replica_id: str | None) -> EventBus:
    if redis_url:
        return RedisEventBus(redis_url, metrics, replica_id)
    return EventBus(metrics, replica_id)
