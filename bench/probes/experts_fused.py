"""Probe: where the experts' fused LoRA spends its time, launch by launch (CUDA only).

    python bench/probes/experts_fused.py OUT.json [BATCH ...]      (ADAPTERS=N: 1 by default)

At Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048, intermediate 768, top-8), rank
16, ``ADAPTERS`` adapters over the tokens in turn (one: the decode bench's "1" variant) or
none, each of the three
launches of ``moe_experts_lora`` is graph-timed from cold L2 next to its base counterpart:
gate_up's grouped GEMM (with and without the shrink column), the SwiGLU (plain and with the
LoRA), down's grouped GEMM (with and without the epilogue), and the whole layer both ways.
The activations and index tables are kept warm (as in a decode step); weights are cold.
Module constants of ``kernels.experts`` can be set per run with ``VAR=NAME=value,...`` to
compare variants in one call. Prints one JSON line per batch size and writes OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import experts as ex
from loraplane.worker.kernels import silu_and_mul

EXPERTS, HIDDEN, INTER, TOPK, RANK = 128, 2048, 768, 8, 16
ADAPTERS = int(os.environ.get("ADAPTERS", "1"))
SLOTS = max(4, ADAPTERS)


def _setup(bs: int, gen: torch.Generator) -> dict[str, Any]:
    dev, dt = "cuda", torch.bfloat16
    pairs = bs * TOPK
    scores = torch.rand(bs, EXPERTS, generator=gen, device=dev)
    pair_expert = scores.topk(TOPK, dim=1).indices.reshape(-1).to(torch.int32).contiguous()

    def rnd(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)

    lora = ex.ExpertLoRA(
        a_gate_up=rnd(SLOTS, EXPERTS, 2 * RANK, HIDDEN),
        b_gate_up=rnd(SLOTS, EXPERTS, 2 * INTER, RANK),
        a_down=rnd(SLOTS, EXPERTS, RANK, INTER),
        b_down=rnd(SLOTS, EXPERTS, HIDDEN, RANK),
        token_slots=(torch.arange(bs, device=dev) % ADAPTERS).to(torch.int32),
        slot_ranks=torch.full((SLOTS,), RANK, dtype=torch.int32, device=dev),
        slot_scalings=torch.full((SLOTS,), 2.0, dtype=dt, device=dev),
        topk=TOPK,
        adapters=ADAPTERS,
    )
    routing = ex.moe_expert_routing(pair_expert, EXPERTS)
    parts = ex.cdiv(INTER, ex.SILU_BLOCK_N)
    return {
        "x": rnd(bs, HIDDEN, scale=1.0),
        "w_gu": rnd(EXPERTS, 2 * INTER, HIDDEN),
        "w_down": rnd(EXPERTS, HIDDEN, INTER),
        "pair_expert": pair_expert,
        "routing": routing,
        "lora": lora,
        "gu": torch.empty(pairs, 2 * INTER, dtype=dt, device=dev),
        "y": torch.empty(pairs, 2 * RANK, dtype=dt, device=dev),
        "act": torch.empty(pairs, INTER, dtype=dt, device=dev),
        "partials": torch.zeros(parts, pairs, RANK, dtype=torch.float32, device=dev),
        "d": torch.empty(pairs, HIDDEN, dtype=dt, device=dev),
        "delta": torch.empty(pairs, HIDDEN, dtype=dt, device=dev),
        "topk_weights": torch.rand(bs, TOPK, generator=gen, device=dev).to(dt),
        "distinct": int(pair_expert.unique().numel()),
    }


def _silu_lora(s: dict[str, Any]) -> None:
    ex._launch_silu_lora(
        s["gu"], s["act"], s["y"], s["partials"], s["pair_expert"], s["routing"], s["lora"]
    )


def _base_layer(s: dict[str, Any]) -> torch.Tensor:
    r = s["routing"]
    ex._launch_grouped(s["x"], s["w_gu"], s["gu"], r, TOPK)
    ex._launch_grouped(silu_and_mul(s["gu"]), s["w_down"], s["d"], r, 1)
    return s["d"]


def _lora_layer(s: dict[str, Any]) -> torch.Tensor:
    d, delta = ex.moe_experts_lora(
        s["x"], s["w_gu"], s["w_down"], s["pair_expert"], s["routing"], s["lora"], check=False
    )
    return ex.moe_combine(d, s["topk_weights"], delta)


def measure(bs: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(bs)
    s = _setup(bs, gen)
    r, lora = s["routing"], s["lora"]
    grouped = ex._launch_grouped
    fns = {
        "gate_up": lambda: grouped(s["x"], s["w_gu"], s["gu"], r, TOPK),
        "gate_up_lora": lambda: grouped(s["x"], s["w_gu"], s["gu"], r, TOPK, lora, 1, s["y"]),
        "silu": lambda: silu_and_mul(s["gu"]),
        "silu_lora": lambda: _silu_lora(s),
        "down": lambda: grouped(s["act"], s["w_down"], s["d"], r, 1),
        "down_lora": lambda: grouped(
            s["act"], s["w_down"], s["d"], r, 1, lora, 2, s["partials"], s["delta"]
        ),
        "combine": lambda: ex.moe_combine(s["d"], s["topk_weights"]),
        "combine_lora": lambda: ex.moe_combine(s["d"], s["topk_weights"], s["delta"]),
        "layer": lambda: ex.moe_combine(_base_layer(s), s["topk_weights"]),
        "layer_lora": lambda: _lora_layer(s),
    }
    warm = [s[k] for k in ("x", "gu", "y", "act", "partials", "pair_expert", "d", "delta")]
    warm += [r.tile_seg, r.tile_len, r.tile_rows, lora.token_slots]
    row: dict[str, Any] = {"bs": bs, "pairs": bs * TOPK, "distinct_experts": s["distinct"]}
    for name, fn in fns.items():
        t = time_graph(fn, "cuda", inner=20, replays=15, warm=warm)
        row[name + "_us"] = None if t is None else round(t, 2)
    for base in ("gate_up", "silu", "down", "combine", "layer"):
        a, b = row.get(base + "_us"), row.get(base + "_lora_us")
        if a is not None and b is not None:
            row[base + "_extra_us"] = round(b - a, 2)
    lora_mb = s["distinct"] * 2 * RANK * (2 * HIDDEN + 3 * INTER) / 2**20
    row["lora_mb"] = round(lora_mb, 2)
    return row


def main(argv: list[str]) -> int:
    if not argv or not torch.cuda.is_available():
        print(__doc__)
        return 2
    for item in filter(None, os.environ.get("VAR", "").split(",")):
        name, value = item.split("=")
        setattr(ex, name, int(value))
    sizes = [int(a) for a in argv[1:]] or [16, 32, 64, 128]
    rows = []
    for bs in sizes:
        rows.append(measure(bs))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "probe": "experts_fused",
        "var": os.environ.get("VAR", ""),
        "adapters": ADAPTERS,
        "rows": rows,
    }
    with open(argv[0], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
