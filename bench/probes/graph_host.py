"""Probe: how much of a graph decode step is the graph itself, and how much the host around it.

    python bench/probes/graph_host.py OUT.json [--shape llama3-8b] [--layers 8]
        [--batch-sizes 16,128] [--steps 40]

Per variant (``off``, ``none``, ``1``, ``4``) and batch size, graphs on:

- ``step_ms``: the decode bench's step (``decode._step``: host inputs, ``runner.forward``
  with its graph replay, argmax, ``tolist``), median of ``--steps``;
- ``replay_ms``: the same variant's captured graph replayed ``--steps`` times back to back,
  timed by CUDA events (device time with its launch gaps, no host work in between);
- ``host_ms``: ``step_ms - replay_ms``, the part of a step the device waits for the host
  (or the host for the device's read-back).

The variants take turns step by step, as in the decode bench's ``--order step``. A ratio
that differs between ``step_ms`` and ``replay_ms`` says the host's share moved it.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import torch

from loraplane.worker.bench import decode
from loraplane.worker.bench.common import env_info

VARIANTS = ("off", "none", "1", "4")


def main(argv: list[str] | None = None) -> int:
    p = decode.probe_parser(__doc__, "16,128")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    bss = [int(b) for b in args.batch_sizes.split(",")]
    config = decode.model_config(args.shape, args.layers, dtype)
    max_len = args.context + len(VARIANTS) * (args.steps + 4) + 8
    runner, switch = decode.bench_runner(config, device, max(bss), max_len, 4)
    graphs: dict[str, Any] = {}
    result: dict[str, Any] = {"env": env_info(device), "settings": vars(args) | {"out": None}}

    def step(bs: int, variant: str, s: int) -> float:
        with decode._active(runner, switch, graphs, bs, variant, "graph") as slots:
            return decode._step(runner, bs, slots, args.context, s) * 1e3

    def replay_ms(bs: int, variant: str) -> float:
        dg = graphs[variant]
        shape = dg._last_shape if variant != "off" else None
        graph = dg._graphs[(dg.bucket_for(bs), shape)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / args.steps

    with torch.inference_mode():
        for bs in bss:
            s = 0
            for v in VARIANTS:
                for _ in range(4):
                    step(bs, v, s)
                    s += 1
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.steps):
                for v in VARIANTS:
                    times[v].append(step(bs, v, s))
                s += 1
            row: dict[str, Any] = {}
            for v in VARIANTS:
                step_ms = statistics.median(times[v])
                with decode._active(runner, switch, graphs, bs, v, "graph"):
                    replay = statistics.median(replay_ms(bs, v) for _ in range(3))
                row[v] = {
                    "step_ms": round(step_ms, 4),
                    "replay_ms": round(replay, 4),
                    "host_ms": round(step_ms - replay, 4),
                }
            for v in VARIANTS[1:]:
                row[v]["step_ratio"] = round(row["off"]["step_ms"] / row[v]["step_ms"], 4)
                row[v]["replay_ratio"] = round(row["off"]["replay_ms"] / row[v]["replay_ms"], 4)
            result[f"bs{bs}"] = row
            print(bs, json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
