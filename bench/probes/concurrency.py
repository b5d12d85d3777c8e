"""Probe: how much of a decode layer's LoRA can leave the critical path (CUDA only).

    python bench/probes/concurrency.py OUT.json [CARVEOUTS]

``CARVEOUTS`` (e.g. ``8,16,32``) also measures ``base``, ``residual`` and ``aside`` with the
cuBLAS GEMMs told to leave that many SMs free (``torch._C._set_sm_carveout_experimental``,
set while the graph is captured), keyed ``mode@N``: whether LoRA kernels on the side stream
can run beside a GEMM that does not occupy every SM, and what the GEMMs lose.

A Llama-3-8B-shaped decode layer stack (cuBLAS projections, torch norms and SwiGLU, our
decode attention) is captured in one CUDA graph per variant and replayed:

- ``base``: no LoRA.
- ``serial``: shrink and expand after each projection.
- ``overlap``: the shrink on a side stream beside the projection (the runtime's default).
- ``residual``: as ``overlap`` for qkv/gate_up; the o/down LoRA (shrink and expand) runs
  wholly on the side stream and adds into the residual stream, joined before the residual add.
- ``delta``: as ``residual``, and the qkv/gate_up LoRA wholly aside into a zeroed delta that
  is added to the projection's output after it.
- ``aside``: every LoRA wholly on the side stream into its own buffers (a bound, not correct).

Prints one JSON object: step microseconds per (batch, adapters, variant) and the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F

from loraplane.worker import kernels

H, INTER, HEADS, KV, D, LAYERS, CTX, R = 4096, 14336, 32, 8, 128, 8, 512, 16


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return w * h.to(x.dtype)


class Layer:
    def __init__(self, slots: int, dev: str) -> None:
        bf = {"dtype": torch.bfloat16, "device": dev}
        qkv_n = (HEADS + 2 * KV) * D
        self.w = {
            "qkv": torch.randn(qkv_n, H, **bf) * 0.02,
            "o": torch.randn(H, HEADS * D, **bf) * 0.02,
            "gate_up": torch.randn(2 * INTER, H, **bf) * 0.02,
            "down": torch.randn(H, INTER, **bf) * 0.02,
        }
        slices = {
            "qkv": [HEADS * D, KV * D, KV * D],
            "o": [H],
            "gate_up": [INTER, INTER],
            "down": [H],
        }
        k_in = {"qkv": H, "o": HEADS * D, "gate_up": H, "down": INTER}
        self.lora = {}
        for name, widths in slices.items():
            offs = [0]
            for w in widths:
                offs.append(offs[-1] + w)
            a = torch.randn(slots, len(widths) * R, k_in[name], **bf) * 0.02
            b = torch.randn(slots, offs[-1], R, **bf) * 0.02
            self.lora[name] = (a, b, torch.tensor(offs, dtype=torch.int32, device=dev))
        self.norm = torch.ones(H, **bf)
        self.k_cache = torch.randn(130, CTX + 1, KV, D, **bf)
        self.v_cache = torch.randn(130, CTX + 1, KV, D, **bf)


MODES = ("base", "serial", "overlap", "residual", "delta", "aside")


def measure(
    layers: list[Layer],
    side: torch.cuda.Stream,
    slots: int,
    bs: int,
    n_ad: int,
    carveouts: tuple[int, ...] = (),
) -> dict[str, float]:
    dev = "cuda"
    x0 = torch.randn(bs, H, dtype=torch.bfloat16, device=dev)
    per = bs // n_ad
    indptr = torch.tensor([i * per for i in range(n_ad + 1)], dtype=torch.int32, device=dev)
    seg_slots = torch.arange(n_ad, dtype=torch.int32, device=dev)
    ranks = torch.full((slots,), R, dtype=torch.int32, device=dev)
    scal = torch.full((slots,), 2.0, dtype=torch.float32, device=dev)
    seg_ranks = ranks[:n_ad].clone()
    seg_scal = scal[:n_ad].clone()
    rows = torch.arange(bs, device=dev)
    pos = torch.full((bs,), CTX - 1, dtype=torch.int64, device=dev)

    def shrink(layer: Layer, name: str, x: torch.Tensor, cap: int | None = None):
        a, b, offs = layer.lora[name]
        return kernels.lora_apply_shrink(
            x,
            a,
            b,
            indptr,
            seg_slots,
            ranks,
            scal,
            None,
            offs,
            per,
            seg_ranks=seg_ranks,
            seg_scalings=seg_scal,
            max_split_k=cap,
        )

    def proj(layer: Layer, name: str, x: torch.Tensor, mode: str, residual=None):
        w = layer.w[name]
        if mode == "base":
            return F.linear(x, w), None
        if mode == "serial":
            out = F.linear(x, w)
            shrink(layer, name, x).expand_into(out)
            return out, None
        whole = mode == "aside" or (mode in ("residual", "delta") and name in ("o", "down"))
        if mode == "delta" and not whole:
            # the whole LoRA aside into a zeroed delta, added after the projection
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                delta = torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                shrink(layer, name, x).expand_into(delta)
            out = F.linear(x, w)
            torch.cuda.current_stream().wait_stream(side)
            return out.add_(delta), None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pending = shrink(layer, name, x)
            if whole:
                target = residual if mode != "aside" else x.new_empty(x.shape[0], w.shape[0])
                pending.expand_into(target)
        out = F.linear(x, w)
        if whole:
            return out, "join"
        torch.cuda.current_stream().wait_stream(side)
        pending.expand_into(out)
        return out, None

    def step(mode: str) -> torch.Tensor:
        h = x0.clone()
        for layer in layers:
            qkv, _ = proj(layer, "qkv", rms(h, layer.norm), mode, h)
            q = qkv[:, : HEADS * D].reshape(bs, HEADS, D)
            att = kernels.decode_attention(q, layer.k_cache, layer.v_cache, rows, pos + 1, D**-0.5)
            o, join = proj(layer, "o", att.reshape(bs, HEADS * D), mode, h)
            if join:
                torch.cuda.current_stream().wait_stream(side)
            h = h + o
            gu, _ = proj(layer, "gate_up", rms(h, layer.norm), mode, h)
            g, u = gu.chunk(2, dim=-1)
            d, join = proj(layer, "down", F.silu(g) * u, mode, h)
            if join:
                torch.cuda.current_stream().wait_stream(side)
            h = h + d
        if mode == "aside":
            torch.cuda.current_stream().wait_stream(side)
        return h

    times = {}
    runs = [(m, 0) for m in MODES] + [
        (m, c) for c in carveouts for m in ("base", "residual", "aside")
    ]
    for mode, carve in runs:
        torch._C._set_sm_carveout_experimental(carve or None)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step(mode)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(mode)
        torch._C._set_sm_carveout_experimental(None)
        g.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(3):
            for _ in range(30):
                e0, e1 = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                samples.append(e0.elapsed_time(e1) * 1e3)
        times[f"{mode}@{carve}" if carve else mode] = statistics.median(samples)
        del g
    row = {m: round(t, 1) for m, t in times.items()}
    row.update({f"ratio_{m}": round(times["base"] / t, 3) for m, t in times.items() if m != "base"})
    for c in carveouts:  # against the same carveout's base: what the side stream now hides
        for m in ("residual", "aside"):
            row[f"ratio_{m}@{c}_vs_own_base"] = round(times[f"base@{c}"] / times[f"{m}@{c}"], 3)
    return row


def main(out_path: str, carveouts: tuple[int, ...] = ()) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    slots = 4
    layers = [Layer(slots, dev) for _ in range(LAYERS)]
    side = torch.cuda.Stream()
    results: dict[str, dict[str, float]] = {}
    for bs in (16, 64, 128):
        for n_ad in (1, 4):
            key = f"bs{bs}-a{n_ad}"
            results[key] = measure(layers, side, slots, bs, n_ad, carveouts)
            print(key, results[key], flush=True)
    out = {"probe": "concurrency", "gpu": torch.cuda.get_device_name(), "results": results}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(c) for c in sys.argv[2].split(",")) if len(sys.argv) > 2 else ())
