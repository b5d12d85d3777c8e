"""Probe: the staged decode path's two costs, per batch size (CUDA only).

    python bench/probes/stacked_tune.py OUT.json [MAX_SECONDS]

A staged decode step (``kernels/stacked.py``, ADR 0007) pays for its LoRA in two places:

1. **The stacked GEMM.** ``x [W; A_staged]^T`` has ``N + width * n * r`` output columns, and
   cuBLAS picks its kernel by shape: an extra 16-192 columns can move it to another tile and
   split (seen in ``bench decode --profile-graphs``). For Llama-3-8B's qkv / o / gate_up /
   down at 16-128 rows, each GEMM is timed at ``N + e`` columns for extents ``EXTRA`` (the
   weight a view of the first rows of one buffer, as the runtime holds it).
2. **The epilogue kernels.** ``stacked_plain`` (qkv), ``stacked_residual`` (o, down) and
   ``stacked_silu_mul`` (gate_up) at 1 and 4 adapters of rank 16, per
   ``(block_s, block_n, num_warps)`` of ``STACKED_CONFIGS`` (``stacked.STACKED_OVERRIDE``),
   next to the base path's elementwise op (residual add, SwiGLU) on the same rows.

Everything graph-timed from cold L2 (``bench.common.time_graph``). Writes OUT.json after
every row and prints each row as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import stacked
from loraplane.worker.kernels._triton_utils import StageInfo, with_tiles
from loraplane.worker.kernels.swiglu import silu_and_mul

R = 16
DEV = "cuda"
# name: (K, slice widths, op)
PROJ = {
    "qkv": (4096, (4096, 1024, 1024), "plain"),
    "o": (4096, (4096,), "residual"),
    "gate_up": (4096, (14336, 14336), "silu_mul"),
    "down": (14336, (4096,), "residual"),
}
EXTRA = [0, 16, 32, 48, 64, 128, 192, 256, 384, 512]
STACKED_CONFIGS = [
    (16, 32, 4),
    (16, 64, 4),
    (16, 128, 4),
    (16, 32, 2),
    (16, 64, 2),
    (32, 64, 4),
    (64, 128, 4),
]


def _stage(rows: int, adapters: int, dev: str) -> StageInfo:
    """Rows sorted by adapter (as the engine orders a batch), every row with one."""
    width = 1 << (adapters - 1).bit_length()
    return with_tiles(
        StageInfo(
            row_pos=torch.arange(rows, dtype=torch.int32, device=dev) * adapters // rows,
            pos_slots=torch.tensor(
                [*range(adapters), *[-1] * (width - adapters)], dtype=torch.int32, device=dev
            ),
            pos_scalings=torch.full((width,), 2.0, dtype=torch.float32, device=dev),
            width=width,
            rank=R,
        )
    )


def gemm_rows(rows_out: list[dict[str, Any]], out_path: str, deadline: float) -> None:
    dev, dt = DEV, torch.bfloat16
    for name, (k, widths, _) in PROJ.items():
        n = sum(widths)
        buf = torch.randn(n + max(EXTRA), k, device=dev, dtype=dt) * k**-0.5
        for m in (16, 32, 64, 128):
            if time.monotonic() > deadline:
                return
            x = torch.randn(m, k, device=dev, dtype=dt)
            row: dict[str, Any] = {"what": "gemm", "proj": name, "rows": m, "N": n}
            for e in EXTRA:
                w = buf[: n + e]
                row[f"us+{e}"] = round(time_graph(partial(F.linear, x, w), dev) or 0.0, 2)
            _emit(row, rows_out, out_path)


def _calls(
    op: str,
    full: torch.Tensor,
    n: int,
    n_r: int,
    b: torch.Tensor,
    stage: StageInfo,
    offsets: torch.Tensor,
    res: torch.Tensor,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """The staged epilogue and the base path's op on the same rows (its own contiguous
    GEMM output)."""
    plain = full[:, :n].contiguous()
    if op == "plain":  # the base path's q | k | v split reads the GEMM output once
        return (
            partial(stacked.stacked_plain, full, n, n_r, b, stage, offsets),
            lambda: full[:, :n].contiguous(),
        )
    if op == "residual":
        return (
            partial(stacked.stacked_residual, full, n, n_r, b, stage, res),
            lambda: res.add_(plain),
        )
    return (
        partial(stacked.stacked_silu_mul, full, n, n_r, b, stage),
        partial(silu_and_mul, plain),
    )


def epilogue_rows(rows_out: list[dict[str, Any]], out_path: str, deadline: float) -> None:
    dev, dt = DEV, torch.bfloat16
    for name, (_, widths, op) in PROJ.items():
        n = sum(widths)
        offs = [0]
        for w in widths:
            offs.append(offs[-1] + w)
        offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        n_r = len(widths) * R
        b = torch.randn(4, n, R, device=dev, dtype=dt) * 0.05
        for m in (16, 32, 64, 128):
            for adapters in (1, 4):
                if time.monotonic() > deadline:
                    return
                stage = _stage(m, adapters, dev)
                full = torch.randn(m, n + stage.width * n_r, device=dev, dtype=dt)
                res = torch.randn(m, n, device=dev, dtype=dt)
                call, base = _calls(op, full, n, n_r, b, stage, offsets, res)
                row: dict[str, Any] = {"what": op, "proj": name, "rows": m, "adapters": adapters}
                row["base_op_us"] = round(time_graph(base, dev) or 0.0, 2)
                want = call().clone() if op != "residual" else None
                for bs_, bn, nw in STACKED_CONFIGS:
                    if bs_ > max(16, 1 << (stage.max_len - 1).bit_length()):
                        continue
                    stacked.STACKED_OVERRIDE = (bs_, bn, nw)
                    if want is not None:
                        got = call()
                        row[f"diff_s{bs_}_n{bn}_w{nw}"] = float((got - want).abs().max())
                    row[f"s{bs_}_n{bn}_w{nw}"] = round(time_graph(call, dev) or 0.0, 2)
                stacked.STACKED_OVERRIDE = None
                row["default_us"] = round(time_graph(call, dev) or 0.0, 2)
                _emit(row, rows_out, out_path)


def _emit(row: dict[str, Any], rows: list[dict[str, Any]], out_path: str) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(out_path, "w") as f:
        json.dump(
            {
                "probe": "stacked_tune",
                "gpu": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
                "rows": rows,
            },
            f,
        )


def main(out_path: str, max_seconds: float) -> None:
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    epilogue_rows(rows, out_path, t0 + max_seconds * 0.6)
    gemm_rows(rows, out_path, t0 + max_seconds)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 200.0)
