"""Probe: the shrink kernel's time per launch config and K-split target (CUDA only).

    python bench/probes/shrink_tune.py OUT.json [MAX_SECONDS] [JOBS]
    python bench/probes/shrink_tune.py --ncu shrink|expand CASE [BLOCK_K,WARPS,STAGES,TARGET]

The shrink's launch config is a fixed rule (``_triton_utils.shrink_config``: 4 warps, Triton's
default pipeline of 3 stages, K steps of 128 columns at rank 16-64, which this probe found
closer to each case's best than 256); its K splits are measured by ``shrink_split.py``. At the
decode cases where a device copy of the same bytes reaches 45-98% of the peak, the shrink
reached 30-57% (``bench/kernels.py`` on an H200).
For those cases (``CASES``: Llama-3-8B-shaped and Qwen3-30B-A3B-shaped modules, interleaved
adapters as ``bench/kernels.py`` builds them) this graph-times the runtime's shrink
(``lora_apply_shrink``, ``moe_lora_shrink``) from cold L2 (``bench.common.time_graph``) at
every ``(block_k, num_warps, num_stages)`` of ``CONFIGS`` (``_triton_utils.SHRINK_OVERRIDE``)
and, for dense cases, every K-split target of ``TARGETS`` (``_triton_utils.TARGET_PROGRAMS``:
the programs a split launch aims for), next to the rule and a device copy of the same bytes.
``max_rel_diff`` compares every config's output with the rule's.

Compiling some hundreds of kernel variants takes longer than timing them, so ``JOBS``
(default 12) subprocesses first launch each variant once, which fills Triton's on-disk cache;
the timing process then loads them from it. Prints one JSON object per case and rewrites
OUT.json after each.

``--ncu`` launches one case's shrink (or its expand) five times, for Nsight Compute:
``ncu --kernel-name regex:_lora_shrink --launch-skip 2 --launch-count 1 ... python
bench/probes/shrink_tune.py --ncu shrink down:128:64:16``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from loraplane.worker import kernels
from loraplane.worker.bench.common import copy_bandwidth, copy_of, time_graph
from loraplane.worker.bench.kernels import SHAPES, ModuleShape, case_tables
from loraplane.worker.kernels import _triton_utils
from loraplane.worker.lora.batch_info import LoRABatchInfo

MODULES = {m.name: m for m in SHAPES["llama3-8b"] + SHAPES["qwen3-30b-a3b"][2:]}
# (module, tokens, rank, adapters): where a device copy of the same bytes reaches >= 45% of the peak.
CASES = [
    ("down", 128, 64, 16),
    ("down", 64, 64, 16),
    ("down", 16, 64, 16),
    ("down", 128, 16, 16),
    ("qkv", 128, 64, 16),
    ("qkv", 64, 64, 16),
    ("gate_up", 128, 64, 16),
    ("o", 128, 64, 16),
    ("moe_gate_up", 64, 16, 4),
    ("moe_gate_up", 128, 16, 16),
    ("moe_gate_up", 16, 64, 1),
    ("moe_gate_up", 64, 64, 4),
    ("moe_down", 128, 16, 16),
    ("moe_down", 64, 64, 4),
    ("moe_down", 128, 64, 16),
]
CONFIGS = list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4, 6)))
TARGETS = (132, 264, 528)
RULE = (None, 264)


def _key(config: tuple[int, int, int] | None, target: int) -> str:
    if config is None:
        return "rule" if target == RULE[1] else f"rule_t{target}"
    return "k{}_w{}_s{}_t{}".format(*config, target)


def _variants(mod: ModuleShape) -> list[tuple[tuple[int, int, int] | None, int]]:
    """(config, split target) pairs timed for a module: MoE grids are never split."""
    targets = (RULE[1],) if mod.experts else TARGETS
    return [RULE] + [(c, t) for c in CONFIGS for t in targets]


def build(
    name: str, tokens: int, rank: int, adapters: int, *, grouped: bool = False
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], int, int]:
    """The case's shrink (returning y), its expand (of one shrink's y, returning its output,
    which each call adds to), and the bytes each moves as ``bench/kernels.py`` counts them.
    Tokens interleave over the adapters (``i % adapters``, so the kernels gather rows through
    ``row_order``), or with ``grouped`` come in adapter order (dense: no ``row_order``)."""
    dev, dt, es = "cuda", torch.bfloat16, 2
    mod = MODULES[name]
    g = torch.Generator(device=dev).manual_seed(tokens * 1000 + rank * 10 + adapters)
    k, slices, n = mod.hidden, len(mod.slices), sum(mod.slices)
    offsets, ranks, scal = case_tables(mod, adapters, rank, dev)
    token_slots = [i % adapters for i in range(tokens)]
    if grouped:
        token_slots.sort()
    if not mod.experts:
        x = torch.randn(tokens, k, device=dev, dtype=dt, generator=g)
        a = torch.randn(adapters, slices * rank, k, device=dev, dtype=dt, generator=g) / k**0.5
        b = torch.randn(adapters, n, rank, device=dev, dtype=dt, generator=g) * 0.05
        out = torch.randn(tokens, n, device=dev, dtype=dt, generator=g)
        info = LoRABatchInfo.build(token_slots, ranks, scal, dev)
        assert info is not None
        args = (x, a, b, info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings)
        by_seg = {"seg_ranks": info.seg_ranks, "seg_scalings": info.seg_scalings}

        def dense_shrink() -> torch.Tensor:
            pending = kernels.lora_apply_shrink(
                *args, info.row_order, offsets, info.max_seg_len, **by_seg
            )
            return pending.y

        pending = kernels.lora_apply_shrink(
            *args, info.row_order, offsets, info.max_seg_len, **by_seg
        )

        def dense_expand() -> torch.Tensor:
            pending.expand_into(out)
            return out

        return (
            dense_shrink,
            dense_expand,
            (tokens * k + adapters * slices * rank * k) * es,
            (tokens * slices * rank + adapters * n * rank + 2 * tokens * n) * es,
        )
    pairs = tokens * mod.topk
    x_rows = pairs if mod.pairs_input else tokens
    topk = 1 if mod.pairs_input else mod.topk
    x = torch.randn(x_rows, k, device=dev, dtype=dt, generator=g)
    a = torch.randn(adapters, mod.experts, slices * rank, k, device=dev, dtype=dt, generator=g)
    a /= k**0.5
    b = torch.randn(adapters, mod.experts, n, rank, device=dev, dtype=dt, generator=g) * 0.05
    out = torch.randn(pairs, n, device=dev, dtype=dt, generator=g)
    scores = torch.rand((tokens, mod.experts), device=dev, generator=g)
    pair_expert = scores.topk(mod.topk, dim=-1).indices.reshape(-1).to(torch.int32)
    pair_slot = torch.tensor(token_slots, dtype=torch.int32, device=dev)
    pair_slot = pair_slot.repeat_interleave(mod.topk)
    routing = kernels.moe_lora_routing(pair_expert, pair_slot, adapters, mod.experts)
    used = int(torch.unique(pair_slot.long() * mod.experts + pair_expert.long()).numel())

    def moe_shrink() -> torch.Tensor:
        return kernels.moe_lora_shrink(
            x, a, pair_expert, pair_slot, ranks, slices, topk=topk, routing=routing
        )

    y = moe_shrink()

    def moe_expand() -> torch.Tensor:
        kernels.moe_lora_expand(
            y, b, pair_expert, pair_slot, ranks, scal, offsets, out, routing=routing
        )
        return out

    return (
        moe_shrink,
        moe_expand,
        (x_rows * k + used * slices * rank * k) * es,
        (pairs * slices * rank + used * n * rank + 2 * pairs * n) * es,
    )


def _set(config: tuple[int, int, int] | None, target: int) -> None:
    _triton_utils.SHRINK_OVERRIDE = config
    _triton_utils.TARGET_PROGRAMS = target


def _jobs() -> list[tuple[int, tuple[int, int, int] | None, int]]:
    return [
        (i, config, target)
        for i, case in enumerate(CASES)
        for config, target in _variants(MODULES[case[0]])
    ]


def compile_part(part: int, parts: int) -> None:
    """Launch this part's share of the variants once each (fills Triton's cache)."""
    jobs = _jobs()
    per = -(-len(jobs) // parts)
    built: dict[int, Callable[[], torch.Tensor]] = {}
    for i, config, target in jobs[part * per : (part + 1) * per]:
        if i not in built:
            built[i] = build(*CASES[i])[0]
        _set(config, target)
        try:
            built[i]()
            torch.cuda.synchronize()
        except Exception:  # out of shared memory: the timing pass records it
            pass


def main(out_path: str, max_seconds: float, jobs: int) -> None:
    t0 = time.monotonic()
    env = dict(os.environ)
    procs = [
        subprocess.Popen([sys.executable, __file__, "--compile", str(p), str(jobs)], env=env)
        for p in range(jobs)
    ]
    for proc in procs:
        proc.wait()
    compile_s = round(time.monotonic() - t0, 1)
    print(json.dumps({"compiled_variants": len(_jobs()), "compile_s": compile_s}), flush=True)
    peak = copy_bandwidth("cuda")["gbytes_per_s"]
    rows: list[dict[str, Any]] = []
    for case in CASES:
        if time.monotonic() - t0 > max_seconds:
            break
        shrink, _, nbytes, _ = build(*case)
        name, tokens, rank, adapters = case
        row: dict[str, Any] = {
            "module": name,
            "tokens": tokens,
            "rank": rank,
            "adapters": adapters,
            "bytes": nbytes,
            "copy_us": round(time_graph(copy_of(nbytes, "cuda"), "cuda") or 0.0, 2),
        }
        _set(*RULE)
        expected = shrink().float()
        diff, errors = 0.0, {}
        for config, target in _variants(MODULES[name]):
            key = _key(config, target)
            _set(config, target)
            try:
                got = shrink().float()
                diff = max(diff, float((got - expected).abs().max() / expected.abs().max()))
                row[key] = round(time_graph(shrink, "cuda") or 0.0, 2)
            except Exception as exc:  # e.g. more shared memory than the SM has
                errors[key] = f"{type(exc).__name__}: {exc}"[:120]
        _set(*RULE)
        times = {k: v for k, v in row.items() if k == "rule" or k.startswith("k")}
        best = min(times, key=lambda k: times[k])

        def pct(us: float, nbytes: int = nbytes) -> float:
            return round(100 * nbytes / us / 1e3 / peak, 1)

        row.update(
            best=best,
            best_us=times[best],
            best_pct_peak=pct(times[best]),
            rule_pct_peak=pct(times["rule"]),
            copy_pct_peak=pct(row["copy_us"]),
            max_rel_diff=diff,
            errors=len(errors),
        )
        top = sorted(times, key=lambda k: times[k])[:5]
        print(json.dumps({k: row[k] for k in list(row)[:6] + top + list(row)[-7:]}), flush=True)
        rows.append(row)
        with open(out_path, "w") as f:
            json.dump(
                {
                    "probe": "shrink_tune",
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "commit": os.environ.get("LORAPLANE_COMMIT"),
                    "peak_gbs": peak,
                    "compile_s": compile_s,
                    "rows": rows,
                    "first_errors": errors,
                },
                f,
            )


def ncu(kernel: str, case: str, variant: str | None) -> None:
    name, *nums = case.split(":")
    tokens, rank, adapters = (int(v) for v in nums)
    if variant:
        bk, w, st, target = (int(v) for v in variant.split(","))
        _set((bk, w, st), target)
    shrink, expand, nbytes, _ = build(name, tokens, rank, adapters)
    for _ in range(5):
        (shrink if kernel == "shrink" else expand)()
    torch.cuda.synchronize()
    print("shrink bytes", nbytes)


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        compile_part(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "--ncu":
        ncu(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        main(
            sys.argv[1],
            float(sys.argv[2]) if len(sys.argv) > 2 else 300.0,
            int(sys.argv[3]) if len(sys.argv) > 3 else 12,
        )
