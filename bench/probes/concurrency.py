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
- ``empty_aside``: as ``aside``, with each LoRA kernel replaced by a one-program kernel that
  stores one word: what the launches alone cost beside the base.
- ``empty_main``: the same empty kernels on the main stream, after each projection.
- ``stacked``: no shrink kernel. Each projection's weight has the batch's adapters' A rows
  stacked under it, so one cuBLAS GEMM writes the base output and ``y``; the expand reads
  ``y`` from the GEMM's extra columns (``y_seg_cols``) after it, on the main stream.
- ``stacked16``: as ``stacked``, with 16 adapters' A rows in every GEMM whatever the batch.
- ``fused``: as ``stacked``, and the expands of o/down and gate_up fused into what follows
  them (the runtime's ``kernels/stacked.py``, which this probe's first form led to):
  ``h + o + lora`` in one kernel instead of the expand and the residual add,
  ``silu(g + lora) * (u + lora)`` instead of the expand and the SwiGLU.

Prints one JSON object: step microseconds per (batch, adapters, variant) and the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplane.worker import kernels
from loraplane.worker.kernels._triton_utils import StageInfo, with_tiles

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
        # each weight with STACK_MAX adapters' A rows under it: the slots' own A first, then
        # random rows (values past the slots' do not matter here)
        self.stacked = {}
        for name, w in self.w.items():
            a = self.lora[name][0]
            extra = torch.randn((STACK_MAX - slots) * a.shape[1], w.shape[1], **bf) * 0.02
            self.stacked[name] = torch.cat([w, a.reshape(-1, a.shape[2]), extra])
        self.norm = torch.ones(H, **bf)
        self.k_cache = torch.randn(130, CTX + 1, KV, D, **bf)
        self.v_cache = torch.randn(130, CTX + 1, KV, D, **bf)


MODES = (
    "base",
    "serial",
    "overlap",
    "residual",
    "delta",
    "aside",
    "empty_aside",
    "empty_main",
    "stacked",
    "stacked16",
    "fused",
)
STACK_MAX = 16


@triton.jit
def _one_word(p):
    tl.store(p, 1)


def build_step(layers: list[Layer], side: torch.cuda.Stream, slots: int, bs: int, n_ad: int):
    """``step(mode)``: one decode step of the layer stack in that mode (see the docstring)."""
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
    table = torch.arange(130, device=dev, dtype=torch.int32)[:, None]  # one page per row
    pos = torch.full((bs,), CTX - 1, dtype=torch.int64, device=dev)
    word = torch.zeros(1, dtype=torch.int32, device=dev)
    y_cols = {name: seg_slots * a.shape[1] for name, (a, _, _) in layers[0].lora.items()}
    # every row has an adapter here: segment i's rows at stage position i, in slot i
    stage = StageInfo(
        row_pos=torch.arange(bs, dtype=torch.int32, device=dev) // per,
        pos_slots=seg_slots.clone(),
        pos_scalings=seg_scal.clone(),
        width=n_ad,
        rank=R,
    )
    stage = with_tiles(stage)  # (the decode programs' tiles, as StaticLoRABatch writes them)

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
        if mode == "fused" and name != "qkv":
            a, b, offs = layer.lora[name]
            n_out, n_r = w.shape[0], a.shape[1]
            full = F.linear(x, layer.stacked[name][: n_out + n_ad * n_r])
            if name == "gate_up":
                return kernels.stacked_silu_mul(full, n_out, n_r, b, stage), "fused"
            return kernels.stacked_residual(full, n_out, n_r, b, stage, residual), "fused"
        if mode in ("stacked", "stacked16", "fused"):
            a, b, offs = layer.lora[name]
            n_out, n_r = w.shape[0], a.shape[1]
            staged = STACK_MAX if mode == "stacked16" else n_ad
            full = F.linear(x, layer.stacked[name][: n_out + staged * n_r])
            out = full[:, :n_out]
            kernels.PendingLoRA(
                fn="probe",
                rows=bs,
                y=full[:, n_out:],
                lora_b=b,
                seg_indptr=indptr,
                seg_slots=seg_slots,
                ranks=seg_ranks,
                scalings=seg_scal,
                row_order=None,
                slice_offsets=offs,
                max_seg_len=per,
                rank_by_seg=True,
                checked_out=out,
                y_seg_cols=y_cols[name],
            ).expand_into(out)
            return out, None
        if mode == "empty_main":
            out = F.linear(x, w)
            _one_word[(1,)](word)
            _one_word[(1,)](word)
            return out, None
        if mode == "empty_aside":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _one_word[(1,)](word)
                _one_word[(1,)](word)
            return F.linear(x, w), "join"
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
            att = kernels.decode_attention(
                q, layer.k_cache, layer.v_cache, table, rows, pos + 1, D**-0.5
            )
            o, join = proj(layer, "o", att.reshape(bs, HEADS * D), mode, h)
            if join == "join":
                torch.cuda.current_stream().wait_stream(side)
            h = o if join == "fused" else h + o  # fused: h + o + lora, written into h
            gu, join = proj(layer, "gate_up", rms(h, layer.norm), mode, h)
            if join == "fused":
                act = gu  # silu(g + lora) * (u + lora)
            else:
                g, u = gu.chunk(2, dim=-1)
                act = F.silu(g) * u
            d, join = proj(layer, "down", act, mode, h)
            if join == "join":
                torch.cuda.current_stream().wait_stream(side)
            h = d if join == "fused" else h + d
        if mode in ("aside", "empty_aside"):
            torch.cuda.current_stream().wait_stream(side)
        return h

    return step


def capture(step, mode: str, carve: int = 0) -> torch.cuda.CUDAGraph:
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
    return g


def measure(
    layers: list[Layer],
    side: torch.cuda.Stream,
    slots: int,
    bs: int,
    n_ad: int,
    carveouts: tuple[int, ...] = (),
) -> dict[str, float]:
    step = build_step(layers, side, slots, bs, n_ad)
    with torch.no_grad():  # the LoRA paths agree: the serial kernels against stacked / fused
        ref = step("serial").float()
        agree = {
            m: round(((step(m).float() - ref).norm() / ref.norm()).item(), 5)
            for m in ("stacked", "fused")
        }
    times = {}
    runs = [(m, 0) for m in MODES] + [
        (m, c) for c in carveouts for m in ("base", "residual", "aside")
    ]
    for mode, carve in runs:
        g = capture(step, mode, carve)
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
    row: dict[str, float] = {m: round(t, 1) for m, t in times.items()}
    row.update({f"relerr_{m}": e for m, e in agree.items()})
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
