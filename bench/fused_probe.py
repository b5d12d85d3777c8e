"""Fused shrink+expand vs the two-step Triton path vs the base matmul, at decode shapes of a
Llama-3-8B layer, timed as CUDA-graph replays (launch overhead out, as in a graphed decode step).

    python3 bench/fused_probe.py [--out FILE]     (H200 via the device tool; prints JSON)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def graph_time_us(fn, iters: int = 50) -> float:
    """Median over 5 replays of a graph holding `iters` calls, per call, in microseconds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out")
    args = parser.parse_args()
    from loraplane.worker.kernels import expand, reference, shrink
    from loraplane.worker.kernels.fused import lora_shrink_expand
    from loraplane.worker.lora.batch_info import LoRABatchInfo

    dev, dtype, r_max, slots = "cuda", torch.bfloat16, 16, 4
    modules = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
    rows = []
    for tokens in (16, 64, 128):
        per_layer = {"base": 0.0, "two_step": 0.0, "fused": 0.0}
        for name, (k, sizes) in modules.items():
            n = len(sizes)
            token_slots = [i % slots for i in range(tokens)]  # 4 adapters, interleaved
            ranks = torch.full((slots,), 16, dtype=torch.int32, device=dev)
            scal = torch.full((slots,), 2.0, dtype=torch.float32, device=dev)
            info = LoRABatchInfo.build(token_slots, ranks, scal, dev)
            assert info is not None
            offs = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            x = torch.randn(tokens, k, device=dev, dtype=dtype)
            w = torch.randn(int(offs[-1]), k, device=dev, dtype=dtype) / k**0.5
            a = torch.randn(slots, n * r_max, k, device=dev, dtype=dtype) / k**0.5
            b = torch.randn(slots, int(offs[-1]), r_max, device=dev, dtype=dtype) / r_max**0.5
            out = torch.zeros(tokens, int(offs[-1]), device=dev, dtype=dtype)
            seg = (info.seg_indptr, info.seg_slots, info.slot_ranks)

            def base() -> None:
                torch.mm(x, w.t(), out=out)

            def two_step() -> None:
                y = shrink.lora_shrink(x, a, *seg, info.row_order, n, info.max_seg_len)
                expand.lora_expand(y, b, *seg, info.slot_scalings, info.row_order, offs, out, info.max_seg_len)

            def fused(n_sub: int | None = None) -> None:
                lora_shrink_expand(x, a, b, *seg, info.slot_scalings, info.row_order, offs, out, info.max_seg_len, n_sub=n_sub)

            # correctness against the torch references first
            ref_out = torch.zeros_like(out, dtype=torch.float32)
            y_ref = reference.lora_shrink(x, a, *seg, info.row_order, n, info.max_seg_len)
            reference.lora_expand(y_ref, b, *seg, info.slot_scalings, info.row_order, offs, ref_out, info.max_seg_len)
            out.zero_()
            fused()
            err = float((out.float() - ref_out).norm() / ref_out.norm())
            t_base, t_two, t_fused = graph_time_us(base), graph_time_us(two_step), graph_time_us(fused)
            by_sub = {n: graph_time_us(lambda n=n: fused(n)) for n in (1, 2, 4, 8, 16)}
            per_layer["base"] += t_base
            per_layer["two_step"] += t_two
            per_layer["fused"] += t_fused
            rows.append({"module": name, "tokens": tokens, "base_us": t_base, "two_step_us": t_two, "fused_us": t_fused, "fused_rel_err": err,
                         "fused_us_by_n_sub": by_sub})
        rows.append({"module": "layer_linears", "tokens": tokens, **{f"{k}_us": v for k, v in per_layer.items()},
                     "ratio_two_step": per_layer["base"] / (per_layer["base"] + per_layer["two_step"]),
                     "ratio_fused": per_layer["base"] / (per_layer["base"] + per_layer["fused"])})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    for r in rows:
        if r["module"] == "layer_linears":
            print(f"T={r['tokens']}: linears base {r['base_us']:.1f} us, +two-step {r['two_step_us']:.1f} us, +fused {r['fused_us']:.1f} us; "
                  f"linear-only ratio two-step {r['ratio_two_step']:.3f} fused {r['ratio_fused']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
