"""How the worker's front end hands a request's events to its stream: every token in order,
one loop wake-up per burst of events, and events that queued up while the stream was being
written joined into one chunk."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.server.app import LoopPoster, WorkerServer

pytestmark = pytest.mark.unit


def token(i: int, *, last: bool = False) -> SeqEvent:
    return SeqEvent(
        f"t{i} ", (i,), last, "length" if last else None, prompt_tokens=3, completion_tokens=i + 1
    )


class CountingPoster(LoopPoster):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.wakeups = 0

    def _deliver(self) -> None:
        self.wakeups += 1
        super()._deliver()


def test_a_burst_from_another_thread_wakes_the_loop_once_and_keeps_the_order() -> None:
    async def main() -> tuple[list[list[int]], int]:
        poster = CountingPoster(asyncio.get_running_loop())
        queues: list[asyncio.Queue[SeqEvent]] = [asyncio.Queue() for _ in range(8)]

        def step() -> None:  # one engine step's events for 8 requests, 5 steps in a row
            for i in range(5):
                for q in queues:
                    poster.post(q, token(i))

        thread = threading.Thread(target=step)
        thread.start()
        thread.join()  # (the loop is not running meanwhile: all 40 events are one burst)
        await asyncio.sleep(0)
        got = [[e.token_ids[0] for e in _drain(q)] for q in queues]
        return got, poster.wakeups

    got, wakeups = asyncio.run(main())
    assert got == [[0, 1, 2, 3, 4]] * 8
    assert wakeups == 1


def _drain(queue: asyncio.Queue[SeqEvent]) -> list[SeqEvent]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def test_events_that_queued_up_come_as_one_with_all_their_text_and_tokens() -> None:
    server: Any = WorkerServer.__new__(WorkerServer)
    server.engine = None

    async def main() -> list[SeqEvent]:
        queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
        for i in range(3):
            queue.put_nowait(token(i))
        seen: list[SeqEvent] = []
        async for event in server.events(object(), queue):
            seen.append(event)
            if len(seen) == 1:  # the client reads slowly: four more arrive meanwhile
                for i in range(3, 6):
                    queue.put_nowait(token(i))
                queue.put_nowait(token(6, last=True))
        return seen

    seen = asyncio.run(main())
    assert [e.token_ids for e in seen] == [(0, 1, 2), (3, 4, 5, 6)]
    assert "".join(e.text_delta for e in seen) == "".join(f"t{i} " for i in range(7))
    assert seen[-1].finished and seen[-1].finish_reason == "length"
    assert [e.completion_tokens for e in seen] == [3, 7]


def test_an_error_is_never_merged_away() -> None:
    error = SeqEvent("", (), True, "abort", error="engine failed: boom")
    assert token(0).merged(error) is error
    assert token(0).merged(token(1)).token_ids == (0, 1)
