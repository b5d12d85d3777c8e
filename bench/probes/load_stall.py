"""Probe: how long a running request's tokens stop while the worker reads an adapter.

    python bench/probes/load_stall.py OUT.json [--device cuda|cpu] [--arch qwen3-moe|llama]
        [--layers 8] [--hidden 2048] [--rounds 2]

Writes a bf16 fixture model (as ``cold_start.py``: hidden 2048, 8 layers; MoE: 64 experts,
top 8) and two rank-16 adapters (every target, every expert), builds the worker's engine
(``factory.build_engine``, no warm-up: a first trial runs everything the trials run), then
per trial: one greedy base request of 200 tokens; once 20 have arrived, both adapters are
loaded one after the other (``POST /load_lora_adapter``'s path), then unloaded when the
request ends. Trials alternate between the engine reading adapters on its adapter thread
(``concurrent``) and on its own thread between steps (``engine thread``, for comparison),
over one executor. Reports each trial's load seconds, the longest gap between two tokens
while the loads ran and the median gap outside them. Prints and writes one JSON object.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOKENS = 200
LOAD_AFTER = 20


def trial(engine: Any, adapters: dict[str, str]) -> dict[str, Any]:
    from loraplane.worker.engine.sampling import SamplingParams

    arrivals: list[float] = []
    done = threading.Event()
    started = threading.Event()

    def sink(event: Any) -> None:
        now = time.perf_counter()
        arrivals.extend(now for _ in event.token_ids)
        if len(arrivals) >= LOAD_AFTER:
            started.set()
        if event.finished:
            done.set()

    params = SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    engine.submit("long", [1 + i % 200 for i in range(12)], params, None, sink)
    assert started.wait(300), "the request did not start"
    t0 = time.perf_counter()
    for name, path in adapters.items():
        result = engine.load_adapter(name, path).result(timeout=300)
        assert result.success, result.error_message
    t1 = time.perf_counter()
    assert done.wait(300), "the request did not finish"
    for name in adapters:
        assert engine.unload_adapter(name).result(timeout=300).success
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(arrivals)]
    during = [g for g, a, b in gaps if b > t0 and a < t1]
    outside = [g for g, a, b in gaps if b <= t0 or a >= t1]
    return {
        "load_s": t1 - t0,
        "max_gap_during_ms": max(during, default=0.0) * 1e3,
        "tokens_during": sum(1 for t in arrivals if t0 < t < t1),
        "median_gap_outside_ms": statistics.median(outside) * 1e3 if outside else None,
        "tokens": len(arrivals),
    }


def main(argv: list[str] | None = None) -> int:
    from loraplane.worker.bench.common import engine_probe_parser, engine_probe_result

    p = engine_probe_parser(__doc__, rounds=2)
    args = p.parse_args(argv)

    from loraplane.worker.bench.common import probe_fixtures
    from loraplane.worker.engine.engine import Engine
    from loraplane.worker.server.factory import ServeConfig, build_engine

    result = engine_probe_result("load_stall", args)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, paths = probe_fixtures(root, args.arch, args.layers, args.hidden)
        adapters = {name: str(path) for name, path in paths.items()}
        config = ServeConfig(
            model=str(model),
            device=args.device,
            dtype="float32" if args.device == "cpu" else None,
            warmup=False,
            max_running=8,
        )
        first = build_engine(config)
        executor = first.executor

        def engine_for(concurrent: bool) -> Any:
            executor.reads_adapters_concurrently = concurrent  # type: ignore[misc]
            return Engine(
                executor,
                first.tokenizer,
                max_loras_per_batch=config.max_loras_per_batch,
                max_loaded_loras=config.max_loaded_loras,
                max_running=config.max_running,
                max_model_len=first.max_model_len,
            )

        plan = [("warm-up trial", True)]
        for _ in range(args.rounds):
            plan += [("engine thread", False), ("concurrent", True)]
        try:
            for label, concurrent in plan:
                engine = engine_for(concurrent)
                engine.start()
                try:
                    row = {"setting": label, **trial(engine, adapters)}
                finally:
                    engine.stop(shutdown_executor=False)  # the next trial's engine takes it
                print(json.dumps(row), flush=True)
                result["trials"].append(row)
        finally:
            executor.shutdown()
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
