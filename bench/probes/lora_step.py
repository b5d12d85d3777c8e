"""Probe: what many distinct adapters cost a decode step and a mixed step, by stage width.

    python bench/probes/lora_step.py [OUT.json] [--layers 8] [--counts 0,4,16,32] [--stage-slots 4,32]

A serving run at K = 32 slots (`bench/results/2026-12-05-h200-prompt-graphs/serve_k32.json`)
kept 0.67 of the base's out tok/s with 32 adapters in use, while the adapters' weights are a
small share of a step's bytes: its decode steps took 4.6 ms against 3.1 ms, its mixed steps
30 ms against 10.5-13.8 ms. A batch of more adapters than stage positions (``lora/stage.py``,
``--stage-slots``, 4 on a dense model) runs a shrink and an expand kernel per projection;
a batch the stage holds runs each projection as one GEMM with the expand fused after it.

This builds one executor (`LocalExecutor`) per ``--stage-slots`` value on the dense 8B shape
at ``--layers`` layers, 32 slots of rank-16 adapters on all seven targets, and times from
their CUDA graphs, with the rows spread round-robin over ``--counts`` distinct adapters
(0: the base):

- ``decode_ms``: 48 one-token rows (a decode graph);
- ``mixed_ms``: the 48 rows and 3 prompt chunks of 256 tokens (a prompt-step graph; each
  chunk under an adapter of its own when there are adapters).

Then it profiles the decode and the mixed step of the largest count (``--profile``: these) at each stage width
(CUDA kernels by total device time). One JSON object on stdout (``--out`` too), the tables on stderr. Runs on
the CPU too (slowly, the Triton kernels under the interpreter), to check it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.engine.executor import LocalExecutor, SeqWork
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.lora.manager import LoRARuntimeConfig

DECODE_ROWS, CONTEXT, PROMPT, PROMPTS, SLOTS = 48, 300, 256, 3, 32


def _pages(row: int, positions: int) -> tuple[int, ...]:
    """Row ``row``'s pages for ``positions`` positions (pages of 16, 64 pages a row)."""
    return tuple(range(row * 64, row * 64 + -(-positions // 16)))


def work(adapters: int, mixed: bool) -> list[list[SeqWork]]:
    """48 decode rows over ``adapters`` distinct slots (round-robin; 0: none), then 3 prompt
    chunks when ``mixed``."""

    def slot(i: int) -> int:
        return i % adapters if adapters else -1

    rows = [
        SeqWork(r, CONTEXT, (5,), slot(r), index=1, pages=_pages(r, CONTEXT + 1))
        for r in range(DECODE_ROWS)
    ]
    if mixed:
        prompt = tuple(3 + i % 200 for i in range(PROMPT))
        for j in range(PROMPTS):
            row = DECODE_ROWS + j
            rows.append(SeqWork(row, 0, prompt, slot(j), pages=_pages(row, PROMPT)))
    # the engine's row order: no adapter first, then by slot
    rows.sort(key=lambda w: w.slot)
    return [rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="also write the JSON here")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--counts", default="0,4,16,32", help="distinct adapters per step, a list")
    p.add_argument("--stage-slots", default="4,32", help="stage positions to compare, a list")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/loraplane-lora-step"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--profile",
        default=None,
        help="the counts whose decode and mixed steps to profile, a list (default: the largest)",
    )
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    stages = [int(s) for s in args.stage_slots.split(",")]
    profiled = [int(c) for c in args.profile.split(",")] if args.profile else [max(counts)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from loraplane.worker.bench.serve import make_fixtures

    model, adapters = make_fixtures("dense", args.workdir, args.layers, max(max(counts), 1))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out: dict[str, Any] = {
        "probe": "lora_step",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layers": args.layers,
        "decode_rows": DECODE_ROWS,
        "prompt_chunks": f"{PROMPTS} x {PROMPT}",
        "slots": SLOTS,
        "rows": [],
    }
    for positions in stages:
        executor = LocalExecutor(
            RunnerConfig(str(model), device=device, max_seqs=64, max_len=1024),
            LoRARuntimeConfig(
                max_loras_per_batch=SLOTS,
                max_loaded_loras=SLOTS,
                max_lora_rank=16,
                stage_slots=positions,
            ),
        )
        for slot, path in enumerate(adapters):
            executor.read_adapter(0, f"a{slot}", str(path))
            executor.load_slot(slot, f"a{slot}")

        def step_ms(rows: list[list[SeqWork]], ex: LocalExecutor = executor) -> float:
            for _ in range(3):  # compiles, graph captures, stage copies
                ex.step(rows)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ex.step(rows)
            sync()
            return round((time.perf_counter() - t0) / args.steps * 1e3, 3)

        for n in counts:
            row = {
                "stage_slots": positions,
                "adapters": n,
                "decode_ms": step_ms(work(n, False)),
                "mixed_ms": step_ms(work(n, True)),
            }
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            for count, mixed in [(c, m) for c in profiled for m in (False, True)]:
                rows = work(count, mixed)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        executor.step(rows)
                    sync()
                kind = "mixed" if mixed else "decode"
                print(
                    f"--- stage_slots {positions}, {count} adapters, {kind} x 5",
                    file=sys.stderr,
                )
                print(
                    prof.key_averages().table(
                        sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70
                    ),
                    file=sys.stderr,
                )
        del executor
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(out)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
