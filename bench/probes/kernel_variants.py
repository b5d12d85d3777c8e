"""Probe: the decode shrink and expand under named kernel switches, side by side (CUDA only).

    python bench/probes/kernel_variants.py OUT.json VARIANT [VARIANT ...]

A variant is ``base`` or comma-separated ``key=value`` settings:

- ``maxnreg=N``: registers per thread (``_triton_utils.MAXNREG``; Nsight Compute on an H200:
  the expand at 114 registers fits 4 programs per multiprocessor, the shrink at 120 as many);
- ``ewarps=W``, ``bn=N``: the expand's warps and column block (``EXPAND_OVERRIDE``);
- ``sk=K,sw=W,ss=S``: the shrink's K step, warps and stages (``SHRINK_OVERRIDE``);
- ``grouped=1``: tokens in adapter order (dense: no row gather) instead of interleaved.

``--cases stacked`` (first argument) times the decode cases of the stacked modules instead of
``CASES``: MoE gate_up at 16/64/128 tokens, ranks 16/64, 1/4/16 adapters, and qkv and gate_up
at 16 adapters (and 1/4 at 64 tokens, rank 16).

Per case (``shrink_tune.build``: decode shapes of Llama-3-8B and Qwen3-30B-A3B where a copy of
the same bytes is fast) each variant's shrink and expand are graph-timed from cold L2, with a
device copy of the same bytes; ``max_diff`` is each variant's largest difference from
``base`` (relative to base's largest value). Prints one JSON line per case and writes OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from shrink_tune import build

from loraplane.worker.bench.common import copy_bandwidth, copy_of, time_graph
from loraplane.worker.kernels import _triton_utils

CASES = [
    ("down", 128, 64, 16),
    ("qkv", 128, 64, 16),
    ("gate_up", 128, 64, 16),
    ("o", 128, 64, 16),
    ("down", 128, 16, 16),
    ("gate_up", 128, 16, 4),
    ("moe_down", 128, 64, 16),
    ("moe_gate_up", 128, 16, 16),
    ("moe_gate_up", 64, 64, 4),
    ("moe_down", 64, 16, 4),
]
STACKED_CASES = (
    [
        (module, tokens, rank, adapters)
        for module in ("moe_gate_up",)
        for tokens in (16, 64, 128)
        for rank in (16, 64)
        for adapters in (1, 4, 16)
    ]
    + [
        (module, tokens, rank, 16)
        for module in ("qkv", "gate_up")
        for tokens in (16, 64, 128)
        for rank in (16, 64)
    ]
    + [(module, 64, 16, adapters) for module in ("qkv", "gate_up") for adapters in (1, 4)]
)
KEYS = {"maxnreg", "ewarps", "bn", "sk", "sw", "ss", "grouped"}


def parse(variant: str) -> dict[str, int]:
    if variant == "base":
        return {}
    settings = {}
    for item in variant.split(","):
        key, _, value = item.partition("=")
        if key not in KEYS or not value.isdigit():
            raise SystemExit(f"variant {variant!r}: {item!r} is not key=N with key in {KEYS}")
        settings[key] = int(value)
    return settings


def apply(settings: dict[str, int]) -> None:
    _triton_utils.MAXNREG = settings.get("maxnreg")
    expand = ("bn" in settings, "ewarps" in settings)
    _triton_utils.EXPAND_OVERRIDE = (
        (settings.get("bn", 128), settings.get("ewarps", 4)) if any(expand) else None
    )
    shrink = ("sk" in settings, "sw" in settings, "ss" in settings)
    _triton_utils.SHRINK_OVERRIDE = (
        (settings.get("sk", 128), settings.get("sw", 4), settings.get("ss", 3))
        if any(shrink)
        else None
    )


def main(out_path: str, variants: list[str], cases: list[tuple[str, int, int, int]]) -> None:
    parsed = {v: parse(v) for v in variants}
    peak = copy_bandwidth("cuda")["gbytes_per_s"]
    rows: list[dict[str, Any]] = []
    for case in cases:
        row: dict[str, Any] = dict(zip(("module", "tokens", "rank", "adapters"), case, strict=True))
        reference: dict[str, torch.Tensor] = {}
        diff = expand_diff = 0.0
        for name, settings in parsed.items():
            apply({})
            shrink_fn, expand_fn, s_bytes, e_bytes = build(
                *case, grouped=bool(settings.get("grouped"))
            )
            apply(settings)
            y = shrink_fn().float()
            out = expand_fn().float()  # the expand's output after one call, from fresh inputs
            if "y" not in reference:
                reference["y"], reference["out"] = y, out
            elif not settings.get("grouped"):
                diff = max(diff, float((y - reference["y"]).abs().max() / y.abs().max()))
                expand_diff = max(
                    expand_diff, float((out - reference["out"]).abs().max() / out.abs().max())
                )
            row[f"shrink_{name}"] = round(time_graph(shrink_fn, "cuda") or 0.0, 2)
            row[f"expand_{name}"] = round(time_graph(expand_fn, "cuda") or 0.0, 2)
        apply({})
        row["max_diff"] = diff
        row["expand_max_diff"] = expand_diff
        for kind, nbytes in (("shrink", s_bytes), ("expand", e_bytes)):
            copy_us = time_graph(copy_of(nbytes, "cuda"), "cuda") or 0.0
            row[f"{kind}_bytes"] = nbytes
            row[f"{kind}_copy"] = round(copy_us, 2)
            row[f"{kind}_copy_pct"] = round(100 * nbytes / copy_us / 1e3 / peak, 1)
            for name in parsed:
                us = row[f"{kind}_{name}"]
                row[f"{kind}_{name}_pct"] = round(100 * nbytes / us / 1e3 / peak, 1) if us else None
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out_path, "w") as f:
            json.dump(
                {
                    "probe": "kernel_variants",
                    "gpu": torch.cuda.get_device_name(),
                    "commit": os.environ.get("LORAPLANE_COMMIT"),
                    "variants": variants,
                    "peak_gbs": peak,
                    "rows": rows,
                },
                f,
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = CASES
    if args[:2] == ["--cases", "stacked"]:
        chosen, args = STACKED_CASES, args[2:]
    main(args[0], args[1:] or ["base"], chosen)
