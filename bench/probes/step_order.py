"""Probe: does a decode step's time depend on which variant ran the step before it?

    python bench/probes/step_order.py OUT.json [--shape llama3-8b] [--layers 8]
        [--batch-sizes 16,128] [--block 6] [--rounds 6]

With the decode bench's variants interleaved step by step (``--order step``), the ``none``
rows, which replay a graph of the same LoRA-off kernels as ``off``, can read 0.97-0.99 instead
of 1.00. This probe times single steps (``decode._step``, graphs on) in two
patterns over the variants ``head``, ``off``, ``none`` and ``1``:

- ``blocks``: each variant runs ``--block`` steps in a row, variants in turn, ``--rounds``
  times; per variant, the median time of the i-th step of its blocks (``by_position``), so a
  cost paid by the first step(s) after a switch shows at positions 0, 1, ...;
- ``alternate``: ``off`` and ``none`` alternate step by step (both LoRA-off graphs), and
  ``off_after_off``: ``off`` repeated; medians.

Prints and writes one JSON object (ms). ``--device cpu`` is a smoke run of eager steps
(set ``TRITON_INTERPRET=1`` there). Reads nothing but the device; the model is built in
memory as in the decode bench.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import torch

from loraplane.worker.bench import decode
from loraplane.worker.bench.common import env_info

VARIANTS = ("head", "off", "none", "1")


def main(argv: list[str] | None = None) -> int:
    p = decode.probe_parser(__doc__, "16,128")
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--device", default="cuda", help="cuda (graphs), or cpu (eager: a smoke run)")
    args = p.parse_args(argv)
    device = args.device
    dtype, mode = (torch.bfloat16, "graph") if device == "cuda" else (torch.float32, "eager")
    bss = [int(b) for b in args.batch_sizes.split(",")]
    config = decode.model_config(args.shape, args.layers, dtype)
    steps = 3 * len(VARIANTS) + args.rounds * args.block * (len(VARIANTS) + 3)
    runner, switch = decode.bench_runner(config, device, max(bss), args.context + steps + 8, 1)
    graphs: dict[str, Any] = {}
    result: dict[str, Any] = {
        "env": env_info(device),
        "settings": vars(args) | {"out": None, "mode": mode},
    }

    def run(bs: int, variant: str, s: int) -> float:
        with decode._active(runner, switch, graphs, bs, variant, mode) as slots:
            return decode._step(runner, bs, slots, args.context, s) * 1e3

    with torch.inference_mode():
        for bs in bss:
            s = 0
            for v in VARIANTS:  # captures and one-time costs
                for _ in range(3):
                    run(bs, v, s)
                    s += 1
            by_pos: dict[str, list[list[float]]] = {
                v: [[] for _ in range(args.block)] for v in VARIANTS
            }
            for _ in range(args.rounds):
                for v in VARIANTS:
                    for i in range(args.block):
                        by_pos[v][i].append(run(bs, v, s))
                        s += 1
            alternate: dict[str, list[float]] = {"off": [], "none": [], "off_after_off": []}
            for _ in range(args.rounds * args.block):
                alternate["off"].append(run(bs, "off", s))
                alternate["none"].append(run(bs, "none", s + 1))
                s += 2
            for _ in range(args.rounds * args.block):
                alternate["off_after_off"].append(run(bs, "off", s))
                s += 1
            result[f"bs{bs}"] = {
                "by_position": {
                    v: [round(statistics.median(t), 4) for t in ts] for v, ts in by_pos.items()
                },
                "alternate": {k: round(statistics.median(t), 4) for k, t in alternate.items()},
            }
            print(bs, json.dumps(result[f"bs{bs}"]), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
