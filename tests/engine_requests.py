"""Requests straight into a worker's engine (no HTTP), for tests that compare workers."""

from __future__ import annotations

import threading
from typing import Any


def start(
    engine: Any, prompt: list[int], adapter: str | None, tokens: int, request_id: str = ""
) -> tuple[list[int], threading.Event]:
    """One greedy request submitted to ``engine``: its tokens as they arrive, and its end."""
    from loraplane.worker.engine.sampling import SamplingParams

    out: list[int] = []
    done = threading.Event()

    def sink(event: Any) -> None:
        assert event.error is None, event.error
        out.extend(event.token_ids)
        if event.finished:
            done.set()

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.submit(request_id or f"r{id(out)}", prompt, params, adapter, sink)
    return out, done


def generate(
    server: Any, prompts: list[list[int]], adapters: list[str | None], tokens: int = 6
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (request ``i`` with ``adapters[i % len(adapters)]``),
    submitted together to ``server.engine``."""
    started = [
        start(server.engine, prompt, adapters[i % len(adapters)], tokens, f"r{i}")
        for i, prompt in enumerate(prompts)
    ]
    for _, done in started:
        assert done.wait(120), "a request did not finish"
    return [out for out, _ in started]
