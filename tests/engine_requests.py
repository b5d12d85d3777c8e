"""Requests straight into a worker's engine (no HTTP), for tests that compare workers."""

from __future__ import annotations

import threading
from typing import Any


def generate(
    server: Any, prompts: list[list[int]], adapters: list[str | None], tokens: int = 6
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (request ``i`` with ``adapters[i % len(adapters)]``),
    submitted together to ``server.engine``."""
    from loraplane.worker.engine.sampling import SamplingParams

    outputs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):

        def sink(event: Any, i: int = i) -> None:
            assert event.error is None, event.error
            outputs[i].extend(event.token_ids)
            if event.finished:
                done[i].set()

        server.engine.submit(f"r{i}", prompt, params, adapters[i % len(adapters)], sink)
    for event in done:
        assert event.wait(120), "a request did not finish"
    return outputs
