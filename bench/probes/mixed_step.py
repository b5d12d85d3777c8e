"""Probe: where a mixed step's time goes (prompt chunks beside running decodes), eager and from its graph.

    python bench/probes/mixed_step.py [OUT.json] [--layers 4] [--model DIR]

A serving run on an H100 (`bench/results/2026-12-05-h100-serve/serve_k32_base.json`) found
the engine's core at a full CPU core with the GPU busy 0.80 of the time: mixed steps, which
run eagerly (no CUDA graph pads a prompt chunk), took 23.6 ms each at 16 layers against
3.6 ms for a decode step from its graph, so 10 % of the steps held 43 % of the time. This
runs one executor (`LocalExecutor`, the serving worker's one-rank executor) on the dense 8B
shape at ``--layers`` layers (`bench serve`'s fixture; ``--model`` for another checkpoint)
and times, with and without LoRA (2 adapters over the rows):

- ``mixed_ms``: 48 decode rows and ``--prompts`` 256-token prompt chunks (3: what a mixed
  step of that serving run held on average), eager;
- ``mixed_graph_ms``: the same step replayed from its prompt-step graph
  (``engine/prompt_graphs.py``; absent where the step is past ``--graph-max-tokens``);
- ``decode_ms``: the 48 decode rows alone (from their CUDA graph on a GPU);
- ``*_launch_ms``: the host's time to launch the same step (forward and sampling, not read
  back): where it is close to the whole step's time, the host sets the pace.

Then it profiles five LoRA mixed steps (``torch.profiler``, CPU and CUDA) and prints the ops
with the most host time: a ``cudaStreamSynchronize`` or ``cudaMemcpy`` per layer, or many
small launches per layer, shows where the host time goes. One JSON object first, then the
table. Runs on the CPU too (slowly, the Triton kernels under the interpreter), to check it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.engine.executor import LocalExecutor, SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.lora.manager import LoRARuntimeConfig

DECODE_ROWS, CONTEXT, PROMPT = 48, 300, 256


def _pages(row: int, positions: int) -> tuple[int, ...]:
    """Row ``row``'s pages for ``positions`` positions (pages of 16, 64 pages a row)."""
    return tuple(range(row * 64, row * 64 + -(-positions // 16)))


def work(mixed: bool, lora: bool, prompts: int = 1) -> list[list[SeqWork]]:
    rows = [
        SeqWork(r, CONTEXT, (5,), r % 2 if lora else -1, index=1, pages=_pages(r, CONTEXT + 1))
        for r in range(DECODE_ROWS)
    ]
    if mixed:
        prompt = tuple(3 + i % 200 for i in range(PROMPT))
        for j in range(prompts):
            row = DECODE_ROWS + j
            rows.append(SeqWork(row, 0, prompt, -1, pages=_pages(row, PROMPT)))
    return [rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="also write the JSON here")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", type=Path, help="a checkpoint (default: the dense 8B shape)")
    p.add_argument("--adapters", type=Path, nargs=2, help="two adapters of --model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/loraplane-mixed-step"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=3, help="256-token prompt chunks a mixed step")
    p.add_argument(
        "--graph-max-tokens", type=int, default=1024, help="the largest prompt step with a graph"
    )
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        from loraplane.worker.bench.serve import make_fixtures

        model, adapters = make_fixtures("dense", args.workdir, args.layers, 2)
    else:
        if args.adapters is None:
            p.error("--model needs --adapters A B")
        model, adapters = args.model, list(args.adapters)
    executor = LocalExecutor(
        RunnerConfig(
            str(model),
            device=device,
            max_seqs=64,
            max_len=1024,
            graph_max_tokens=args.graph_max_tokens,
        ),
        LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=16),
    )
    for slot, path in enumerate(adapters):
        executor.read_adapter(0, f"a{slot}", str(path))
        executor.load_slot(slot, f"a{slot}")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step_ms(mixed: bool, lora: bool) -> tuple[float, float]:
        """(the whole step, its launch on the host), ms."""
        rows = work(mixed, lora, args.prompts)
        for _ in range(3):  # compiles, graph captures
            executor.step(rows)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            executor.step(rows)
        sync()
        whole = (time.perf_counter() - t0) / args.steps
        launch = 0.0
        for _ in range(args.steps):
            t1 = time.perf_counter()
            executor.launch(rows, None)
            launch += time.perf_counter() - t1
            sync()
        return round(whole * 1e3, 3), round(launch / args.steps * 1e3, 3)

    out: dict[str, Any] = {
        "probe": "mixed_step",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layers": executor.model_config.num_layers,
        "decode_rows": DECODE_ROWS,
        "prompt_tokens": PROMPT,
        "prompts": args.prompts,
    }

    def allocator() -> dict[str, int]:
        """The caching allocator's device allocations and retries over the probe (a retry frees cached
        blocks, which waits for the device)."""
        if device != "cuda":
            return {}
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_alloc_retries")}

    before = allocator()
    out["prompt_graph_buckets"] = list(executor.prompt_graph_buckets)
    for lora in (False, True):
        suffix = "_lora" if lora else ""
        executor.use_prompt_graphs(False)
        out[f"mixed_ms{suffix}"], out[f"mixed_launch_ms{suffix}"] = step_ms(True, lora)
        if executor.prompt_graph_buckets:
            executor.use_prompt_graphs(True)
            graph = step_ms(True, lora)
            out[f"mixed_graph_ms{suffix}"], out[f"mixed_graph_launch_ms{suffix}"] = graph
        out[f"decode_ms{suffix}"], out[f"decode_launch_ms{suffix}"] = step_ms(False, lora)
    after = allocator()
    out["allocator"] = {k: after[k] - before[k] for k in after}
    text = json.dumps(out)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    executor.use_prompt_graphs(False)  # (the eager step's host time)
    with profile(activities=activities) as prof:
        for _ in range(5):
            executor.step(work(True, True, args.prompts))
        sync()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
