"""Probe: the fused sampler's block, warps and radix buckets, on a GPU (ms per call).

    python bench/probes/sampler_tune.py [OUT.json]

Times ``sample_rows(..., "triton")`` over bf16 logits of a 128k vocabulary at bs 16 and 128
for LM-like rows (std 3) at temperature 0.7 with top_p 0.9, with top_k 50 and top_p 0.9, and
with top_k 50 alone, for each setting of ``kernels.sampling``'s ``BLOCK``, ``NUM_WARPS`` and
``BINS`` in ``VARIANTS`` (the torch sampler's time first, for scale). Each time is the median of
20 calls after 2, with a device sync.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.engine.sampling import SamplingParams, sample_rows
from loraplane.worker.kernels import sampling as fused

CASES = {
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k_top_p": SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
    "top_k": SamplingParams(temperature=0.7, top_k=50),
}
VARIANTS = [  # (BINS 16 and 64 run slower than 256 for top_k, and so does BLOCK 2048)
    {"BLOCK": 4096, "NUM_WARPS": 16, "BINS": 256},
    {"BLOCK": 8192, "NUM_WARPS": 16, "BINS": 256},
    {"BLOCK": 8192, "NUM_WARPS": 32, "BINS": 256},
    {"BLOCK": 4096, "NUM_WARPS": 8, "BINS": 256},
]


def _ms(fn: Any) -> float:
    times = []
    for i in range(22):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    rows: list[dict[str, Any]] = []
    for bs in (16, 128):
        logits = (torch.randn(bs, 128256, device="cuda") * 3).bfloat16()
        for case, params in CASES.items():
            batch = [params] * bs
            row: dict[str, Any] = {"bs": bs, "case": case}
            idx = [0] * bs
            row["torch"] = _ms(lambda x=logits, b=batch, i=idx: sample_rows(x, b, i, "torch"))
            for v in VARIANTS:
                for name, value in v.items():
                    setattr(fused, name, value)
                key = "triton_" + "_".join(f"{k.lower()}{x}" for k, x in v.items())
                row[key] = _ms(lambda x=logits, b=batch, i=idx: sample_rows(x, b, i, "triton"))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
