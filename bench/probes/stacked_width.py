"""Probe: the staged epilogues and the LoRA rotation at wide stages, per kernel variant.

    python bench/probes/stacked_width.py [OUT.json] [--widths 16,32] [--max-seconds 240]

A serving worker stages up to 16 rank-16 adapters by default (32 with ``--stage-slots 8``),
and ``bench/probes/lora_step.py --profile`` (16 layers, 16 adapters staged) found the four
fused epilogues (``kernels/stacked.py``: qkv's in ``rope_qkv``, o and down's residual add,
gate_up's SwiGLU) at 2-4 x their base op's time: ~0.35 ms of a 4.1 ms decode step and
~1.7 ms of a 13 ms mixed step. This times each of them at the Llama-3-8B shape, rank 16,
against the op it replaces (the residual add, the SwiGLU, the plain rotation), for

- ``decode``: ``--decode-rows`` rows (48) grouped by adapter over ``width`` positions (3
  rows each at 16);
- ``mixed``: 48 such rows and three 256-row prompt chunks under the first three adapters
  (816 rows, as the engine orders them: by adapter), at 16 positions;

and each launch variant: the tiles (a program per (tile of a position's rows, columns),
``StageInfo.tiles``, the default below ``ROWS_KERNEL_MIN`` rows; timed on the mixed case too)
and the row-block programs (``BY_ROWS``), at several ``(block_s, block_n, num_warps)``. (The
position grid the tiles replaced, a program per (row block, position, columns), is in
``bench/results/2026-12-06-h100-stage-tiles/``.) Every variant's output is
checked against the default's. Graph-timed from cold L2 (``bench.common.time_graph``),
microseconds. JSON lines on stdout as it goes, one object at the end (``OUT`` too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import rope, stacked
from loraplane.worker.kernels._triton_utils import StageInfo, with_tiles
from loraplane.worker.kernels.swiglu import silu_and_mul

DEV, DTYPE = "cuda", torch.bfloat16
R, HEADS, KV_HEADS, D, HIDDEN, INTER = 16, 32, 8, 128, 4096, 14336
QKV = (HEADS + 2 * KV_HEADS) * D
DECODE_ROWS, CHUNK, CHUNKS, PAGE = 48, 256, 3, 16
DECODE_ROWS_NOW = [DECODE_ROWS]  # the decode case being timed (``--decode-rows``)
# B's last dimension (``--slot-rank``): a worker's slot buffers are of ``--max-lora-rank``,
# and the kernels read the first ``R`` columns of each B row.
SLOT_RANK = [R]
ONLY: list[str] = []  # label prefixes of the variants to time (``--variants``); empty: all
# (block_s, block_n, num_warps) per launch variant; None: the launcher's own rule
TILE_CONFIGS = [(16, 32, 4), (16, 64, 4), (16, 128, 4), (16, 64, 2), (16, 128, 8), (16, 256, 8)]
ROWS_CONFIGS = [None, (16, 64, 4), (16, 128, 4), (32, 128, 4), (64, 64, 4)]
ROPE_BLOCKS = [16, 32, 64]


def layout(kind: str, width: int) -> list[int]:
    """Each row's stage position, rows grouped by adapter as the engine orders a batch."""
    rows = DECODE_ROWS if kind == "mixed" else DECODE_ROWS_NOW[0]
    per = [rows // width + (p < rows % width) for p in range(width)]
    if kind == "mixed":
        for p in range(CHUNKS):
            per[p] += CHUNK
    return [p for p in range(width) for _ in range(per[p])]


def make_stage(kind: str, width: int, dev: str) -> StageInfo:
    """Position ``p`` reads slot ``p`` at scaling 2; rows as ``layout`` gives them."""
    stage = StageInfo(
        row_pos=torch.tensor(layout(kind, width), dtype=torch.int32, device=dev),
        pos_slots=torch.arange(width, dtype=torch.int32, device=dev),
        pos_scalings=torch.full((width,), 2.0, dtype=torch.float32, device=dev),
        width=width,
        rank=R,
    )
    return with_tiles(stage)


@contextmanager
def variant(by_rows: bool, config: tuple[int, int, int] | None) -> Iterator[None]:
    saved = (stacked.ROWS_KERNEL_MIN, stacked.STACKED_OVERRIDE)
    stacked.ROWS_KERNEL_MIN = 0 if by_rows else 1 << 30
    stacked.STACKED_OVERRIDE = config
    try:
        yield
    finally:
        stacked.ROWS_KERNEL_MIN, stacked.STACKED_OVERRIDE = saved


def variants(default_by_rows: bool) -> Iterator[tuple[str, bool, Any]]:
    yield "default", default_by_rows, None
    every: list[tuple[str, bool, Any]] = [(f"tiles_{c}", False, c) for c in TILE_CONFIGS]
    every += [(f"rows_{c or 'rule'}", True, c) for c in ROWS_CONFIGS]
    for v in every:
        if not ONLY or any(v[0].startswith(o) for o in ONLY):
            yield v


def _time(fn: Callable[[], object]) -> float:
    return round(time_graph(fn, DEV) or 0.0, 2)


def epilogue_rows(kind: str, width: int, emit: Callable[[dict[str, Any]], None]) -> None:
    dev, dt = DEV, DTYPE
    stage = make_stage(kind, width, dev)
    rows = stage.row_pos.shape[0]
    default_by_rows = rows >= stacked.ROWS_KERNEL_MIN
    for name, n, slices, op in (
        ("o", HIDDEN, 1, "residual"),
        ("gate_up", 2 * INTER, 2, "silu_mul"),
        ("down", HIDDEN, 1, "residual"),
    ):
        n_r = slices * R
        full = torch.randn(rows, n + width * n_r, device=dev, dtype=dt)
        b = torch.randn(width, n, SLOT_RANK[0], device=dev, dtype=dt) * 0.05
        plain = full[:, :n].contiguous()
        res = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
        if op == "residual":
            call: Callable[[], torch.Tensor] = partial(
                stacked.stacked_residual, full, n, n_r, b, stage, res
            )
            base: Callable[[], object] = partial(torch.Tensor.add_, res, plain)
            res0 = res.clone()  # each check adds into a fresh copy

            def check(res0: torch.Tensor = res0, full: torch.Tensor = full, n: int = n,
                      n_r: int = n_r, b: torch.Tensor = b) -> torch.Tensor:  # fmt: skip
                return stacked.stacked_residual(full, n, n_r, b, stage, res0.clone())
        else:
            call = partial(stacked.stacked_silu_mul, full, n, n_r, b, stage)
            base = partial(silu_and_mul, plain)
            check = call
        row: dict[str, Any] = {"kind": kind, "width": width, "rows": rows, "op": name}
        row["slot_rank"] = SLOT_RANK[0]
        row["base_us"] = _time(base)
        want = check().clone()
        for label, by_rows, config in variants(default_by_rows):
            with variant(by_rows, config):
                if label != "default":
                    got = check()
                    if not torch.equal(got, want):
                        row[f"{label}_diff"] = float((got.float() - want.float()).abs().max())
                row[label] = _time(call)
        emit(row)


def rope_rows(kind: str, width: int, emit: Callable[[dict[str, Any]], None]) -> None:
    dev, dt = DEV, DTYPE
    stage = make_stage(kind, width, dev)
    rows = stage.row_pos.shape[0]
    full = torch.randn(rows, QKV + width * 3 * R, device=dev, dtype=dt)
    plain = full[:, :QKV].contiguous()
    b = torch.randn(width, QKV, SLOT_RANK[0], device=dev, dtype=dt) * 0.05
    positions = torch.randint(0, 2048, (rows,), device=dev)
    slots = torch.randperm(rows * 4, device=dev)[:rows]
    cos_sin = torch.randn(4096, D, device=dev, dtype=dt)
    pages = rows * 4 // PAGE + 1
    kc = torch.zeros(pages, PAGE, KV_HEADS, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    args = (positions, slots, cos_sin, kc, vc, HEADS)
    call = partial(rope.rope_qkv, full, *args, lora_b=b, stage=stage)
    row: dict[str, Any] = {"kind": kind, "width": width, "rows": rows, "op": "qkv_rope"}
    row["slot_rank"] = SLOT_RANK[0]
    row["base_us"] = _time(partial(rope.rope_qkv, plain, *args))
    want = call().clone()
    saved = rope.BLOCK_S
    default_by_rows = rows >= stacked.ROWS_KERNEL_MIN
    for block in ROPE_BLOCKS:  # (the tiles have TILE_ROWS rows: the default alone)
        label = f"rows_s{block}"
        if ONLY and not any(label.startswith(o) for o in ONLY):
            continue
        rope.BLOCK_S = block
        try:
            with variant(True, None):
                got = call()
                if not torch.equal(got, want):
                    row[f"{label}_diff"] = float((got.float() - want.float()).abs().max())
                row[label] = _time(call)
        finally:
            rope.BLOCK_S = saved
    if default_by_rows and (not ONLY or any("tiles".startswith(o) for o in ONLY)):
        with variant(False, None):  # a long step's rows over tiles too
            got = call()
            if not torch.equal(got, want):
                row["tiles_diff"] = float((got.float() - want.float()).abs().max())
            row["tiles"] = _time(call)
    with variant(default_by_rows, None):
        row["default"] = _time(call)
    emit(row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="also write the JSON here")
    p.add_argument("--widths", default="16,32", help="stage widths of the decode rows, a list")
    p.add_argument("--decode-rows", default="48", help="rows of the decode cases, a list")
    p.add_argument(
        "--variants",
        default="",
        help="time only the launch variants whose label starts with one of these, a list "
        "(tiles,rows_rule: the tiles' configs against the row blocks); default every variant",
    )
    p.add_argument(
        "--slot-rank",
        default=str(R),
        help=f"B's rank (the slot buffers'; the kernels read its first {R} columns), a list",
    )
    p.add_argument("--no-mixed", action="store_true", help="skip the 816-row mixed case")
    p.add_argument("--max-seconds", type=float, default=240.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("stacked_width: needs CUDA (it times graphs)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    out: dict[str, Any] = {
        "probe": "stacked_width",
        "gpu": torch.cuda.get_device_name(),
        "rows": [],
    }
    deadline = time.monotonic() + args.max_seconds

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(out) + "\n")

    if args.variants:
        ONLY[:] = args.variants.split(",")
    cases = [] if args.no_mixed else [("mixed", 16, DECODE_ROWS)]
    cases += [
        ("decode", int(w), int(r))
        for r in args.decode_rows.split(",")
        for w in args.widths.split(",")
    ]
    runs = [(*c, int(s)) for c in cases for s in args.slot_rank.split(",")]
    for kind, width, rows, slot_rank in runs:
        DECODE_ROWS_NOW[0] = rows
        SLOT_RANK[0] = slot_rank
        for fn in (epilogue_rows, rope_rows):
            if time.monotonic() > deadline:
                print("stacked_width: --max-seconds spent", file=sys.stderr)
                return 0
            fn(kind, width, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
