"""Probe: which extent of a stacked weight the staged GEMM should read (CUDA only).

    python bench/probes/gemm_extents.py OUT.json [MAX_SECONDS] [--wide | --prompt]

A staged decode step computes ``x [W; A_staged]^T`` over the first ``N + need`` rows of the
stacked weight (``need = width * slices * rank``). cuBLAS picks its kernel by shape, and a few
extra rows can move it to a slower tile or split (``docs/performance.md``). Reading
more rows than needed is free of meaning (the columns past ``N + need`` are never read) and
sometimes faster. For each Llama-3-8B projection, each ``need`` of 1/2/4 stage positions at
ranks 16/32/64 and each decode graph bucket up to 256 rows, every candidate extent is
graph-timed from cold L2 (``bench.common.time_graph``). ``table`` lists the cases where the
fastest candidate beats ``need`` by at least ``MIN_GAIN``. ``--wide``: the stages a serving
pool of many slots computes instead, 8 / 16 / 32 positions at rank 16, at the buckets of 32-64
rows (a 16-adapter staged decode step's down_proj ran another cuBLAS kernel than the base's,
6 us slower a layer on an H100: ``bench/results/2026-12-06-h100-wide-stage/``).

A full table of such extents in the runtime (264b424) read bs 16 at 0.94 against 0.96 without
it in the decode bench, bs 32 0.96-0.98 against 0.95-0.96: a GEMM that is faster alone is not
always faster inside the step, so the runtime keeps only the 32-row bucket's extents
(``lora/extents.py``; docs/performance.md, "Tried and not kept").

``--prompt``: the prompt steps' sizes instead (48 decode rows plus one to four 256-token
chunks, 4 / 16 / 32 positions at rank 16), each timed three ways: ``base`` (``x W^T``
alone, the LoRA-off step's GEMM), ``one`` (one GEMM over ``[W; A_staged]``, what a staged
graph runs) and ``apart`` (``x W^T`` and ``x A_staged^T`` as two GEMMs, no concatenation): is
the wider GEMM slower than the base's by more than the stage's own rows cost?
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loraplane.worker.bench.common import time_graph

# name: (K, N, slices)
PROJ = {
    "qkv": (4096, 6144, 3),
    "o": (4096, 4096, 1),
    "gate_up": (4096, 28672, 2),
    "down": (14336, 4096, 1),
}
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MIN_GAIN = 0.02  # the fastest extent must beat `need` by this fraction to enter the table
MAX_PAD = 512  # rows past `need` a candidate may read


def candidates(need: int, wide: bool = False) -> list[int]:
    up = [-(-need // m) * m for m in (64, 128, 256)]
    more = {need + d for d in (64, 128, 256, 384, 512)} if wide else {384, 512}
    return sorted({need, *up, up[1] + 128, *more} & set(range(need, need + MAX_PAD + 1)))


PROMPT_ROWS = (304, 560, 816, 1072)


def apart(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> None:
    """The base GEMM and the stage's apart (``--prompt``)."""
    F.linear(x, w)
    F.linear(x, a)


def prompt_rows(out_path: str, max_seconds: float) -> None:
    """``--prompt``: base, one wide GEMM and the two GEMMs apart at prompt-step sizes."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    t0 = time.monotonic()
    rows_out: list[dict[str, Any]] = []
    for name, (k, n, slices) in PROJ.items():
        needs = [w * slices * 16 for w in (4, 16, 32)]
        buf = torch.randn(n + max(needs), k, device=dev, dtype=dt) * k**-0.5
        for m in PROMPT_ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            base = time_graph(partial(F.linear, x, buf[:n]), dev) or 0.0
            for need in needs:
                if time.monotonic() - t0 > max_seconds:
                    break
                one = time_graph(partial(F.linear, x, buf[: n + need]), dev) or 0.0
                two = time_graph(partial(apart, x, buf[:n], buf[n : n + need]), dev) or 0.0
                row = {
                    "proj": name, "K": k, "N": n, "rows": m, "need": need,
                    "us": {"base": round(base, 2), "one": round(one, 2), "apart": round(two, 2)},
                    "one_over_base": round(one / base, 4) if base else None,
                    "apart_over_base": round(two / base, 4) if base else None,
                }  # fmt: skip
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(
            {"probe": "gemm_extents --prompt", "gpu": torch.cuda.get_device_name(),
             "torch": torch.__version__, "rows": rows_out},
            f,
        )  # fmt: skip


def main(out_path: str, max_seconds: float, wide: bool = False) -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    t0 = time.monotonic()
    rows_out: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    for name, (k, n, slices) in PROJ.items():
        if wide:
            needs = sorted({w * slices * 16 for w in (8, 16, 32)})
        else:
            needs = sorted({w * slices * r for w in (1, 2, 4) for r in (16, 32, 64)})
        buf = torch.randn(n + max(needs) + MAX_PAD, k, device=dev, dtype=dt) * k**-0.5
        for m in (32, 48, 64) if wide else ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            for need in needs:
                if time.monotonic() - t0 > max_seconds:
                    break
                times = {
                    e: round(time_graph(partial(F.linear, x, buf[: n + e]), dev) or 0.0, 2)
                    for e in candidates(need, wide)
                }
                best = min(times, key=lambda e: times[e])
                row = {"proj": name, "K": k, "N": n, "rows": m, "need": need, "us": times}
                rows_out.append(row)
                if best != need and times[best] <= times[need] * (1 - MIN_GAIN):
                    table.append(
                        {"K": k, "N": n, "need": need, "rows": m, "extent": best,
                         "us_need": times[need], "us_extent": times[best]}
                    )  # fmt: skip
                print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:
                json.dump(
                    {
                        "probe": "gemm_extents",
                        "gpu": torch.cuda.get_device_name(),
                        "torch": torch.__version__,
                        "min_gain": MIN_GAIN,
                        "rows": rows_out,
                        "table": table,
                    },
                    f,
                )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    seconds = float(args[1]) if len(args) > 1 else 240.0
    if "--prompt" in sys.argv[1:]:
        prompt_rows(args[0], seconds)
    else:
        main(args[0], seconds, wide="--wide" in sys.argv[1:])
