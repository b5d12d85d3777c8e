"""Probe: the staged GEMM in other operand layouts (CUDA only).

    python bench/probes/gemm_layouts.py OUT.json [MAX_SECONDS]

A staged decode step computes ``x [W; A_staged]^T`` with ``F.linear`` over ``N + extra``
weight rows; at 32 rows the extra 16-64 rows move cuBLAS from the base GEMM's tile to a
slower one (gate_up 128x32 -> 256x32: +4 us per layer, docs/performance.md). cuBLAS picks
its kernel by shape *and* layout, so the same product asked for in another layout may keep
the base's speed:

- ``linear``: ``F.linear(x, W)``, the runtime's call, output ``[T, N]``;
- ``wx``: ``W @ x^T``, the output transposed ``[N, T]`` (an epilogue would read it by column);
- ``xt``: ``F.linear`` on ``x`` stored column-major (``x^T`` contiguous, viewed back).

For each Llama-3-8B projection, decode rows 16/32/64/128 and extra rows 0/16/32/48/64/128,
each variant is graph-timed from cold L2 (``bench.common.time_graph``). Prints one JSON
object per case and writes them all to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from loraplane.worker.bench.common import time_graph

# name: (K, N)
PROJ = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (16, 32, 64, 128)
EXTRA = (0, 16, 32, 48, 64, 128)


def variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    x_cm = x.t().contiguous().t()  # the same values, column-major
    return {
        "linear": lambda: F.linear(x, w),
        "wx": lambda: torch.mm(w, x.t()),
        "xt": lambda: F.linear(x_cm, w),
    }


def main(out_path: str, max_seconds: float) -> None:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    t0 = time.monotonic()
    rows_out: list[dict[str, Any]] = []
    for name, (k, n) in PROJ.items():
        buf = torch.randn(n + max(EXTRA), k, device=dev, dtype=dt) * 0.02
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            for extra in EXTRA:
                if time.monotonic() - t0 > max_seconds:
                    break
                w = buf[: n + extra]
                row: dict[str, Any] = {"proj": name, "K": k, "N": n, "rows": m, "extra": extra}
                ref = F.linear(x, w).float()
                for key, fn in variants(x, w).items():
                    got = fn()
                    assert isinstance(got, torch.Tensor)
                    got = got.t() if key == "wx" else got
                    row[f"{key}_max_diff"] = float((got.float() - ref).abs().max())
                    row[key] = round(time_graph(fn, dev) or 0.0, 2)
                print(json.dumps(row), flush=True)
                rows_out.append(row)
        with open(out_path, "w") as f:
            json.dump(
                {
                    "probe": "gemm_layouts",
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "rows": rows_out,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240.0)
