"""GPU tier: the whole engine (scheduler, executor, runner) with CUDA-graph decode vs eager.

Requests with different adapters (and none) arrive while others decode, so steps mix prefill
and decode, batches grow and shrink through graph buckets, and adapters change per step. With
fp32 fixtures, greedy outputs must be identical with and without graphs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8], [90, 1], [3, 4, 5], [17, 18], [6] * 7]


def _generate(suite, arch: str, graphs: bool) -> tuple[list[list[int]], int]:  # type: ignore[no-untyped-def]
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.engine import Engine
    from loraplane.worker.engine.executor import LocalExecutor
    from loraplane.worker.engine.runner import RunnerConfig
    from loraplane.worker.engine.sampling import SamplingParams
    from loraplane.worker.engine.tokenizer import TextTokenizer

    model_dir, adapters = suite[arch]
    runner_cfg = RunnerConfig(
        str(model_dir), device="cuda", dtype="float32", max_seqs=8, max_len=64, cuda_graphs=graphs
    )
    lora = LoRARuntimeConfig(max_loras_per_batch=3, max_loaded_loras=3, max_lora_rank=32)
    executor = LocalExecutor(runner_cfg, lora)
    engine = Engine(
        executor,
        TextTokenizer(str(model_dir)),
        max_loras_per_batch=3,
        max_loaded_loras=3,
        max_running=8,
        max_model_len=64,
    )
    engine.start()
    try:
        names = []
        for name, path in adapters[:3]:
            assert engine.load_adapter(name, path).result().success
            names.append(name)
        outputs: list[list[int]] = [[] for _ in PROMPTS]
        done = [threading.Event() for _ in PROMPTS]

        def sink_for(i: int):  # type: ignore[no-untyped-def]
            def sink(event) -> None:  # type: ignore[no-untyped-def]
                outputs[i].extend(event.token_ids)
                if event.finished:
                    done[i].set()

            return sink

        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            adapter = None if i % 4 == 3 else names[i % 3]
            engine.submit(f"r{i}", prompt, params, adapter, sink_for(i))
            time.sleep(0.02 * (i % 3))  # arrivals while others decode
        for event in done:
            assert event.wait(120), "a request did not finish"
        graphs_used = executor.runner.graphs.replays if executor.runner.graphs else 0
        return outputs, graphs_used
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_engine_outputs_are_the_same_with_and_without_graphs(suite, arch: str) -> None:  # type: ignore[no-untyped-def]
    with_graphs, replays = _generate(suite, arch, graphs=True)
    eager, none = _generate(suite, arch, graphs=False)
    assert replays > 0 and none == 0
    assert all(len(o) == 12 for o in eager)
    assert with_graphs == eager


def test_tokens_picked_on_the_device() -> None:
    """``step_result`` picks tokens where the logits are, bf16 on the GPU: a greedy row's is
    the host's argmax over the fp32 copy (the engine's path before), ties included; sampled
    rows follow their softmax; a seeded row's token does not depend on the rows beside it."""
    from loraplane.worker.engine.executor import SeqWork, step_result
    from loraplane.worker.engine.sampling import SamplingParams

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(128, 151936, device="cuda", generator=gen).to(torch.bfloat16)
    logits[5, 1000] = logits[5, 90000] = 30.0  # a tie: the first index
    work = [SeqWork(i, 0, (1,)) for i in range(128)]
    result = step_result(logits, work)
    assert result.tokens == logits.float().cpu().argmax(-1).tolist()
    assert result.tokens[5] == 1000
    # 128 rows of one distribution over 4 tokens (the rest at -inf), 16 steps: 2048 draws
    four = torch.full((128, 151936), float("-inf"), device="cuda")
    four[:, :4] = torch.tensor([0.5, 0.3, 0.15, 0.05], device="cuda").log()
    params = SamplingParams(temperature=1.0, top_p=0.99, top_k=100)
    draws = [
        t
        for k in range(16)
        for t in step_result(
            four.bfloat16(), [SeqWork(i, 0, (1,), params=params, index=k) for i in range(128)]
        ).tokens
    ]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert (freq - torch.tensor([0.5, 0.3, 0.15, 0.05])).abs().max() < 0.04, freq
    # a seeded row draws the same token alone as among 127 others, over flat logits (the
    # whole vocabulary) and over peaked ones (its best candidates)
    for scale in (1.0, 3.0):
        rows = (logits.float() * scale).bfloat16()
        seeded = [
            replace(w, params=SamplingParams(temperature=1.0, top_p=0.9, seed=i))
            for i, w in enumerate(work)
        ]
        batched = step_result(rows, seeded).tokens
        alone = [step_result(rows[i : i + 1], [seeded[i]]).tokens[0] for i in (0, 6, 77)]
        assert alone == [batched[i] for i in (0, 6, 77)]
