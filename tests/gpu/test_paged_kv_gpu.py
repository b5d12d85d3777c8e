"""GPU tier: the paged KV cache (ADR 0015) on CUDA: decode graphs read the page table and the
fused rope writes through it, with pages scattered over a small pool, reused by later
requests and shared as cached prefixes; greedy fp32 outputs equal the eager path's. The pool
sized by --mem-fraction."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26] * 2  # 2 full pages
PROMPTS = [[*SHARED, 5, 9], [*SHARED, 44], [7, 7, 7, 7, 8], [*SHARED, 90, 1, 2], [3, 4, 5]]


def _generate(suite, graphs: bool) -> tuple[list[list[int]], int, int]:  # type: ignore[no-untyped-def]
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.engine import Engine
    from loraplane.worker.engine.executor import LocalExecutor
    from loraplane.worker.engine.runner import RunnerConfig
    from loraplane.worker.engine.sampling import SamplingParams
    from loraplane.worker.engine.tokenizer import TextTokenizer

    model_dir, adapters = suite["llama"]
    runner_cfg = RunnerConfig(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_seqs=4,
        max_len=64,
        cuda_graphs=graphs,
        kv_pages=10,  # 160 positions: freed and cached pages are handed out again
    )
    lora = LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32)
    executor = LocalExecutor(runner_cfg, lora)
    engine = Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_running=4,
        max_model_len=64,
    )
    engine.start()
    try:
        name, path = adapters[0]
        assert engine.load_adapter(name, str(path)).result().success
        outputs: list[list[int]] = [[] for _ in PROMPTS]
        params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):  # one at a time: later ones hit the prefix
            done = threading.Event()

            def sink(event, i=i, done=done) -> None:  # type: ignore[no-untyped-def]
                outputs[i].extend(event.token_ids)
                if event.finished:
                    done.set()

            engine.submit(f"r{i}", prompt, params, name if i % 2 else None, sink)
            assert done.wait(120), "a request did not finish"
        hits = sum(s[0] for s in engine.prefix_stats.values())
        replays = executor.runner.graphs.replays if executor.runner.graphs else 0
        return outputs, replays, hits
    finally:
        engine.stop()


def test_graph_decode_over_pages_and_cached_prefixes_equals_eager(suite) -> None:  # type: ignore[no-untyped-def]
    eager, _, eager_hits = _generate(suite, graphs=False)
    graphed, replays, hits = _generate(suite, graphs=True)
    assert replays > 0 and hits == eager_hits > 0  # PROMPTS[3] finds PROMPTS[1]'s (adapter)
    assert graphed == eager


def test_the_pool_takes_what_mem_fraction_leaves(suite) -> None:  # type: ignore[no-untyped-def]
    from loraplane.worker.engine.runner import ModelRunner, RunnerConfig

    model_dir, _ = suite["llama"]
    cfg = RunnerConfig(str(model_dir), device="cuda", max_seqs=4, max_len=64, mem_fraction=0.5)
    runner = ModelRunner(cfg)
    assert runner.kv.num_pages == 4 * 4  # plenty of memory: max_seqs full rows at most
    with pytest.raises(RuntimeError, match="--mem-fraction 1e-09 leaves"):
        ModelRunner(RunnerConfig(str(model_dir), device="cuda", mem_fraction=1e-9))
