"""Probe: SwiGLU with gate_up's LoRA expand fused in, against expand + SwiGLU (CUDA).

    python bench/probes/swiglu.py OUT.json

Graph-timed from cold L2 (``bench.common.time_graph``), Llama-3-8B gate_up (I = 14336,
K = 4096), rank 16, decode rows 16/64/128 spread over 1/4/16 adapters as the runtime batches
them. Prints one JSON line per case: torch ``silu`` + ``mul``, the Triton ``silu_and_mul``,
``expand`` then ``silu_and_mul``, and the fused kernel under several block shapes.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from loraplane.worker import kernels
from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels import swiglu
from loraplane.worker.lora.batch_info import LoRABatchInfo

INTER, HIDDEN, RANK = 14336, 4096, 16
BLOCKS = [None, (16, 64, 4), (16, 256, 8), (32, 128, 4), (64, 64, 4), (16, 128, 8)]


def one_case(t: int, adapters: int) -> dict[str, object]:
    dev = "cuda"
    a = torch.randn(adapters, 2 * RANK, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(adapters, 2 * INTER, RANK, device=dev, dtype=torch.bfloat16) * 0.02
    ranks = torch.full((adapters,), RANK, dtype=torch.int32, device=dev)
    scalings = torch.full((adapters,), 2.0, dtype=torch.float32, device=dev)
    offsets = torch.tensor([0, INTER, 2 * INTER], dtype=torch.int32, device=dev)
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(t, 2 * INTER, device=dev, dtype=torch.bfloat16)
    info = LoRABatchInfo.build([i % adapters for i in range(t)], ranks, scalings, dev)
    assert info is not None

    def shrink(by_row: bool) -> kernels.PendingLoRA:
        return kernels.lora_apply_shrink(
            x,
            a,
            b,
            info.seg_indptr,
            info.seg_slots,
            ranks,
            scalings,
            info.row_order,
            offsets,
            info.max_seg_len,
            seg_ranks=info.seg_ranks,
            seg_scalings=info.seg_scalings,
            by_row=by_row,
        )

    by_pos, by_row = shrink(False), shrink(True)
    scratch = gu.clone()

    def expand_then_silu_mul() -> torch.Tensor:
        by_pos.expand_into(scratch)
        return kernels.silu_and_mul(scratch)

    row: dict[str, object] = {"rows": t, "adapters": adapters}
    row["torch_silu_mul"] = time_graph(lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:], dev)
    row["triton_silu_mul"] = time_graph(lambda: kernels.silu_and_mul(gu), dev)
    row["expand"] = time_graph(lambda: by_pos.expand_into(scratch), dev)
    row["expand_then_silu_mul"] = time_graph(expand_then_silu_mul, dev)
    for blocks in BLOCKS:
        swiglu.FORCE_BLOCKS = blocks
        name = "fused" if blocks is None else "fused_" + "x".join(map(str, blocks))
        row[name] = time_graph(lambda: by_row.silu_mul(gu, info.token_slots, ranks, scalings), dev)
    swiglu.FORCE_BLOCKS = None
    return row


def main(out: str) -> None:
    torch.manual_seed(0)
    rows = []
    for adapters in (1, 4, 16):
        for t in (16, 64, 128):
            row = one_case(t, adapters)
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            )
            rows.append(row)
    with open(out, "w") as f:
        json.dump({"probe": "swiglu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
