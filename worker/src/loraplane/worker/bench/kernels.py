"""Kernel benchmark: segmented LoRA shrink / expand (plain, stacked qkv / gate_up, MoE).

    python -m loraplane.worker.bench.kernels --device cuda --json [--out FILE]
        [--shapes llama3-8b,qwen3-30b-a3b] [--ranks 16,64] [--adapters 1,4,16]
        [--tokens 16,64,128,2048] [--max-seconds 240]

Entry point: ``run_kernels_bench(device, ranks, adapters, shapes, out, tokens=None,
dtype=None, rep_ms=8.0, max_seconds=None) -> dict``.

For every (shape, module, tokens, rank, adapters) case it builds the batch the runtime would
build (tokens interleaved over the adapters, ``i % adapters``, through ``LoRABatchInfo.build``,
so segments are gathered through ``row_order``; MoE: uniform random top-k routing, pairs with
their token's adapter) and times, with CUDA events (``triton.testing.do_bench``, median, L2
flushed before each repetition):

* ``shrink_us``, ``expand_us`` (and ``routing_us`` for MoE): the Triton kernels as the runtime
  launches them. Dense: ``lora_apply_shrink`` (one launch; at decode its K splits are summed by
  the last program of each tile) and ``PendingLoRA.expand_into`` (one launch), not the
  standalone ``lora_shrink``, which adds a zero fill and a partial-sum kernel;
* ``ref_us``: the torch reference (shrink + expand, host clock with a sync; it reads device
  tensors back by design);
* ``dense_us``: the base projection of the same size through cuBLAS, ``x @ W^T`` with
  ``x [tokens, K]``, ``W [N_total, K]`` (MoE: all pairs through one ``[N, K]`` matrix, the
  ideal grouped GEMM), and for MoE ``base_grouped_us``, the runtime's base experts: on CUDA
  the device-routed grouped GEMM (``moe_expert_routing`` + ``moe_grouped_matmul``, timed like
  the kernels), on CPU ``Experts.grouped`` (host clock);
* ``host_us``: host time per shrink + expand call pair without syncs (launch overhead).

Bytes counted (the floor): x rows read once (MoE gate_up: token rows, not pairs), each distinct
adapter's (MoE: each used ``(slot, expert)``'s) A / B read once at the real rank, ``y`` written /
read at the real rank, ``out`` read and written. Bandwidth is reported against the peak
measured in the same run with a 2 GiB device-to-device copy (``peak``), and, per kernel, against
a device copy that moves the kernel's own (floor) bytes, graph-timed the same way (torch
``copy_``: a device-to-device ``cudaMemcpyAsync``, a memcpy node in the graph)
(``{shrink,expand}_copy_graph_us``, ``_copy_graph_pct_peak``, and ``_over_copy``: the kernel's
time over the copy's). At decode sizes (0.3-30 MB) even the copy stays far below the peak: a
kernel's fixed cost (launch in the graph, first loads) dominates. ``rel_err``: Triton
against the reference, ``||d_tri - d_ref|| / ||d_ref||`` on the LoRA delta, same inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from loraplane.worker.bench.common import (
    JsonSink,
    copy_bandwidth,
    copy_of,
    env_info,
    fmt,
    host_launch_us,
    is_cuda,
    sync,
    time_device,
    time_graph,
    time_host,
)


@dataclass(frozen=True, slots=True)
class ModuleShape:
    name: str
    hidden: int  # K (input features)
    slices: tuple[int, ...]  # output widths of the stacked slices
    experts: int = 0  # > 0: routed experts (MoE)
    topk: int = 1
    pairs_input: bool = False  # MoE down: x holds one row per (token, k) pair


SHAPES: dict[str, tuple[ModuleShape, ...]] = {
    # Llama-3-8B: hidden 4096, 32 q heads x 128, 8 kv heads x 128, intermediate 14336.
    "llama3-8b": (
        ModuleShape("qkv", 4096, (4096, 1024, 1024)),
        ModuleShape("o", 4096, (4096,)),
        ModuleShape("gate_up", 4096, (14336, 14336)),
        ModuleShape("down", 14336, (4096,)),
    ),
    # Qwen3-30B-A3B: hidden 2048, 32 q heads x 128 = 4096, 4 kv heads x 128 = 512,
    # 128 experts, top-8, moe_intermediate 768.
    "qwen3-30b-a3b": (
        ModuleShape("qkv", 2048, (4096, 512, 512)),
        ModuleShape("o", 4096, (2048,)),
        ModuleShape("moe_gate_up", 2048, (768, 768), experts=128, topk=8),
        ModuleShape("moe_down", 768, (2048,), experts=128, topk=8, pairs_input=True),
    ),
    # CPU smoke test (Triton interpreter).
    "tiny": (
        ModuleShape("qkv", 64, (64, 16, 16)),
        ModuleShape("down", 96, (64,)),
        ModuleShape("moe_gate_up", 64, (32, 32), experts=8, topk=2),
        ModuleShape("moe_down", 32, (64,), experts=8, topk=2, pairs_input=True),
    ),
}

DEFAULT_TOKENS = {"cuda": [16, 64, 128, 2048], "cpu": [4, 32]}
PREFILL_MIN_TOKENS = 512  # a token count at or above this is labelled "prefill"
# The torch reference of MoE loops over (slot, expert) groups in Python: past this many pairs
# it takes seconds per call, so it is not timed (the error check still runs at decode sizes).
REF_MAX_MOE_PAIRS = 1024


def case_tables(
    mod: ModuleShape, adapters: int, rank: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a case's kernels take besides data: the slices' column offsets (int32), and every
    adapter's rank (int32) and scaling (2.0, float32)."""
    offsets = [0]
    for w in mod.slices:
        offsets.append(offsets[-1] + w)
    return (
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.full((adapters,), rank, dtype=torch.int32, device=device),
        torch.full((adapters,), 2.0, dtype=torch.float32, device=device),
    )


def _randn(
    shape: tuple[int, ...], scale: float, dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32, generator=gen) * scale).to(dtype)


def _rel_err(delta: torch.Tensor, ref: torch.Tensor) -> float:
    d, r = delta.double(), ref.double()
    if not torch.isfinite(d).all():
        return float("nan")
    return float((d - r).norm() / r.norm().clamp_min(1e-30))


def run_case(
    mod: ModuleShape,
    tokens: int,
    rank: int,
    adapters: int,
    device: str,
    dtype: torch.dtype,
    rep_ms: float,
    seed: int,
) -> dict[str, Any]:
    from loraplane.worker import kernels as tk
    from loraplane.worker.kernels import reference as ref
    from loraplane.worker.lora.batch_info import LoRABatchInfo
    from loraplane.worker.models.model import Experts

    gen = torch.Generator(device=device).manual_seed(seed)
    es = (
        dtype.itemsize
        if hasattr(dtype, "itemsize")
        else torch.tensor([], dtype=dtype).element_size()
    )
    K, n_slices = mod.hidden, len(mod.slices)
    slice_offsets, slot_ranks, slot_scalings = case_tables(mod, adapters, rank, device)
    N = sum(mod.slices)
    token_slots = [i % adapters for i in range(tokens)]
    row: dict[str, Any] = {
        "module": mod.name,
        "kind": "moe" if mod.experts else ("stacked" if n_slices > 1 else "plain"),
        "phase": "prefill" if tokens >= PREFILL_MIN_TOKENS else "decode",
        "tokens": tokens,
        "rank": rank,
        "adapters": adapters,
        "K": K,
        "N_total": N,
        "slices": n_slices,
    }
    t_cuda = is_cuda(device)

    if not mod.experts:
        x = _randn((tokens, K), 1.0, dtype, device, gen)
        a = _randn((adapters, n_slices * rank, K), K**-0.5, dtype, device, gen)
        b = _randn((adapters, N, rank), 0.1 * rank**-0.5, dtype, device, gen)
        w_base = _randn((N, K), K**-0.5, dtype, device, gen)
        info = LoRABatchInfo.build(token_slots, slot_ranks, slot_scalings, device)
        assert info is not None, "every case has adapter tokens"
        assert info is not None
        seg = (info.seg_indptr, info.seg_slots, info.slot_ranks, info.row_order)
        seg3 = (info.seg_indptr, info.seg_slots, info.slot_ranks)
        ro = info.row_order
        out = _randn((tokens, N), 1.0, dtype, device, gen)

        operands = (x, a, b, *seg3, info.slot_scalings, ro, slice_offsets)
        per_seg = {"seg_ranks": info.seg_ranks, "seg_scalings": info.seg_scalings}

        def shrink() -> object:
            # The runtime's shrink (one launch, split-K partials summed in it).
            return tk.lora_apply_shrink(*operands, info.max_seg_len, **per_seg)

        pending: Any = shrink()
        tables = [t for t in (*seg3, ro, *per_seg.values(), info.slot_scalings) if t is not None]
        shrink_warm = [x, *tables]
        expand_warm = [pending.y, out, slice_offsets, *tables]

        def expand() -> object:
            pending.expand_into(out)  # the runtime's expand, one launch
            return None

        def both_tri(o: torch.Tensor) -> None:
            shrink().expand_into(o)  # type: ignore[attr-defined]  # the timed kernels

        def both_ref(o: torch.Tensor) -> None:
            yy = ref.lora_shrink(x, a, *seg, n_slices, info.max_seg_len)
            ref.lora_expand(
                yy, b, *seg3, info.slot_scalings, ro, slice_offsets, o, info.max_seg_len
            )

        def apply_tri(o: torch.Tensor) -> None:
            # lora_apply: the same two launches through the one-call API
            tk.lora_apply(*operands, o, info.max_seg_len, **per_seg)

        apply_fn: Callable[[torch.Tensor], None] | None = apply_tri
        routing_fn: Callable[[], object] | None = None
        x_rows, lora_rows = tokens, tokens
        used_weights = adapters
        dense_x = x
        grouped_fn: Callable[[], object] | None = None
        ref_ok = True
    else:
        E, topk = mod.experts, mod.topk
        P = tokens * topk
        x_rows = P if mod.pairs_input else tokens
        x = _randn((x_rows, K), 1.0, dtype, device, gen)
        a = _randn((adapters, E, n_slices * rank, K), K**-0.5, dtype, device, gen)
        b = _randn((adapters, E, N, rank), 0.1 * rank**-0.5, dtype, device, gen)
        w_base_e = _randn((E, N, K), K**-0.5, dtype, device, gen)
        w_base = w_base_e[0]
        scores = torch.rand((tokens, E), device=device, generator=gen)
        pair_expert = scores.topk(topk, dim=-1).indices.reshape(-1).to(torch.int32)
        slots_t = torch.tensor(token_slots, dtype=torch.int32, device=device)
        pair_slot = slots_t.repeat_interleave(topk)
        kernel_topk = 1 if mod.pairs_input else topk
        # As the runtime builds it (lora/layers.py): the tiles carry the slots' ranks.
        routing = tk.moe_lora_routing(pair_expert, pair_slot, adapters, E, slot_ranks=slot_ranks)
        out = _randn((P, N), 1.0, dtype, device, gen)
        y = tk.moe_lora_shrink(
            x, a, pair_expert, pair_slot, slot_ranks, n_slices, topk=kernel_topk, routing=routing
        )

        def shrink() -> object:
            return tk.moe_lora_shrink(
                x,
                a,
                pair_expert,
                pair_slot,
                slot_ranks,
                n_slices,
                topk=kernel_topk,
                routing=routing,
            )

        def expand() -> object:
            tk.moe_lora_expand(
                y,
                b,
                pair_expert,
                pair_slot,
                slot_ranks,
                slot_scalings,
                slice_offsets,
                out,
                routing=routing,
            )
            return None

        def routing_fn() -> object:
            return tk.moe_lora_routing(pair_expert, pair_slot, adapters, E, slot_ranks=slot_ranks)

        def both_tri(o: torch.Tensor) -> None:
            r = tk.moe_lora_routing(pair_expert, pair_slot, adapters, E, slot_ranks=slot_ranks)
            yy = tk.moe_lora_shrink(
                x, a, pair_expert, pair_slot, slot_ranks, n_slices, topk=kernel_topk, routing=r
            )
            tk.moe_lora_expand(
                yy,
                b,
                pair_expert,
                pair_slot,
                slot_ranks,
                slot_scalings,
                slice_offsets,
                o,
                routing=r,
            )

        def both_ref(o: torch.Tensor) -> None:
            yy = ref.moe_lora_shrink(
                x, a, pair_expert, pair_slot, slot_ranks, n_slices, topk=kernel_topk
            )
            ref.moe_lora_expand(
                yy, b, pair_expert, pair_slot, slot_ranks, slot_scalings, slice_offsets, o
            )

        tables = [routing.tile_seg, routing.tile_len, routing.tile_rows, slot_ranks]
        tables += [slot_scalings, slice_offsets]
        tables += [routing.tile_rank] if routing.tile_rank is not None else []
        shrink_warm = [x, *tables]
        expand_warm = [y, out, *tables]
        lora_rows = P
        used_weights = int(torch.unique(pair_slot.long() * E + pair_expert.long()).numel())
        dense_x = x if mod.pairs_input else x.repeat_interleave(topk, dim=0)
        ns = SimpleNamespace(num_experts=E, cpu_row_block=Experts.cpu_row_block)
        pe64 = pair_expert.long()

        def grouped_fn() -> object:
            if t_cuda:
                routing = tk.moe_expert_routing(pair_expert, E)
                return tk.moe_grouped_matmul(dense_x, w_base_e, routing)
            return Experts.grouped(ns, dense_x, w_base_e, pe64)  # type: ignore[arg-type]

        ref_ok = P <= REF_MAX_MOE_PAIRS
        apply_fn = None
        row.update(experts=E, topk=topk, pairs=P, used_slot_experts=used_weights)

    # Bytes (floor): x rows once, used A/B once at the real rank, y out/in, out read+write.
    a_bytes = used_weights * n_slices * rank * K * es
    b_bytes = used_weights * N * rank * es
    y_bytes = lora_rows * n_slices * rank * es
    shrink_bytes = x_rows * K * es + a_bytes + y_bytes
    expand_bytes = y_bytes + b_bytes + 2 * lora_rows * N * es
    row.update(shrink_bytes=shrink_bytes, expand_bytes=expand_bytes)
    row.update(shrink_weight_bytes=a_bytes, expand_weight_bytes=b_bytes)

    # Correctness (same inputs, delta-relative).
    out0 = _randn(tuple(out.shape), 1.0, dtype, device, gen)
    check_ref = ref_ok or tokens <= 128
    if check_ref:
        o_tri, o_ref = out0.clone(), out0.clone()
        both_tri(o_tri)
        both_ref(o_ref)
        row["rel_err"] = _rel_err(o_tri.float() - out0.float(), o_ref.float() - out0.float())
        if apply_fn is not None:
            o_app = out0.clone()
            apply_fn(o_app)
            row["apply_rel_err"] = _rel_err(
                o_app.float() - out0.float(), o_ref.float() - out0.float()
            )
            del o_app
        del o_tri, o_ref

    row["shrink_us"] = time_device(shrink, device, rep_ms=rep_ms)
    row["expand_us"] = time_device(expand, device, rep_ms=rep_ms)
    lora_us = row["shrink_us"] + row["expand_us"]
    if routing_fn is not None:
        row["routing_us"] = time_device(routing_fn, device, rep_ms=rep_ms)
        lora_us += row["routing_us"]
    row["lora_us"] = lora_us
    row["dense_us"] = time_device(lambda: F.linear(dense_x, w_base), device, rep_ms=rep_ms)
    if apply_fn is not None:
        row["apply_us"] = time_device(lambda: apply_fn(out), device, rep_ms=rep_ms)
    if t_cuda:
        # GPU time alone (graph replays from cold L2): what a captured decode step pays.
        graph_fns: dict[str, Callable[[], object]] = {
            "shrink": shrink,
            "expand": expand,
            "dense": lambda: F.linear(dense_x, w_base),
        }
        if apply_fn is not None:
            graph_fns["apply"] = lambda: apply_fn(out)
        # The ceiling at this size: a device copy moving each kernel's bytes (half read, half
        # written), timed the same way. Small transfers never reach the peak of a 2 GiB copy.
        for name, nbytes in (("shrink", shrink_bytes), ("expand", expand_bytes)):
            graph_fns[f"{name}_copy"] = copy_of(nbytes, device)
        warm: dict[str, list[torch.Tensor]] = {}
        if row["phase"] == "decode":
            # As inside a decode step: the activations were just written and the index tables
            # are read by every layer, so both sit in L2; only the weights come from DRAM.
            graph_fns["shrink_hot"], warm["shrink_hot"] = shrink, shrink_warm
            graph_fns["expand_hot"], warm["expand_hot"] = expand, expand_warm
        for name, fn in graph_fns.items():
            try:
                row[f"{name}_graph_us"] = time_graph(fn, device, warm=warm.get(name, ()))
            except Exception as exc:  # a wrapper that syncs with the host cannot be captured
                row[f"{name}_graph_us"] = None
                row[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if grouped_fn is not None:
        row["base_grouped_us"] = (
            time_device(grouped_fn, device, rep_ms=rep_ms)
            if t_cuda
            else time_host(grouped_fn, device, reps=3)
        )
    if ref_ok:
        scratch = out0.clone()
        row["ref_us"] = time_host(lambda: both_ref(scratch), device, reps=3)
    else:
        row["ref_us"] = None
        row["ref_skipped"] = (
            f"torch reference not timed above {REF_MAX_MOE_PAIRS} pairs (Python loop over groups)"
        )
    if t_cuda:

        def pair_call() -> None:
            yy = shrink()
            if mod.experts:
                tk.moe_lora_expand(
                    yy,
                    b,
                    pair_expert,
                    pair_slot,
                    slot_ranks,
                    slot_scalings,
                    slice_offsets,
                    out,
                    routing=routing,
                )  # type: ignore[arg-type]
            else:
                yy.expand_into(out)  # type: ignore[attr-defined]

        row["host_us"] = host_launch_us(pair_call, device, calls=30)
    row["lora_over_dense"] = lora_us / row["dense_us"] if row["dense_us"] else None
    row["ref_over_lora"] = row["ref_us"] / lora_us if row["ref_us"] else None
    return row


def _add_bandwidth(row: dict[str, Any], peak_gbs: float) -> None:
    for k in ("shrink", "expand"):
        us = row.get(f"{k}_us")
        gbs = row[f"{k}_bytes"] / us / 1e3 if us else None
        row[f"{k}_gbs"] = gbs
        row[f"{k}_pct_peak"] = 100.0 * gbs / peak_gbs if gbs and peak_gbs else None
    total = row["shrink_bytes"] + row["expand_bytes"]
    gbs = total / row["lora_us"] / 1e3 if row.get("lora_us") else None
    row["lora_gbs"] = gbs
    row["lora_pct_peak"] = 100.0 * gbs / peak_gbs if gbs and peak_gbs else None
    for k, nbytes in (
        ("shrink", row["shrink_bytes"]),
        ("expand", row["expand_bytes"]),
        ("apply", total),
    ):
        us = row.get(f"{k}_graph_us")
        row[f"{k}_graph_pct_peak"] = (
            100.0 * nbytes / us / 1e3 / peak_gbs if us and peak_gbs else None
        )
        if k != "apply":
            # Weights only (the DRAM bytes) over the time with the rest in L2 (decode cases).
            hot_us = row.get(f"{k}_hot_graph_us")
            row[f"{k}_hot_weights_pct_peak"] = (
                100.0 * row[f"{k}_weight_bytes"] / hot_us / 1e3 / peak_gbs
                if hot_us and peak_gbs
                else None
            )
        copy_us = row.get(f"{k}_copy_graph_us")
        if copy_us:
            # What a copy of the kernel's bytes reaches, and the kernel's time over the copy's.
            row[f"{k}_copy_graph_pct_peak"] = 100.0 * nbytes / copy_us / 1e3 / peak_gbs
            row[f"{k}_over_copy"] = us / copy_us if us else None


def run_kernels_bench(
    device: str,
    ranks: list[int],
    adapters: list[int],
    shapes: list[str],
    out: Path | None,
    *,
    tokens: list[int] | None = None,
    dtype: str | None = None,
    rep_ms: float = 8.0,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """Run every case; write the JSON to ``out`` after each one; return the result dict.

    ``dtype`` defaults to bfloat16 on CUDA and float32 on CPU (the Triton interpreter has no
    bf16). ``max_seconds``: stop starting new cases after that long (recorded as
    ``truncated``). Cases are ordered rank, then tokens, so the decode cases at the first rank
    come first."""
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; expected one of {sorted(SHAPES)}")
    dev_type = torch.device(device).type
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        dtype or ("bfloat16" if dev_type == "cuda" else "float32")
    ]
    token_list = tokens or DEFAULT_TOKENS.get(dev_type, DEFAULT_TOKENS["cpu"])
    sink = JsonSink(
        out,
        {
            "bench": "kernels",
            "env": env_info(device),
            "settings": {
                "ranks": ranks,
                "adapters": adapters,
                "shapes": shapes,
                "tokens": token_list,
                "dtype": str(tdtype),
                "rep_ms": rep_ms,
                "timer": "triton.testing.do_bench median (CUDA events, L2 flushed)"
                if dev_type == "cuda"
                else "host clock",
            },
            "cases": [],
        },
    )
    peak = sink.guarded("copy_bandwidth", lambda: copy_bandwidth(device))
    sink.set("peak", peak)
    peak_gbs = peak["gbytes_per_s"] if peak else 0.0
    start = time.perf_counter()
    seed = 0
    for rank in ranks:
        for t in token_list:
            for shape in shapes:
                for mod in SHAPES[shape]:
                    for n in adapters:
                        if max_seconds is not None and time.perf_counter() - start > max_seconds:
                            sink.set("truncated", f"stopped after {max_seconds} s")
                            return sink.payload
                        seed += 1
                        what = f"{shape}/{mod.name} T={t} r={rank} adapters={n}"
                        row = sink.guarded(
                            what, run_case, mod, t, rank, n, device, tdtype, rep_ms, seed
                        )
                        if row is None:
                            continue
                        row["shape"] = shape
                        _add_bandwidth(row, peak_gbs)
                        sink.append("cases", row)
    sink.set("elapsed_s", time.perf_counter() - start)
    return sink.payload


def summary_table(result: dict[str, Any]) -> str:
    """Eager times (host launch included) and, on CUDA, GPU times from graph replays (g ...)."""
    lines = [
        f"peak copy {fmt((result.get('peak') or {}).get('gbytes_per_s'), 0)} GB/s",
        f"{'shape/module':26} {'T':>5} {'r':>3} {'n':>3} {'shr us':>7} {'exp us':>7} "
        f"{'dense us':>8} {'g shr':>6} {'g exp':>6} {'g app':>6} {'g dense':>7} {'app%pk':>6} "
        f"{'app/dense':>9} {'shr/cp':>6} {'exp/cp':>6} {'err':>8}",
    ]
    for c in result.get("cases", []):
        err = c.get("rel_err")
        g_app, g_dense = c.get("apply_graph_us"), c.get("dense_graph_us")
        ratio = g_app / g_dense if g_app and g_dense else None
        lines.append(
            f"{c['shape'][:12] + '/' + c['module']:26} {c['tokens']:>5} {c['rank']:>3} {c['adapters']:>3} "
            f"{fmt(c.get('shrink_us')):>7} {fmt(c.get('expand_us')):>7} {fmt(c.get('dense_us')):>8} "
            f"{fmt(c.get('shrink_graph_us')):>6} {fmt(c.get('expand_graph_us')):>6} {fmt(g_app):>6} "
            f"{fmt(g_dense):>7} {fmt(c.get('apply_graph_pct_peak'), 0):>6} {fmt(ratio, 2):>9} "
            f"{fmt(c.get('shrink_over_copy'), 2):>6} {fmt(c.get('expand_over_copy'), 2):>6} "
            f"{'-' if err is None else f'{err:.1e}':>8}"
        )
    for e in result.get("errors", []):
        lines.append(f"ERROR {e['what']}: {e['error'][:160]}")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loraplane.worker.bench.kernels", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--adapters", default="1,4,16")
    p.add_argument(
        "--tokens", default=None, help="comma list; default decode 16,64,128 + prefill 2048 on CUDA"
    )
    p.add_argument("--dtype", default=None)
    p.add_argument("--rep-ms", type=float, default=8.0)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON file, written after every case")
    p.add_argument(
        "--json", action="store_true", help="print the result JSON on stdout (else a table)"
    )
    args = p.parse_args(argv)
    if args.shapes:
        shapes = args.shapes.split(",")
    else:
        shapes = ["llama3-8b", "qwen3-30b-a3b"] if is_cuda(args.device) else ["tiny"]
    result = run_kernels_bench(
        args.device,
        _ints(args.ranks),
        _ints(args.adapters),
        shapes,
        args.out,
        tokens=_ints(args.tokens) if args.tokens else None,
        dtype=args.dtype,
        rep_ms=args.rep_ms,
        max_seconds=args.max_seconds,
    )
    sync(args.device)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
    else:
        print(summary_table(result))
    return 1 if result.get("errors") and not result.get("cases") else 0


if __name__ == "__main__":
    raise SystemExit(main())
