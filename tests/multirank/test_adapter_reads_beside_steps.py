"""A multi-rank worker reads adapters on each rank's read thread while the engine steps: reads
and steps use separate inboxes, so a request running through loads and unloads gets the tokens
it gets with none beside it, a bad adapter is still refused on every group, and a loaded one
then serves."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.engine_requests import start

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.parallel.executor import MultiRankExecutor
from loraplane.worker.parallel.state import ParallelConfig

pytestmark = pytest.mark.multirank

TOKENS = 24
PROMPT = [5, 9, 200, 31]


def test_loads_beside_a_running_request_change_none_of_its_tokens(suite, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    executor = MultiRankExecutor(
        ParallelConfig(tp=2, dp=2, dp_attention=True),
        RunnerConfig(str(model_dir), max_seqs=2, max_len=64, lora_backend="torch"),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )
    assert executor.reads_adapters_concurrently
    engine = Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_running=2,
        max_model_len=64,
        overlap=True,  # (a worker's default: ADR 0014)
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    engine.start()
    try:
        alone, done = start(engine, PROMPT, None, TOKENS)
        assert done.wait(120)
        beside, done = start(engine, PROMPT, None, TOKENS)
        cycles = 0
        while not done.is_set() or cycles == 0:
            assert engine.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
            refused = engine.load_adapter("bad", str(bad)).result(60)
            assert not refused.success and "adapter_config.json" in refused.error_message
            assert engine.unload_adapter("a8").result(60).success
            cycles += 1
        assert done.wait(120)
        assert beside == alone
        assert all("bad" not in group for group in engine.group_adapters)
        assert engine.load_adapter("a8", str(dict(adapters)["a8"])).result(60).success
        tokens, done = start(engine, PROMPT, "a8", 4)
        assert done.wait(120) and len(tokens) == 4
        assert engine.alive
    finally:
        engine.stop()
