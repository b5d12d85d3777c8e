"""Probe: idle time inside a decode graph's replay, LoRA off against one adapter.

    python bench/probes/graph_gaps.py OUT.json [--shape llama3-8b] [--layers 8]
        [--batch-sizes 128] [--variants off,1]

Where a graph replay's time goes beyond its kernels: a one-adapter dense graph at bs 128
replayed ~100 µs slower than LoRA-off (``graph_host.py``) while its kernels summed only ~30 µs
more (``--profile-graphs``), which would leave the device idling between kernels. This profiles 3 graph steps per variant and,
from the kernels' start and end times (torch.profiler / CUPTI, one profile per step, the
step's copies and sampling included), reports per step:
``span_us`` (first kernel's start to last kernel's end), ``busy_us`` (the union of kernel
intervals, so kernels overlapped on two streams count once), ``idle_us`` (span - busy) and
the eight longest idle gaps with the kernels around them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from loraplane.worker.bench import decode
from loraplane.worker.bench.common import env_info

STEPS = 3


def _gaps(kernels: list[tuple[float, float, str]]) -> dict[str, Any]:
    """Span, busy time and idle gaps of one step's kernels (start, end, name; µs)."""
    if not kernels:
        raise RuntimeError("the profiler recorded no kernel (is CUPTI available?)")
    kernels.sort()
    busy, gaps = 0.0, []
    end, end_name = kernels[0][0], ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, end_name[:60], name[:60]))
            busy += stop - start
            end, end_name = stop, name
        elif stop > end:
            busy += stop - end
            end, end_name = stop, name
    gaps.sort(reverse=True)
    span = end - kernels[0][0]
    return {
        "span_us": round(span, 1),
        "busy_us": round(busy, 1),
        "idle_us": round(span - busy, 1),
        "longest_gaps": [{"us": round(g, 1), "after": x, "before": y} for g, x, y in gaps[:8]],
    }


def main(argv: list[str] | None = None) -> int:
    p = decode.probe_parser(__doc__, "128")
    p.add_argument("--variants", default="off,1")
    args = p.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    bss = [int(b) for b in args.batch_sizes.split(",")]
    variants = args.variants.split(",")
    config = decode.model_config(args.shape, args.layers, dtype)
    runner, switch = decode.bench_runner(config, device, max(bss), args.context + 64, 4)
    graphs: dict[str, Any] = {}
    result: dict[str, Any] = {"env": env_info(device), "settings": vars(args) | {"out": None}}
    with torch.inference_mode():
        for bs in bss:
            for v in variants:
                with decode._active(runner, switch, graphs, bs, v, "graph") as slots:
                    for s in range(4):
                        decode._step(runner, bs, slots, args.context, s)
                    steps = []
                    for s in range(STEPS):  # one profile per step: no host gap between steps
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            decode._step(runner, bs, slots, args.context, 4 + s)
                        steps.append(
                            _gaps(
                                [
                                    (e.time_range.start, e.time_range.end, e.name)
                                    for e in prof.events()
                                    if e.device_type == torch.autograd.DeviceType.CUDA
                                ]
                            )
                        )
                result[f"bs{bs}_{v}"] = {
                    "median_idle_us": sorted(x["idle_us"] for x in steps)[STEPS // 2],
                    "median_busy_us": sorted(x["busy_us"] for x in steps)[STEPS // 2],
                    "steps": steps,
                }
                print(bs, v, json.dumps(result[f"bs{bs}_{v}"])[:400], flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
