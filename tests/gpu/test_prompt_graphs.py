"""GPU tier: prompt steps replayed from CUDA graphs (engine/prompt_graphs.py) against eager ones.

Two runners of one fixture, one with graphs (decode and prompt steps) and one without, run
the same steps: prefills, then mixed steps (a new prompt and a prompt chunk past a cached
prefix beside running decodes) with adapters, base rows, and an adapter loaded after the
captures, each layout twice so that a graph replays with new contents. fp32, so any
difference beyond the kernels' summation order is a bug. Runs through the device tool
(scripts/gpu-numerics.sh).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

LONG = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]


def _runner(suite, arch: str, graphs: bool):  # type: ignore[no-untyped-def]
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.runner import ModelRunner, RunnerConfig

    model_dir, adapters = suite[arch]
    cfg = RunnerConfig(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_seqs=8,
        max_len=64,
        cuda_graphs=graphs,
        graph_max_tokens=128,
    )
    lora = LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    runner = ModelRunner(cfg, lora)
    for slot, (name, path) in enumerate(adapters[:2]):
        runner.lora.load_slot(slot, runner.read_adapter(name, path))
    return runner, adapters


def _steps(runner, per_chunk: list[int], salt: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A prefill of rows 0, 1 and LONG's first 4 tokens in row 3, then two mixed steps:
    row 0's and row 1's decodes beside a new prompt in row 2 and LONG's next chunk in row 3."""
    from loraplane.worker.engine.runner import prefill_batch
    from loraplane.worker.models.batch import ForwardBatch, SeqChunk

    p0, p1 = [5 + salt, 9, 200], [44, 2 + salt]
    first = [per_chunk[0]] * 3 + [per_chunk[2]] * 2 + [per_chunk[3]] * 4
    logits = runner.forward(
        prefill_batch([p0, p1, LONG[:4]], [0, 1, 3], all_logits=False, device="cuda"), first
    )
    out = [logits.float().cpu()]
    ids = logits.argmax(-1).tolist()
    start3 = 4
    for step in range(2):
        prompt = [7 + step + salt, 7, 7, 8, 21]
        chunk = LONG[start3 : start3 + 6]
        tokens = [[ids[0]], prompt, [ids[1]], chunk]
        chunks = [
            SeqChunk(0, 3 + step, 1, 0),
            SeqChunk(2, 0, 5, 1),
            SeqChunk(1, 2 + step, 1, 6),
            SeqChunk(3, start3, 6, 7),
        ]
        batch = ForwardBatch.from_chunks(tokens, chunks, all_logits=False, device="cuda")
        slots = [s for s, t in zip(per_chunk, tokens, strict=True) for _ in t]
        logits = runner.forward(batch, slots)
        out.append(logits.float().cpu())
        ids = [logits[0].argmax().item(), logits[2].argmax().item()]
        start3 += 6
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_prompt_graphs_match_eager_prompt_steps(suite, arch: str) -> None:  # type: ignore[no-untyped-def]
    graph_runner, adapters = _runner(suite, arch, graphs=True)
    eager_runner, _ = _runner(suite, arch, graphs=False)
    assert graph_runner.prompt_graphs is not None and eager_runner.prompt_graphs is None
    layouts = ([0, -1, 1, 0], [1, 1, -1, 1], [-1, -1, -1, -1], [0, -1, 1, 0])
    for salt, per_chunk in enumerate(layouts):
        want = _steps(eager_runner, per_chunk, salt)
        got = _steps(graph_runner, per_chunk, salt)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{per_chunk} step {step}")
    graphs = graph_runner.prompt_graphs
    assert graphs.replays == 3 * len(layouts)
    assert all(g.graph is not None for g in graphs._graphs.values())  # captured, not eager
    # (bucket, adapters' class), each LoRA graph staged: the step's adapters fit the stage
    assert {(b, s[0] if s else None) for b, s in graphs.keys} == {(64, 2), (64, 1), (64, None)}
    assert all(s is None or s[1] > 0 for _, s in graphs.keys), graphs.keys
    # An adapter loaded after the captures: the graphs read the slot buffers in place.
    for r in (graph_runner, eager_runner):
        name, path = adapters[2]
        r.lora.load_slot(0, r.read_adapter(name, path))
    want = _steps(eager_runner, [0, 1, 0, -1], 9)
    got = _steps(graph_runner, [0, 1, 0, -1], 9)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_prompt_step_past_the_largest_bucket_runs_eagerly(suite) -> None:  # type: ignore[no-untyped-def]
    from loraplane.worker.engine.runner import prefill_batch

    runner, _ = _runner(suite, "llama", graphs=True)
    prompts = [[1 + i] * 60 for i in range(3)]  # 180 tokens: past the 128 bucket
    want_graph = runner.prompt_graphs.replays
    runner.forward(prefill_batch(prompts, [0, 1, 2], all_logits=False, device="cuda"))
    assert runner.prompt_graphs.replays == want_graph
    runner.forward(
        prefill_batch([p[:30] for p in prompts], [0, 1, 2], all_logits=False, device="cuda")
    )
    assert runner.prompt_graphs.replays == want_graph + 1
