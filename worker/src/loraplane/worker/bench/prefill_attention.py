"""Kernel benchmark: a mixed step's attention, prompt chunks through one Triton launch vs SDPA per chunk.

    loraplane bench prefill-attention [--device cuda] [--out FILE] [--prefixes 0,1024]
        [--chunks 16] [--new 64] [--decodes 48] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--page-size 16] [--dtype bfloat16] [--layers 32]

CUDA only. One layer's ``Attention._attend`` on the step the H200's shared-prefix serve load
runs (``bench/run_gpu_kv.sh``): ``--chunks`` prompt chunks of ``--new`` tokens, each past a
cached prefix of ``--prefix`` positions (0: a prompt's first chunk), beside ``--decodes``
running rows of one token (at ``prefix + new + 64`` positions), Llama-3-8B's heads, every row
on pages scattered over the pool. Per prefix, timed with CUDA events
(``triton.testing.do_bench``, median, L2 flushed before each call):

* ``kernel_us``: the CUDA path, the decode rows through ``decode_attention`` and every prompt
  chunk through ``extend_attention`` (the batch's tiles built once, as a step builds them
  once for all its layers);
* ``sdpa_us``: the same step with ``Attention.prompt_kernel = False``: one
  ``scaled_dot_product_attention`` per chunk after gathering the row's keys;
* ``extend_us``: ``extend_attention`` alone;
* ``*_host_us``: host time per call without syncs (what the engine thread spends);
  ``tiles_host_us``: building a fresh batch's tiles (once per step);
* ``step_*_ms``: ``--layers`` layers of it, the attention's share of one step;
* ``max_abs_diff``: the two paths' outputs (bf16 rounding, ~1e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.bench.common import (
    JsonSink,
    env_info,
    host_launch_us,
    is_cuda,
    sync,
    time_device,
)


def scattered_chunks(
    layout: list[tuple[int, int]], page_size: int, pool: int, gen: torch.Generator
) -> tuple[list[Any], list[list[int]], int]:
    """One chunk per ``layout`` row ``(start, length)``, on pages drawn at random from a pool of
    ``pool`` (each row ``-(-max_len // page_size)`` of them, as a busy pool scatters them): the
    chunks, their (zero) token ids and the tokens in all."""
    from loraplane.worker.models.batch import SeqChunk

    per_row = -(-max(s + n for s, n in layout) // page_size)
    order = torch.randperm(pool, generator=gen).tolist()
    chunks, ids, offset = [], [], 0
    for row, (start, length) in enumerate(layout):
        pages = tuple(order[row * per_row : row * per_row + -(-(start + length) // page_size)])
        chunks.append(SeqChunk(row, start, length, offset, pages))
        ids.append([0] * length)
        offset += length
    return chunks, ids, offset


def measure_step(args: argparse.Namespace, prefix: int, device: torch.device) -> dict[str, Any]:
    """One case: the step with prompt chunks past ``prefix`` cached positions (``args``: the
    parsed options). On CPU (the unit tier's smoke test) the kernels run through Triton's
    interpreter and the times mean nothing."""
    from loraplane.worker import kernels
    from loraplane.worker.config import ModelConfig
    from loraplane.worker.models.batch import PROMPT_TILE, ForwardBatch
    from loraplane.worker.models.kv_cache import KVCache
    from loraplane.worker.models.model import Attention
    from loraplane.worker.parallel.state import ParallelState

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, d, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    config = ModelConfig(
        arch="llama",
        hidden_size=heads * d,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        intermediate_size=256,
        vocab_size=256,
    )
    attn = Attention(config, 0, ParallelState.single()).to(device, dtype)
    decode_len = prefix + args.new + 64
    max_len = max(prefix + args.new, decode_len + 1)
    rows = args.chunks + args.decodes
    per_row = -(-max_len // page)
    kv = KVCache(
        1, rows, max_len, kv_heads, d, dtype, device, page_size=page, num_pages=rows * per_row
    )
    gen = torch.Generator().manual_seed(0)
    layout = [(prefix, args.new)] * args.chunks + [(decode_len, 1)] * args.decodes
    chunks, ids, offset = scattered_chunks(layout, page, rows * per_row, gen)
    kv.sync_table(chunks)
    kv.k[0].normal_()
    kv.v[0].normal_()
    batch = ForwardBatch.from_chunks(ids, chunks, all_logits=False, device=device)
    q = torch.randn(offset, heads, d, device=device, dtype=dtype)

    def run_kernel() -> torch.Tensor:
        attn.prompt_kernel = True  # (what None gives on CUDA)
        return attn._attend(q, batch, kv)

    def run_sdpa() -> torch.Tensor:
        attn.prompt_kernel = False
        return attn._attend(q, batch, kv)

    tiles = batch.prompt_tiles(device, PROMPT_TILE)
    out = torch.empty_like(q)

    def run_extend() -> torch.Tensor:
        return kernels.extend_attention(  # type: ignore[no-any-return]
            q, kv.k[0], kv.v[0], kv.page_table, tiles, attn.scale, out, block_m=PROMPT_TILE
        )

    def tiles_host_us() -> float:
        """Median host time of a fresh batch's tiles (what a step pays once)."""
        times = []
        for _ in range(21):
            fresh = ForwardBatch.from_chunks(ids, chunks, all_logits=False, device=device)
            t0 = time.perf_counter()
            fresh.prompt_tiles(device, PROMPT_TILE)
            times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[len(times) // 2]

    diff = float((run_kernel().float() - run_sdpa().float()).abs().max())
    sync(device)
    kernel_us = time_device(run_kernel, str(device), rep_ms=args.rep_ms)
    sdpa_us = time_device(run_sdpa, str(device), rep_ms=args.rep_ms)
    return {
        "prefix": prefix,
        "chunks": args.chunks,
        "new": args.new,
        "decodes": args.decodes,
        "tokens": offset,
        "tiles": int(tiles.shape[0]),
        "kernel_us": round(kernel_us, 1),
        "sdpa_us": round(sdpa_us, 1),
        "speedup": float(f"{sdpa_us / kernel_us:.3g}"),  # (3 digits: on CPU it is ~0.003)
        "extend_us": round(time_device(run_extend, str(device), rep_ms=args.rep_ms), 1),
        "kernel_host_us": round(host_launch_us(run_kernel, str(device)) or 0.0, 1),
        "sdpa_host_us": round(host_launch_us(run_sdpa, str(device)) or 0.0, 1),
        "tiles_host_us": round(tiles_host_us(), 1),
        "step_kernel_ms": round(kernel_us * args.layers / 1e3, 2),
        "step_sdpa_ms": round(sdpa_us * args.layers / 1e3, 2),
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="loraplane bench prefill-attention", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefixes", default="0,1024", help="comma list of cached prefix lengths")
    p.add_argument("--chunks", type=int, default=16, help="prompt chunks in the step")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt chunk (>= 2)")
    p.add_argument("--decodes", type=int, default=48, help="one-token rows beside them")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--layers", type=int, default=32, help="layers per step (step_*_ms)")
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--out", type=Path, default=None, help="JSON file, written after every case")
    args = p.parse_args(argv)
    if not is_cuda(args.device) or not torch.cuda.is_available():
        print(
            f"prefill-attention: --device must be a CUDA device with a GPU present (it times "
            f"Triton kernels against SDPA on the GPU), got {args.device!r}"
            + ("" if torch.cuda.is_available() else " and no CUDA device is available"),
            file=sys.stderr,
        )
        return 2
    lows = {"chunks": 1, "new": 2, "decodes": 0, "heads": 1, "kv_heads": 1, "head_dim": 1}
    lows |= {"page_size": 1, "layers": 1}
    for name, low in lows.items():
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            print(
                f"prefill-attention: {flag} must be >= {low}, got {getattr(args, name)}",
                file=sys.stderr,
            )
            return 2
    prefixes = [int(x) for x in args.prefixes.split(",") if x]
    device = torch.device(args.device)
    sink = JsonSink(args.out, {"bench": "prefill_attention", "env": env_info(args.device)})
    for prefix in prefixes:
        case = sink.guarded(f"prefix {prefix}", measure_step, args, prefix, device)
        if case is not None:
            sink.append("cases", case)
    json.dump(sink.payload, sys.stdout, indent=1, default=str)
    print()
    return 1 if sink.payload.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
