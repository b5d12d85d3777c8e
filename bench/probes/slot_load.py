"""Probe: how long moving an adapter from host memory into a GPU slot takes.

    python bench/probes/slot_load.py OUT.json [--device cuda|cpu] [--arch llama|qwen3-moe]
        [--layers 2] [--rank 16] [--repeats 6] [--fixtures DIR]

The engine loads a slot before the step that first uses the adapter, on the slot manager's
copy stream (ADR 0011), and with more adapters than slots at every LRU swap: the copy's
length is how long that adapter's requests wait. Writes a bf16 fixture model at a real layer shape (Llama-3-8B, or Qwen3-30B-A3B with
128 experts; ``--layers`` of them, vocabulary 32000) and a rank-``--rank`` adapter on every
target (every expert's too), reads the adapter into host memory as the worker does
(``read_adapter``: page-locked on CUDA), then times ``load_slot`` into alternating slots
``--repeats`` times, from that copy and from a pageable one in turns (``--host``). Reports
per kind the median ms until ``load_slot`` returns (``host_ms``: what the step loop waits)
and until the GPU has the slot (``load_ms``), per load and per layer (a model of L layers
takes about L times the per-layer figure). Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama": {  # Llama-3-8B's layer
        "hidden_size": 4096,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 14336,
    },
    "qwen3-moe": {  # Qwen3-30B-A3B's layer
        "hidden_size": 2048,
        "num_heads": 32,
        "num_kv_heads": 4,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
}


def make_fixtures(
    args: argparse.Namespace, shape: dict[str, Any], model: Path, adapter: Path
) -> None:
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    make_model(
        model,
        args.arch,
        dtype="bfloat16",
        num_layers=args.layers,
        vocab_size=32000,
        head_dim=128 if not args.small else 16,
        max_position_embeddings=4096,
        **shape,
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    moe = args.arch == "qwen3-moe"
    make_adapter(
        model,
        adapter,
        rank=args.rank,
        alpha=2.0 * args.rank,
        targets=targets if not moe else targets[:4],  # (+ every expert's three)
        experts=moe,
        dtype="bfloat16",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", default="qwen3-moe", choices=tuple(SHAPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--small", action="store_true", help="a tiny model (to try the probe)")
    p.add_argument(
        "--host",
        default="both",
        choices=("both", "pinned", "pageable"),
        help="the adapter's host memory: page-locked (what a CUDA worker reads it into), "
        "pageable (a copy, for comparison), or both in turns",
    )
    p.add_argument(
        "--fixtures",
        type=Path,
        help="keep the model and adapter here and reuse them when there (several runs)",
    )
    args = p.parse_args(argv)

    import torch

    from loraplane.worker.bench.common import env_info, host_tensors, pageable_copy
    from loraplane.worker.server.factory import ServeConfig, make_executor

    shape = dict(SHAPES[args.arch])
    if args.small:
        shape = {k: max(2, v // 16) if k != "num_experts_per_tok" else v for k, v in shape.items()}
        shape["num_heads"], shape["num_kv_heads"] = 4, 2
    result: dict[str, Any] = {
        "probe": "slot_load",
        "env": env_info(args.device),
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "shape": shape,
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = args.fixtures or Path(tmp)
        t0 = time.perf_counter()
        model, adapter = root / "model", root / "adapter"
        if not (adapter / "adapter_config.json").exists():
            make_fixtures(args, shape, model, adapter)
        result["fixtures_s"] = time.perf_counter() - t0
        config = ServeConfig(
            model=str(model),
            device=args.device,
            dtype="float32" if args.device == "cpu" else None,
            max_loras_per_batch=2,
            max_loaded_loras=2,
            max_lora_rank=64,
            max_running=8,
            cuda_graphs=False,
            warmup=False,
        )
        executor = make_executor(config, max_len=256)
        try:
            t0 = time.perf_counter()
            info = executor.read_adapter(0, "a", str(adapter))
            result["read_s"] = time.perf_counter() - t0
            result["adapter_mb"] = info.nbytes / 1e6

            def sync() -> None:
                if args.device == "cuda":
                    torch.cuda.synchronize()

            read = executor.host["a"]  # type: ignore[attr-defined]
            kinds = {"pinned": read, "pageable": pageable_copy(read)}
            result["read_pinned"] = all(t.is_pinned() for t in host_tensors(read))
            if args.host != "both":
                kinds = {args.host: kinds[args.host]}
            for weights in kinds.values():
                executor.host["a"] = weights  # type: ignore[attr-defined]
                sync()
                executor.load_slot(0, "a")  # (the first also allocates)
                sync()
            # The kinds take turns, each into alternating slots. host_ms: until load_slot
            # returns (what the step loop waits before it launches the next step); load_ms:
            # until the copies are done on the GPU too (that step starts after them).
            times: dict[str, dict[str, list[float]]] = {k: {"host": [], "load": []} for k in kinds}
            for i in range(args.repeats):
                for kind, weights in kinds.items():
                    executor.host["a"] = weights  # type: ignore[attr-defined]
                    sync()
                    t0 = time.perf_counter()
                    executor.load_slot(i % 2, "a")
                    t1 = time.perf_counter()
                    sync()
                    times[kind]["host"].append((t1 - t0) * 1e3)
                    times[kind]["load"].append((time.perf_counter() - t0) * 1e3)
        finally:
            executor.shutdown()
    for kind, got in times.items():
        load, host = statistics.median(got["load"]), statistics.median(got["host"])
        result[kind] = {
            "load_ms": got["load"],
            "host_ms": got["host"],
            "load_ms_median": load,
            "host_ms_median": host,
            "load_ms_per_layer": load / args.layers,
            "host_ms_per_layer": host / args.layers,
            "gb_per_s": result["adapter_mb"] / load,
        }
    print(json.dumps({k: v for k, v in result.items() if k != "env"}), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
