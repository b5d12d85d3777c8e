"""GPU tier: launching a step never waits for the device (overlapped steps, ADR 0014).

The engine launches step N+1 and only then reads step N's tokens; a host-to-device copy from
pageable memory inside a launch (``torch.tensor(..., device="cuda")``, ``.to("cuda")``) first
waits for every kernel queued before it, so the host would stop preparing the next step while
the GPU runs this one. Each kind of step is launched behind a kernel that keeps the GPU busy
for ~300 ms, and must come back before that kernel ends: greedy and sampled (temperature,
top-k / top-p, seeded) rows, log probabilities of the sampled and of the prompt tokens, a
graph-replayed decode and an eager mixed step (a prompt chunk beside decodes), with and
without adapters. The tokens read afterwards must equal those of the same step run in turn.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

BUSY_MS = 300.0


def _executor(suite):  # type: ignore[no-untyped-def]
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.executor import LocalExecutor, SeqWork
    from loraplane.worker.engine.runner import RunnerConfig

    model_dir, adapters = suite["llama"]
    executor = LocalExecutor(
        RunnerConfig(str(model_dir), device="cuda", dtype="float32", max_seqs=8, max_len=64),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32),
    )
    for slot, (name, path) in enumerate(adapters[:2]):
        executor.read_adapter(0, name, str(path))
        executor.load_slot(slot, name)
    executor.loaded_slots([0, 1], wait=True)
    # the decode rows' first 10 positions written (their keys read as numbers, not whatever
    # the pool held)
    executor.step([[SeqWork(r, 0, tuple(range(1 + r, 11 + r)), r % 2) for r in range(4)]])
    return executor


def _steps():  # type: ignore[no-untyped-def]
    from loraplane.worker.engine.executor import SeqWork
    from loraplane.worker.engine.sampling import GREEDY, SamplingParams

    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    unseeded = SamplingParams(temperature=1.0)
    logprobs = SamplingParams(temperature=0.0, logprobs=3)
    prompt_scores = SamplingParams(temperature=0.0, prompt_logprobs=2, max_new_tokens=1)

    def decode(params, slots):  # type: ignore[no-untyped-def]
        return [
            SeqWork(r, 10, (5 + r,), s, p, index=3)
            for r, (s, p) in enumerate(zip(slots, params, strict=True))
        ]

    prompt = tuple(range(3, 23))
    return {
        "greedy decode (graph)": decode([GREEDY] * 4, [0, 1, -1, 0]),
        "sampled decode (graph)": decode([sampled, unseeded, GREEDY, sampled], [0, 1, -1, 0]),
        "logprobs decode (graph)": decode([logprobs, GREEDY, logprobs, GREEDY], [0, -1, 1, 0]),
        "mixed step, sampled": [
            *decode([sampled, GREEDY, unseeded], [0, -1, 1]),
            SeqWork(3, 0, prompt, 1, sampled),
        ],
        "mixed step, prompt logprobs": [
            *decode([GREEDY, logprobs], [-1, 0]),
            SeqWork(3, 0, prompt, 0, prompt_scores),
        ],
    }


@pytest.mark.parametrize("kind", list(_steps()))
def test_a_launch_does_not_wait_for_the_device(suite, kind: str) -> None:  # type: ignore[no-untyped-def]
    executor = _executor(suite)
    work = [_steps()[kind]]
    for _ in range(2):  # compiles, a graph capture, the allocator settled
        executor.launch(work, None).tokens()
    # an unseeded sampled row draws afresh each time: the other rows must match
    fixed = [i for i, w in enumerate(work[0]) if w.params.seed is not None or w.params.greedy]
    want = executor.launch(work, None)
    want_tokens, want_logprobs = want.tokens(), want.logprobs()
    torch.cuda.synchronize()

    torch.cuda._sleep(int(BUSY_MS * 1e-3 * 2e9))  # ~2 GHz SM clock: the GPU busy ~300 ms
    started = time.perf_counter()
    step = executor.launch(work, None)
    launch_ms = (time.perf_counter() - started) * 1e3
    still_busy = not torch.cuda.current_stream().query()
    tokens, logprobs = step.tokens(), step.logprobs()

    assert still_busy and launch_ms < BUSY_MS / 2, (
        f"{kind}: the launch took {launch_ms:.0f} ms behind a {BUSY_MS:.0f} ms kernel "
        f"(still running after it: {still_busy}): something in it waited for the device"
    )
    assert [tokens[i] for i in fixed] == [want_tokens[i] for i in fixed]
    assert logprobs == want_logprobs
