"""Segmented LoRA kernels on a GPU: bf16 error against the torch reference, and decode timings.

    python bench/kernels_bench.py [--json OUT.json] [--iters N]

Needs CUDA (compiled Triton, not the interpreter). For each shape it reports the max abs error
of the Triton kernels against ``reference`` (same bf16 inputs), the time per launch (CUDA-graph
replay, ``triton.testing.do_bench_cudagraph``), and the bandwidth over the minimal bytes each
kernel must move (x / y / out rows once, each segment's own rank rows of A or B once).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import triton.testing

from loraplane.worker.kernels import expand, moe, reference, shrink

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e datasheet


@dataclass
class Row:
    name: str
    kernel: str
    max_abs_err: float
    ref_max_abs: float
    us: float
    gbytes_per_s: float
    pct_peak: float


def dense_problem(
    tokens: int, hidden: int, offsets: list[int], ranks: list[int], max_rank: int, seed: int = 0
) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    num_slots, num_slices = len(ranks), len(offsets) - 1
    # Tokens spread round-robin over the slots, then sorted by slot (row_order), as the
    # scheduler's batch info does; segment s = the tokens of slot s.
    token_slot = torch.arange(tokens, device=dev) % num_slots
    row_order = torch.sort(token_slot, stable=True).indices.to(torch.int64)
    counts = torch.bincount(token_slot, minlength=num_slots)
    indptr = torch.zeros(num_slots + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(counts, 0)
    return dict(
        x=torch.randn(tokens, hidden, device=dev, generator=gen).to(dt),
        lora_a=(
            torch.randn(num_slots, num_slices * max_rank, hidden, device=dev, generator=gen) * 0.02
        ).to(dt),
        lora_b=(torch.randn(num_slots, offsets[-1], max_rank, device=dev, generator=gen) * 0.02).to(
            dt
        ),
        seg_indptr=indptr,
        seg_slots=torch.arange(num_slots, dtype=torch.int32, device=dev),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=dev),
        slot_scalings=torch.tensor([2.0] * num_slots, device=dev),
        row_order=row_order,
        slice_offsets=torch.tensor(offsets, dtype=torch.int32, device=dev),
        max_seg_len=int(counts.max()),
        num_slices=num_slices,
    )


def bench(fn: object, iters: int) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=iters)) * 1e3  # ms -> us


def run_dense(name: str, p: dict[str, object], iters: int) -> list[Row]:
    x, a, b = p["x"], p["lora_a"], p["lora_b"]
    assert (
        isinstance(x, torch.Tensor) and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    )
    args = (p["seg_indptr"], p["seg_slots"], p["slot_ranks"], p["row_order"])
    y_ref = reference.lora_shrink(x, a, *args, p["num_slices"], p["max_seg_len"])  # type: ignore[arg-type]
    y_tri = shrink.lora_shrink(x, a, *args, p["num_slices"], p["max_seg_len"])  # type: ignore[arg-type]
    out0 = torch.randn(x.shape[0], b.shape[1], device="cuda").to(torch.bfloat16)
    out_ref, out_tri = out0.clone(), out0.clone()
    eargs = (
        p["seg_indptr"],
        p["seg_slots"],
        p["slot_ranks"],
        p["slot_scalings"],
        p["row_order"],
        p["slice_offsets"],
    )
    reference.lora_expand(y_ref, b, *eargs, out_ref, p["max_seg_len"])  # type: ignore[arg-type]
    expand.lora_expand(y_ref, b, *eargs, out_tri, p["max_seg_len"])  # type: ignore[arg-type]

    ranks = p["slot_ranks"].tolist()  # type: ignore[union-attr]
    num_slices = int(p["num_slices"])  # type: ignore[call-overload]
    tokens, hidden, n_total = x.shape[0], x.shape[1], b.shape[1]
    used = sum(ranks)  # every slot has a segment here
    shrink_bytes = 2 * (tokens * hidden + num_slices * used * hidden + tokens * y_ref.shape[1])
    expand_bytes = 2 * (tokens * y_ref.shape[1] + n_total * used + 2 * tokens * n_total)

    t_shrink = bench(
        lambda: shrink.lora_shrink(x, a, *args, p["num_slices"], p["max_seg_len"]), iters
    )  # type: ignore[arg-type]
    out_bench = out0.clone()
    t_expand = bench(
        lambda: expand.lora_expand(y_ref, b, *eargs, out_bench, p["max_seg_len"]), iters
    )  # type: ignore[arg-type]
    return [
        row(name, "shrink", y_tri, y_ref, t_shrink, shrink_bytes),
        row(name, "expand", out_tri - out0, out_ref - out0, t_expand, expand_bytes),
    ]


def row(
    name: str, kernel: str, got: torch.Tensor, want: torch.Tensor, us: float, nbytes: int
) -> Row:
    err = (got.float() - want.float()).abs().max().item()
    rate = nbytes / (us * 1e-6)
    return Row(
        name,
        kernel,
        err,
        want.float().abs().max().item(),
        us,
        rate / 1e9,
        100 * rate / PEAK_BYTES_PER_S,
    )


def run_moe(
    name: str,
    tokens: int,
    topk: int,
    experts: int,
    hidden: int,
    offsets: list[int],
    ranks: list[int],
    max_rank: int,
    iters: int,
) -> list[Row]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    num_slots, num_slices = len(ranks), len(offsets) - 1
    x = torch.randn(tokens, hidden, device=dev, generator=gen).to(dt)
    pair_expert = torch.randint(
        0, experts, (tokens * topk,), device=dev, generator=gen, dtype=torch.int32
    )
    pair_slot = (torch.arange(tokens, device=dev, dtype=torch.int32) % num_slots).repeat_interleave(
        topk
    )
    a = (
        torch.randn(num_slots, experts, num_slices * max_rank, hidden, device=dev, generator=gen)
        * 0.02
    ).to(dt)
    b = (
        torch.randn(num_slots, experts, offsets[-1], max_rank, device=dev, generator=gen) * 0.02
    ).to(dt)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scal = torch.tensor([2.0] * num_slots, device=dev)
    offs = torch.tensor(offsets, dtype=torch.int32, device=dev)
    routing = moe.moe_lora_routing(pair_expert, pair_slot, num_slots, experts)
    y_ref = reference.moe_lora_shrink(x, a, pair_expert, pair_slot, ranks_t, num_slices, topk=topk)
    y_tri = moe.moe_lora_shrink(
        x, a, pair_expert, pair_slot, ranks_t, num_slices, topk=topk, routing=routing
    )
    out0 = torch.randn(tokens * topk, offsets[-1], device=dev).to(dt)
    out_ref, out_tri = out0.clone(), out0.clone()
    reference.moe_lora_expand(y_ref, b, pair_expert, pair_slot, ranks_t, scal, offs, out_ref)
    moe.moe_lora_expand(
        y_ref, b, pair_expert, pair_slot, ranks_t, scal, offs, out_tri, routing=routing
    )

    groups = {
        (int(w), int(e)) for w, e in zip(pair_slot.tolist(), pair_expert.tolist(), strict=True)
    }
    used = sum(ranks[w] for w, _ in groups)
    pairs, n_total = tokens * topk, offsets[-1]
    shrink_bytes = 2 * (tokens * hidden + num_slices * used * hidden + pairs * y_ref.shape[1])
    expand_bytes = 2 * (pairs * y_ref.shape[1] + n_total * used + 2 * pairs * n_total)
    t_route = bench(lambda: moe.moe_lora_routing(pair_expert, pair_slot, num_slots, experts), iters)
    t_shrink = bench(
        lambda: moe.moe_lora_shrink(
            x, a, pair_expert, pair_slot, ranks_t, num_slices, topk=topk, routing=routing
        ),
        iters,
    )
    out_bench = out0.clone()
    t_expand = bench(
        lambda: moe.moe_lora_expand(
            y_ref, b, pair_expert, pair_slot, ranks_t, scal, offs, out_bench, routing=routing
        ),
        iters,
    )
    zero = torch.zeros(1, device=dev)
    return [
        row(name, "routing", zero, zero, t_route, 1),
        row(name, "shrink", y_tri, y_ref, t_shrink, shrink_bytes),
        row(name, "expand", out_tri - out0, out_ref - out0, t_expand, expand_bytes),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--iters", type=int, default=100, help="do_bench_cudagraph rep (ms)")
    args = parser.parse_args()
    ranks = [8, 16, 32, 64]
    rows: list[Row] = []
    # Llama-3-8B-like: hidden 4096, GQA qkv 4096 + 1024 + 1024, gate_up 2 x 14336, down.
    for tokens in (1, 16, 64, 256):
        rows += run_dense(
            f"qkv T={tokens}",
            dense_problem(tokens, 4096, [0, 4096, 5120, 6144], ranks, 64),
            args.iters,
        )
        rows += run_dense(
            f"gate_up T={tokens}",
            dense_problem(tokens, 4096, [0, 14336, 28672], ranks, 64),
            args.iters,
        )
        rows += run_dense(
            f"down T={tokens}", dense_problem(tokens, 14336, [0, 4096], ranks, 64), args.iters
        )
    rows += run_dense(
        "qkv T=2048 prefill",
        dense_problem(2048, 4096, [0, 4096, 5120, 6144], ranks, 64),
        args.iters,
    )
    # Qwen3-30B-A3B-like experts: hidden 2048, moe intermediate 768, 128 experts, top-8.
    for tokens in (16, 64):
        rows += run_moe(
            f"moe gate_up T={tokens}",
            tokens,
            8,
            128,
            2048,
            [0, 768, 1536],
            [8, 16, 16, 16],
            16,
            args.iters,
        )
        rows += run_moe(
            f"moe down T={tokens}",
            tokens * 8,
            1,
            128,
            768,
            [0, 2048],
            [8, 16, 16, 16],
            16,
            args.iters,
        )
    print(
        f"{'shape':24s} {'kernel':8s} {'max_abs_err':>12s} {'ref_max':>9s} {'us':>9s} {'GB/s':>8s} {'%peak':>6s}"
    )
    for r in rows:
        print(
            f"{r.name:24s} {r.kernel:8s} {r.max_abs_err:12.3e} {r.ref_max_abs:9.3f} {r.us:9.2f} {r.gbytes_per_s:8.0f} {r.pct_peak:6.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
