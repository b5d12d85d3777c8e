"""Probe: where the host time of one eager LoRA projection goes (CUDA only).

    python bench/probes/launch_profile.py [OUT.json]

An eager LoRA projection (multi-rank workers, batches past the largest graph) launches a
shrink and an expand; ``bench kernels`` reports ~110 us of host time per pair on an H200's
host, against ~30 us of our own code on the CPU (``host_overhead.py``). This runs the
runtime's pair (``lora_apply_shrink`` then ``expand_into``: a Llama-3-8B qkv at 16 rows,
rank 16, 4 adapters) and the MoE gate_up pair (routing, shrink, expand) ``CALLS`` times
under ``cProfile`` without syncing, and prints the wall time per pair and the functions with
the most own time, per pair, as one JSON object.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from loraplane.worker import kernels
from loraplane.worker.lora.batch_info import LoRABatchInfo

CALLS = 400


def dense_pair() -> Callable[[], None]:
    dev, dt = "cuda", torch.bfloat16
    rows, hidden, rank, adapters, widths = 16, 4096, 16, 4, (4096, 1024, 1024)
    n = sum(widths)
    offsets = torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32, device=dev)
    x = torch.randn(rows, hidden, device=dev, dtype=dt)
    a = torch.randn(adapters, 3 * rank, hidden, device=dev, dtype=dt) * 0.02
    b = torch.randn(adapters, n, rank, device=dev, dtype=dt) * 0.02
    out = torch.zeros(rows, n, device=dev, dtype=dt)
    ranks = torch.full((adapters,), rank, dtype=torch.int32, device=dev)
    scal = torch.ones(adapters, dtype=torch.float32, device=dev)
    info = LoRABatchInfo.build([i % adapters for i in range(rows)], ranks, scal, dev)
    assert info is not None

    def call() -> None:
        kernels.lora_apply_shrink(
            x,
            a,
            b,
            info.seg_indptr,
            info.seg_slots,
            info.slot_ranks,
            info.slot_scalings,
            info.row_order,
            offsets,
            info.max_seg_len,
            seg_ranks=info.seg_ranks,
            seg_scalings=info.seg_scalings,
            out=out,
        ).expand_into(out)

    return call


def moe_pair() -> Callable[[], None]:
    dev, dt = "cuda", torch.bfloat16
    tokens, topk, experts, hidden, inter, rank, adapters = 16, 8, 128, 2048, 768, 16, 4
    pairs = tokens * topk
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    a = torch.randn(adapters, experts, 2 * rank, hidden, device=dev, dtype=dt) * 0.02
    b = torch.randn(adapters, experts, 2 * inter, rank, device=dev, dtype=dt) * 0.02
    out = torch.zeros(pairs, 2 * inter, device=dev, dtype=dt)
    offsets = torch.tensor([0, inter, 2 * inter], dtype=torch.int32, device=dev)
    ranks = torch.full((adapters,), rank, dtype=torch.int32, device=dev)
    scal = torch.ones(adapters, dtype=torch.float32, device=dev)
    pair_expert = torch.randint(0, experts, (pairs,), dtype=torch.int32, device=dev)
    pair_slot = (torch.arange(pairs, device=dev, dtype=torch.int32) // topk) % adapters

    def call() -> None:
        routing = kernels.moe_lora_routing(
            pair_expert, pair_slot, adapters, experts, slot_ranks=ranks
        )
        y = kernels.moe_lora_shrink(x, a, pair_expert, pair_slot, ranks, 2, topk, routing)
        kernels.moe_lora_expand(
            y, b, pair_expert, pair_slot, ranks, scal, offsets, out, routing=routing
        )

    return call


def profile(call: Callable[[], None]) -> dict[str, Any]:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        call()
    wall_us = (time.perf_counter() - t0) / CALLS * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{file.rsplit('/', 2)[-2:] if '/' in file else file}:{line}:{name}",
                "calls_per_pair": round(ncalls / CALLS, 2),
                "own_us_per_pair": round(tottime / CALLS * 1e6, 2),
                "cum_us_per_pair": round(cumtime / CALLS * 1e6, 2),
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_pair"])
    return {"wall_us_per_pair": round(wall_us, 1), "top_own": rows[:30]}


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    result = {
        "torch": torch.__version__,
        "dense_qkv": profile(dense_pair()),
        "moe_gate_up": profile(moe_pair()),
    }
    text = json.dumps(result, indent=1)
    if argv:
        with open(argv[0], "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
