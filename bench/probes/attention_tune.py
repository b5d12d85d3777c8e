"""Probe: decode attention per configuration (CUDA only).

    python bench/probes/attention_tune.py OUT.json [MAX_SECONDS] [quick]

``kernels/attention.py`` at Llama-3-8B's heads (32 q, 8 KV, d 128), bf16, every row at the
same length: 16/32/64/128 rows at 512 and 4096 positions. For each ``(CHUNK, BLOCK_L,
NUM_WARPS)`` of ``CONFIGS`` it times the splits rule (``splits_for``), one split (no combine)
and a few fixed counts, graph-timed from cold L2 (``bench.common.time_graph``). Bandwidth counts the K and V bytes read. Writes OUT.json after every case.
``quick``: the kernel's own configuration only, with the rule and with one split.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from typing import Any

import torch

from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import attention

DEV = "cuda"
HEADS, KV, D = 32, 8, 128
# (CHUNK, BLOCK_L, NUM_WARPS)
CONFIGS = [
    (128, 64, 4),
    (256, 64, 4),
    (256, 32, 4),
    (128, 32, 4),
    (256, 128, 4),
    (256, 64, 8),
]
SPLITS = [None, 1, 4, 16]  # None: the rule


def main(argv: list[str]) -> int:
    out_path = argv[0]
    budget = float(argv[1]) if len(argv) > 1 else 200.0
    quick = len(argv) > 2 and argv[2] == "quick"
    configs = [(attention.CHUNK, attention.BLOCK_L, attention.NUM_WARPS)] if quick else CONFIGS
    split_counts = [None, 1] if quick else SPLITS
    t0 = time.monotonic()
    result: dict[str, Any] = {"probe": "attention_tune", "cases": []}
    defaults = (attention.CHUNK, attention.BLOCK_L, attention.NUM_WARPS)
    for ctx in (512, 4096):
        for bs in (16, 32, 64, 128):
            k = torch.randn(bs + 1, ctx + 64, KV, D, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(bs, HEADS, D, device=DEV, dtype=torch.bfloat16)
            rows = torch.arange(bs, device=DEV)
            table = torch.arange(bs + 1, device=DEV, dtype=torch.int32)[:, None]  # a page a row
            lens = torch.full((bs,), ctx, device=DEV, dtype=torch.int64)
            kv_bytes = 2 * bs * ctx * KV * D * 2
            for chunk, block_l, warps in configs:
                if time.monotonic() - t0 > budget:
                    result["truncated"] = True
                    break
                attention.CHUNK, attention.BLOCK_L, attention.NUM_WARPS = chunk, block_l, warps
                for splits in split_counts:
                    attention.SPLITS_OVERRIDE = splits
                    rule = attention.splits_for(bs, KV, q.device)
                    call = partial(attention.decode_attention, q, k, v, table, rows, lens, D**-0.5)
                    us = time_graph(call, DEV)
                    row = {
                        "ctx": ctx,
                        "bs": bs,
                        "chunk": chunk,
                        "block_l": block_l,
                        "warps": warps,
                        "splits": rule,
                        "rule": splits is None,
                        "us": us,
                        "gbs": kv_bytes / us / 1e3 if us else None,
                    }
                    result["cases"].append(row)
                    print(json.dumps(row), flush=True)
            attention.CHUNK, attention.BLOCK_L, attention.NUM_WARPS = defaults
            attention.SPLITS_OVERRIDE = None
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
