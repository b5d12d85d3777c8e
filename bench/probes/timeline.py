"""Probe: which kernels of the decode layer stack a side-stream LoRA slows down (CUDA only).

    python bench/probes/timeline.py OUT.json [BS] [ADAPTERS] [MODES]

Captures ``bench/probes/concurrency.py``'s layer stack in one CUDA graph per mode (default
``base,aside,residual``), replays it under ``torch.profiler`` and reads each kernel's start,
duration and stream from the trace. Prints, per mode, the step's span and each kernel name's
mean duration and calls per step, split by stream, so a base kernel that runs longer beside
the LoRA shows up next to its ``base`` row.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from concurrency import LAYERS, Layer, build_step, capture

REPLAYS = 5


def short(name: str) -> str:
    for key in ("nvjet", "gemm", "_lora_shrink", "_lora_expand", "_decode_attention"):
        if key in name:
            return name[:60]
    return name.split("<")[0][:60]


def trace(graph: torch.cuda.CUDAGraph) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [e for e in events if e.get("cat") == "kernel"]


def summarize(kernels: list[dict]) -> dict:
    kernels.sort(key=lambda e: e["ts"])
    streams = collections.Counter(e["args"].get("stream") for e in kernels)
    main_stream = streams.most_common(1)[0][0]
    per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for e in kernels:
        where = "main" if e["args"].get("stream") == main_stream else "side"
        per[(where, short(e["name"]))].append(e["dur"])
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / REPLAYS
    rows = {
        f"{where}:{name}": {
            "mean_us": round(statistics.mean(d), 2),
            "per_step": len(d) / REPLAYS,
            "us_per_step": round(sum(d) / REPLAYS, 1),
        }
        for (where, name), d in sorted(per.items(), key=lambda kv: -sum(kv[1]))
    }
    busy = sum(e["dur"] for e in kernels if e["args"].get("stream") == main_stream) / REPLAYS
    return {"span_us_per_step": round(span, 1), "main_busy_us": round(busy, 1), "kernels": rows}


def main(out_path: str, bs: int = 64, n_ad: int = 1, modes: str = "base,aside,residual") -> None:
    torch.manual_seed(0)
    slots = 4
    layers = [Layer(slots, "cuda") for _ in range(LAYERS)]
    side = torch.cuda.Stream()
    step = build_step(layers, side, slots, bs, n_ad)
    out = {"probe": "timeline", "bs": bs, "adapters": n_ad, "layers": LAYERS, "modes": {}}
    for mode in modes.split(","):
        graph = capture(step, mode)
        out["modes"][mode] = summarize(trace(graph))
        m = out["modes"][mode]
        print(mode, "span", m["span_us_per_step"], "main busy", m["main_busy_us"], flush=True)
        for name, row in list(m["kernels"].items())[:14]:
            print(f"   {name:70s} {row['mean_us']:8.2f} us x{row['per_step']:.0f}")
        del graph
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0],
        int(args[1]) if len(args) > 1 else 64,
        int(args[2]) if len(args) > 2 else 1,
        args[3] if len(args) > 3 else "base,aside,residual",
    )
