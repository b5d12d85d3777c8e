"""The worker's warm-up (``engine.warmup``): what it runs, and that a user sees no trace of it
but the time it takes (no adapter loaded after it, the same tokens as a worker without it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tests.engine_requests import generate

from loraplane.worker.engine.warmup import plan_for, stage_ranks
from loraplane.worker.server.factory import ServeConfig
from loraplane.worker.server.serve import build_server

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8]]


def test_the_plan_covers_every_bucket_stage_width_and_rank() -> None:
    plan = plan_for(max_seqs=64, max_len=4096, max_loras_per_batch=6, max_lora_rank=64)
    assert plan.decode_sizes == (1, 2, 4, 8, 16, 24, 32, 48, 64)  # every graph bucket
    assert plan.sampler_sizes == (1, 64)  # chunked and one program a row
    assert plan.ranks == (16, 32, 64)  # every stage rank
    assert plan.adapter_counts == (1, 2, 4, 6)  # stage widths 1, 2, 4 and K
    assert plan.lora_sizes == (1, 16, 32, 64)
    # staged or not, row blocks of 16, 32 and 64, multiple of 16 or not
    assert plan.prefill_tokens == (16, 29, 192, 205, 320, 333)
    moe = plan_for(64, 4096, 4, 64, experts=(128, 8))  # Qwen3-30B-A3B: 24 and 48 pairs an expert
    assert moe.prefill_tokens == (16, 29, 192, 205, 320, 333, 384, 397, 768, 781)
    assert stage_ranks(48) == (16, 32, 48) and stage_ranks(8) == (8,)
    short = plan_for(max_seqs=3, max_len=10, max_loras_per_batch=None, max_lora_rank=64)
    assert short.decode_sizes == (1, 2, 3) and short.ranks == () and short.adapter_counts == ()
    assert short.prefill_tokens == (16, 27)  # what 3 rows of 9 prompt tokens hold


def test_on_by_default_only_on_a_gpu() -> None:
    assert ServeConfig(model="m", device="cuda").warms_up
    assert not ServeConfig(model="m").warms_up
    assert ServeConfig(model="m", warmup=True).warms_up
    assert not ServeConfig(model="m", device="cuda", warmup=False).warms_up


@pytest.fixture(scope="module")
def servers(suite) -> Iterator[dict[bool, Any]]:  # type: ignore[no-untyped-def]
    model_dir, _ = suite["llama"]
    built: dict[bool, Any] = {}
    try:
        for warmup in (True, False):
            config = ServeConfig(
                model=str(model_dir),
                warmup=warmup,
                max_running=4,
                max_loras_per_batch=2,
                max_loaded_loras=2,
                max_lora_rank=32,
                max_model_len=64,
            )
            built[warmup] = build_server(config)
        yield built
    finally:
        for server in built.values():
            server.engine.stop()


def test_a_warmed_worker_starts_with_no_adapter_and_serves_the_same_tokens(  # type: ignore[no-untyped-def]
    suite, servers
) -> None:
    warmed, cold = servers[True], servers[False]
    state = warmed.engine.lora_state()
    assert state["loaded"] == 0 and state["adapters"] == []
    assert state["slots"] == [None, None]
    lora = warmed.engine.executor.runner.lora
    assert all(a is None for a in lora.slot_adapters) and lora.slot_values()[0] == [0, 0]
    assert warmed.engine.executor.host == {}  # the blank adapter was dropped
    assert warmed.engine.steps == 0  # the engine did not count the warm-up's steps

    adapters = dict(suite["llama"][1])
    for server in (warmed, cold):
        for name in ("a8", "a32"):
            assert server.engine.load_adapter(name, str(adapters[name])).result().success
    assert generate(warmed, PROMPTS, [None]) == generate(cold, PROMPTS, [None])
    assert generate(warmed, PROMPTS, ["a8", "a32", None]) == generate(
        cold, PROMPTS, ["a8", "a32", None]
    )
