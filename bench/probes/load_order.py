"""Probe: do the shrink and expand wait on their row gathers? (CUDA only)

    python bench/probes/load_order.py OUT.json

Nsight Compute (session 13) shows the decode shrink and expand latency-bound: few warps per
scheduler, most of them waiting on memory, DRAM under half busy. A program's loads form a
chain: its segment's bounds and slot, then ``row_order`` (which rows), then x (shrink) or
out (expand); the weights need only the slot, but the kernels issued them after the row
loads. This times, per case (``shrink_tune.build``):

- ``*_gather``: tokens interleaved over the adapters, rows gathered through ``row_order``
  (what the kernel bench and the decode graphs run), and ``*_grouped``: tokens already in
  adapter order (dense: no ``row_order``, one round trip fewer);
- ``_wfirst``: the weight loads issued before the row-dependent ones
  (``shrink.A_FIRST``: A before x in each K step; ``expand.B_FIRST``: with one slice, B and
  y before out),

each graph-timed from cold L2 next to a device copy of the same bytes. Prints one JSON line
per case and writes them all to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from shrink_tune import build

from loraplane.worker.bench.common import copy_bandwidth, copy_of, time_graph
from loraplane.worker.kernels import expand, shrink

CASES = [
    ("down", 128, 64, 16),
    ("qkv", 128, 64, 16),
    ("gate_up", 128, 64, 16),
    ("o", 128, 64, 16),
    ("down", 16, 16, 4),
    ("down", 128, 16, 16),
    ("gate_up", 128, 16, 4),
    ("moe_down", 128, 64, 16),
    ("moe_gate_up", 128, 16, 16),
    ("moe_down", 16, 16, 4),
]


def main(out_path: str) -> None:
    peak = copy_bandwidth("cuda")["gbytes_per_s"]
    rows: list[dict[str, Any]] = []
    for case in CASES:
        row: dict[str, Any] = dict(zip(("module", "tokens", "rank", "adapters"), case, strict=True))
        for grouped in (False, True):
            tag = "grouped" if grouped else "gather"
            shrink_fn, expand_fn, s_bytes, e_bytes = build(*case, grouped=grouped)
            row.update(shrink_bytes=s_bytes, expand_bytes=e_bytes)
            for first in (False, True):
                shrink.A_FIRST = expand.B_FIRST = first
                suffix = "_wfirst" if first else ""
                row[f"shrink_{tag}{suffix}"] = round(time_graph(shrink_fn, "cuda") or 0.0, 2)
                row[f"expand_{tag}{suffix}"] = round(time_graph(expand_fn, "cuda") or 0.0, 2)
            shrink.A_FIRST = expand.B_FIRST = False
        for kind, nbytes in (("shrink", s_bytes), ("expand", e_bytes)):
            copy_us = time_graph(copy_of(nbytes, "cuda"), "cuda") or 0.0
            row[f"{kind}_copy"] = round(copy_us, 2)
            row[f"{kind}_copy_pct"] = round(100 * nbytes / copy_us / 1e3 / peak, 1)
            row[f"{kind}_gather_pct"] = round(100 * nbytes / row[f"{kind}_gather"] / 1e3 / peak, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out_path, "w") as f:
            json.dump(
                {
                    "probe": "load_order",
                    "gpu": torch.cuda.get_device_name(),
                    "commit": os.environ.get("LORAPLANE_COMMIT"),
                    "peak_gbs": peak,
                    "rows": rows,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
