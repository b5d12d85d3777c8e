"""Probe: the decode shrink's time against its K-split cap (CUDA only).

    python bench/probes/shrink_split.py OUT.json [CAPS]

Since the shrink sums its own split-K partials (its last program per tile), more splits no
longer make every expand column block re-read them; this measures what the cap should be.
Llama-3-8B-shaped projections, rank 16, 1 and 4 adapters, 16/64/128 decode tokens; each
shrink and shrink + expand graph-timed from cold L2 (``bench.common.time_graph``) at caps
``CAPS`` (default 4,8,16,32). Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from loraplane.worker import kernels
from loraplane.worker.bench.common import time_graph

# name: (K, slice widths)
MODULES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
R = 16


def _apply(shrink: Callable[[], Any], out: torch.Tensor) -> None:
    shrink().expand_into(out)


def main(out_path: str, caps: list[int]) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    rows = []
    for name, (k, widths) in MODULES.items():
        offs = [0]
        for w in widths:
            offs.append(offs[-1] + w)
        slots = 4
        a = torch.randn(slots, len(widths) * R, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(slots, offs[-1], R, device=dev, dtype=torch.bfloat16)
        offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        for tokens in (16, 64, 128):
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            out = torch.zeros(tokens, offs[-1], device=dev, dtype=torch.bfloat16)
            for n_ad in (1, 4):
                per = tokens // n_ad
                indptr = torch.tensor(
                    [i * per for i in range(n_ad + 1)], dtype=torch.int32, device=dev
                )
                seg_slots = torch.arange(n_ad, dtype=torch.int32, device=dev)
                ranks = torch.full((slots,), R, dtype=torch.int32, device=dev)
                scal = torch.full((slots,), 2.0, dtype=torch.float32, device=dev)
                seg = (indptr, seg_slots, ranks, scal, None, offsets, per)
                by_seg = {"seg_ranks": ranks[:n_ad].clone(), "seg_scalings": scal[:n_ad].clone()}
                row: dict[str, object] = {"module": name, "tokens": tokens, "adapters": n_ad}
                args = (x, a, b, *seg)
                for cap in caps:
                    shrink = partial(kernels.lora_apply_shrink, *args, **by_seg, max_split_k=cap)
                    row[f"shrink_us@{cap}"] = round(time_graph(shrink, dev) or 0.0, 2)
                    row[f"apply_us@{cap}"] = round(
                        time_graph(partial(_apply, shrink, out), dev) or 0.0, 2
                    )
                print(row, flush=True)
                rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"probe": "shrink_split", "gpu": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    caps = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4, 8, 16, 32]
    main(sys.argv[1], caps)
