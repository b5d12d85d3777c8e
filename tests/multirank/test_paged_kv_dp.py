"""The paged KV cache under DP attention (ADR 0015): each DP group has its own pool of pages
and its own prefix cache; requests spread over both groups' small pools, waiting for pages,
get the tokens they get alone, and every page is free again at the end."""

from __future__ import annotations

import pytest
from tests.engine_requests import start

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.multirank

PROMPTS = [
    [5, 9, 200, 31, 17, 4, 88, 250, 3],
    [17, 4, 88, 250, 3, 3, 61],
    [250, 3, 3, 61, 7, 12, 140, 99, 98],
    [12, 140, 99, 98, 97, 7],
]
TOKENS = 6


def test_requests_over_two_groups_small_pools_get_their_tokens(suite) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    executor = MultiRankExecutor(
        ParallelConfig(tp=2, dp=2, dp_attention=True),
        RunnerConfig(
            str(model_dir), max_seqs=2, max_len=64, lora_backend="torch", page_size=4, kv_pages=4
        ),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )
    engine = Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_running=2,
        max_model_len=64,
        overlap=True,  # (a worker's default: ADR 0014)
    )
    engine.start()
    try:
        assert engine.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
        assert [p.num_pages for p in engine.pools] == [4, 4]
        wanted = [("a8" if i % 2 else None) for i in range(len(PROMPTS))]
        alone = []
        for prompt, adapter in zip(PROMPTS, wanted, strict=True):
            tokens, done = start(engine, prompt, adapter, TOKENS)
            assert done.wait(120)
            alone.append(tokens)
        # each request reserves 3-4 of a group's 4 pages: one per group at a time
        with engine._lock:
            started = [
                start(engine, prompt, adapter, TOKENS, f"r{i}")
                for i, (prompt, adapter) in enumerate(zip(PROMPTS, wanted, strict=True))
            ]
        for _, done in started:
            assert done.wait(120)
        assert [tokens for tokens, _ in started] == alone
        with engine._lock:
            assert all(p.used == 0 and p.available == 4 for p in engine.pools)
            stats = {s["adapter"]: s for s in engine.lora_state()["prefix_cache"]}
        assert stats["a8"]["prompt_tokens"] + stats[None]["prompt_tokens"] == 2 * sum(
            len(p) for p in PROMPTS
        )
    finally:
        engine.stop()
