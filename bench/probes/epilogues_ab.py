"""Probe: the staged decode path's epilogues and rotation, per batch size (CUDA only).

    PYTHONPATH=<a tree's worker/src> python bench/probes/epilogues_ab.py OUT.json

Times what a staged decode step runs after its stacked GEMMs at Llama-3-8B's shapes, rank 16,
1 and 4 adapters (rows sorted by adapter, as the engine orders a batch), 16-128 rows:
``stacked_residual`` (o_proj, down_proj), ``stacked_silu_mul`` (gate_up) and ``rope_qkv``
with the qkv LoRA, next to ``rope_qkv`` without it. At 64 rows and more, ``gate_up`` is also
timed at three tile configs (``stacked.STACKED_OVERRIDE``). Everything is graph-timed from
cold L2 (``bench.common.time_graph``, 50 calls a replay).

It runs against whichever tree is on ``PYTHONPATH``, so one device call can compare two
commits: a tree whose ``StageInfo`` has ``row_pos`` (rows read in place) gets each row's stage
position; a tree without it gets the full segments as ``StaticLoRABatch`` built them for a graph
(adapter segments, then an empty no-adapter segment; ``max_len`` the batch's rows).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from stacked_tune import _stage  # (this directory is on sys.path when run as a script)

from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import rope, stacked
from loraplane.worker.kernels._triton_utils import StageInfo
from loraplane.worker.models.layers import RotaryEmbedding

R, DEV, DT = 16, "cuda", torch.bfloat16
H, KV, D = 32, 8, 128  # Llama-3-8B's heads
ROW_POS = "row_pos" in {f.name for f in dataclasses.fields(StageInfo)}
TILES = [(16, 64, 4), (32, 128, 8), (32, 64, 4)]


def stage_of(rows: int, adapters: int) -> Any:
    if ROW_POS:
        return _stage(rows, adapters, DEV)
    per = rows // adapters
    width = 1 << (adapters - 1).bit_length()
    return StageInfo(  # type: ignore[call-arg]
        full_indptr=torch.tensor(
            [i * per for i in range(adapters)] + [rows, rows], dtype=torch.int32, device=DEV
        ),
        full_order=torch.arange(rows, dtype=torch.int64, device=DEV),
        full_slots=torch.tensor([*range(adapters), 0], dtype=torch.int32, device=DEV),
        full_pos=torch.tensor([*range(adapters), -1], dtype=torch.int32, device=DEV),
        full_scalings=torch.full((adapters + 1,), 2.0, dtype=torch.float32, device=DEV),
        max_len=rows,
        width=width,
        rank=R,
    )


def timed(fn: Callable[[], object]) -> float:
    return round(time_graph(fn, DEV, inner=50, replays=25) or 0.0, 3)


def epilogues(row: dict[str, Any], rows: int, st: Any) -> None:
    for name, n, op in (("o", 4096, "residual"), ("gate_up", 28672, "silu_mul"), ("down", 4096, "residual")):  # fmt: skip
        n_r = (2 if op == "silu_mul" else 1) * R
        b = torch.randn(4, n, R, device=DEV, dtype=DT) * 0.05
        full = torch.randn(rows, n + st.width * n_r, device=DEV, dtype=DT)
        res = torch.randn(rows, n, device=DEV, dtype=DT)
        if op == "residual":
            call: Callable[[], object] = partial(stacked.stacked_residual, full, n, n_r, b, st, res)
        else:
            call = partial(stacked.stacked_silu_mul, full, n, n_r, b, st)
        row[f"{name}_us"] = timed(call)
        if ROW_POS and op == "silu_mul" and rows >= 64:
            for cfg in TILES:
                stacked.STACKED_OVERRIDE = cfg
                row[f"{name}_{cfg[0]}x{cfg[1]}w{cfg[2]}_us"] = timed(call)
            stacked.STACKED_OVERRIDE = None


def rotation(row: dict[str, Any], rows: int, st: Any) -> None:
    n = (H + 2 * KV) * D
    b = torch.randn(4, n, R, device=DEV, dtype=DT) * 0.05
    full = torch.randn(rows, n + st.width * 3 * R, device=DEV, dtype=DT)
    plain = full[:, :n].contiguous()
    k_cache = torch.zeros(rows, 640, KV, D, device=DEV, dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.full((rows,), 511, dtype=torch.int64, device=DEV)
    # KV slots of a cache of one 640-position page per row
    slots = torch.arange(rows, dtype=torch.int64, device=DEV) * 640 + positions
    cos_sin = RotaryEmbedding(D, 500000.0).to(DEV).cos_sin(640, DT)
    args = (positions, slots, cos_sin, k_cache, v_cache, H)
    row["rope_lora_us"] = timed(lambda: rope.rope_qkv(full, *args, lora_b=b, stage=st))
    row["rope_base_us"] = timed(lambda: rope.rope_qkv(plain, *args))


def main(out_path: str) -> None:
    out = []
    for rows in (16, 32, 64, 128):
        for adapters in (1, 4):
            st = stage_of(rows, adapters)
            row: dict[str, Any] = {"style": "row_pos" if ROW_POS else "segments"}
            row |= {"rows": rows, "adapters": adapters}
            epilogues(row, rows, st)
            rotation(row, rows, st)
            print(json.dumps(row), flush=True)
            out.append(row)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit(__doc__)
    main(sys.argv[1])
