"""Probe: the expand kernel's time per block config (CUDA only).

    python bench/probes/expand_tune.py OUT.json [MAX_SECONDS]

The expand (``kernels/expand.py``) is what batches of more than the stage's adapters, prefill,
eager steps and every per-expert MoE LoRA run. For Llama-3-8B-shaped qkv / o / gate_up / down
and Qwen3-30B-A3B-shaped MoE gate_up / down at decode sizes (16 and 128 tokens; 1, 4, 16
adapters interleaved; ranks 16 and 64), each expand is graph-timed from cold L2
(``bench.common.time_graph``) at every ``(block_n, num_warps)`` of ``CONFIGS``
(``_triton_utils.EXPAND_OVERRIDE``), next to a device copy of the same bytes. (The kernel branches past the slices a column block
misses rather than loading them masked: ``bench/results/2026-11-30-h200-s9``, c0a6763.) Bytes are counted as
``bench/kernels.py`` counts them (y, each used B once at the real rank, out read + written);
``pct_peak`` is against a 2 GiB copy in the same run (``bench.common.copy_bandwidth``, as
``bench/kernels.py``: a 1 GiB copy timed in a graph reads a peak of 2756 GB/s against 4246,
which would make every percentage 1.54x too high). Prints one JSON
object per case and writes them all to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from loraplane.worker import kernels
from loraplane.worker.bench.common import copy_bandwidth, copy_of, time_graph
from loraplane.worker.kernels import _triton_utils
from loraplane.worker.lora.batch_info import LoRABatchInfo

# name: (slice widths, experts, topk)
MODULES = {
    "qkv": ((4096, 1024, 1024), 0, 1),
    "o": ((4096,), 0, 1),
    "gate_up": ((14336, 14336), 0, 1),
    "down": ((4096,), 0, 1),
    "moe_gate_up": ((768, 768), 128, 8),
    "moe_down": ((2048,), 128, 8),
}
CONFIGS = [(64, 4), (128, 4), (128, 8), (256, 4), (256, 8)]


def _case(
    name: str, tokens: int, adapters: int, rank: int
) -> tuple[Callable[[], None], int, torch.Tensor]:
    """The expand call of one case, its counted bytes, and its output (for an equality check)."""
    dev, dt, es = "cuda", torch.bfloat16, 2
    widths, experts, topk = MODULES[name]
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    n, slices = offs[-1], len(widths)
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    ranks = torch.full((adapters,), rank, dtype=torch.int32, device=dev)
    scal = torch.full((adapters,), 2.0, dtype=torch.float32, device=dev)
    token_slots = [i % adapters for i in range(tokens)]
    if experts:
        pairs = tokens * topk
        b = torch.randn(adapters, experts, n, rank, device=dev, dtype=dt) * 0.05
        y = torch.randn(pairs, slices * rank, device=dev, dtype=dt)
        out = torch.randn(pairs, n, device=dev, dtype=dt)
        g = torch.Generator(device=dev).manual_seed(tokens)
        scores = torch.rand((tokens, experts), device=dev, generator=g)
        pair_expert = scores.topk(topk, dim=-1).indices.reshape(-1).to(torch.int32)
        pair_slot = torch.tensor(token_slots, dtype=torch.int32, device=dev).repeat_interleave(topk)
        routing = kernels.moe_lora_routing(
            pair_expert, pair_slot, adapters, experts, slot_ranks=ranks
        )  # as the runtime builds it: the tiles carry the ranks
        used = int(torch.unique(pair_slot.long() * experts + pair_expert.long()).numel())

        def call() -> None:
            kernels.moe_lora_expand(
                y, b, pair_expert, pair_slot, ranks, scal, offsets, out, routing=routing
            )

        rows = pairs
    else:
        b = torch.randn(adapters, n, rank, device=dev, dtype=dt) * 0.05
        y = torch.randn(tokens, slices * rank, device=dev, dtype=dt)
        out = torch.randn(tokens, n, device=dev, dtype=dt)
        info = LoRABatchInfo.build(token_slots, ranks, scal, dev)
        assert info is not None
        used = adapters

        seg = (info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings)

        def call() -> None:
            kernels.lora_expand(y, b, *seg, info.row_order, offsets, out, info.max_seg_len)

        rows = tokens
    nbytes = rows * slices * rank * es + used * n * rank * es + 2 * rows * n * es
    return call, nbytes, out


def main(out_path: str, max_seconds: float) -> None:
    torch.manual_seed(0)
    t0 = time.monotonic()
    peak = copy_bandwidth("cuda")["gbytes_per_s"]  # as bench/kernels.py measures it
    rows: list[dict[str, Any]] = []
    for name in MODULES:
        for rank in (16, 64):
            for tokens in (16, 128):
                for adapters in (1, 4, 16):
                    if time.monotonic() - t0 > max_seconds:
                        break
                    call, nbytes, out = _case(name, tokens, adapters, rank)
                    row: dict[str, Any] = {
                        "module": name,
                        "rank": rank,
                        "tokens": tokens,
                        "adapters": adapters,
                        "bytes": nbytes,
                    }
                    row["copy_us"] = round(time_graph(copy_of(nbytes, "cuda"), "cuda") or 0.0, 2)
                    pristine, results = out.clone(), {}
                    for block_n, warps in CONFIGS:
                        _triton_utils.EXPAND_OVERRIDE = (block_n, warps)
                        key = f"n{block_n}_w{warps}"
                        out.copy_(pristine)  # timing adds into out: each config from the same
                        call()
                        results[key] = out - pristine  # the term this config added
                        row[key] = round(time_graph(call, "cuda") or 0.0, 2)
                    _triton_utils.EXPAND_OVERRIDE = None
                    first = next(iter(results.values())).float()
                    row["max_diff"] = max(
                        float((r.float() - first).abs().max()) for r in results.values()
                    )
                    times = {k: row[k] for k in results}
                    best = min(times, key=lambda k: times[k])
                    row["best"] = best
                    row["best_pct_peak"] = round(100 * nbytes / times[best] / 1e3 / peak, 1)
                    row["default_pct_peak"] = round(100 * nbytes / times["n128_w4"] / 1e3 / peak, 1)
                    row["copy_pct_peak"] = round(100 * nbytes / row["copy_us"] / 1e3 / peak, 1)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    with open(out_path, "w") as f:
                        json.dump(
                            {
                                "probe": "expand_tune",
                                "gpu": torch.cuda.get_device_name(),
                                "torch": torch.__version__,
                                "peak_gbs": peak,
                                "rows": rows,
                            },
                            f,
                        )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240.0)
