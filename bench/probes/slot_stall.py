"""Probe: how long a running request's tokens stop while adapters are copied into GPU slots.

    python bench/probes/slot_stall.py OUT.json [--device cuda] [--arch qwen3-moe|llama]
        [--layers 8] [--hidden 2048] [--rounds 3] [--adapters 4]

Writes a bf16 fixture model (as ``load_stall.py``: hidden 2048; MoE: 64 experts, top 8) and
``--adapters`` rank-16 adapters (every target, every expert), loads them all into an engine
with two slots (``factory.build_engine``, no warm-up: a first trial runs everything the trials
run), then per trial: one greedy base request of 300 tokens; once 20 have arrived, one
4-token request per adapter, one after another, twice over. With two slots every adapter
request evicts another one, so each brings a slot load. Trials alternate between the slot
copies on the step stream (``step stream``: every running request waits for them) and on the manager's copy stream (``copy stream``: ADR 0011). Reports the base
request's longest and median gap between tokens while the adapter requests ran, the median
gap outside them, and the adapter requests' time to their first token. Prints one JSON line
per trial and writes one JSON object.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BASE_TOKENS = 300
START_AFTER = 20
PROMPT = [1 + i % 200 for i in range(12)]


def _request(engine: Any, adapter: str | None, tokens: int) -> tuple[list[float], Any]:
    """One greedy request: the times its tokens arrive, and an event set when it ends."""
    import threading

    from loraplane.worker.engine.sampling import SamplingParams

    arrivals: list[float] = []
    done = threading.Event()

    def sink(event: Any) -> None:
        assert event.error is None, event.error
        now = time.perf_counter()
        arrivals.extend(now for _ in event.token_ids)
        if event.finished:
            done.set()

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.submit(f"r{id(arrivals)}", PROMPT, params, adapter, sink)
    return arrivals, done


def trial(engine: Any, names: list[str]) -> dict[str, Any]:
    base, base_done = _request(engine, None, BASE_TOKENS)
    waited = time.perf_counter() + 300
    while len(base) < START_AFTER:
        if time.perf_counter() > waited:
            raise TimeoutError(f"the base request got {len(base)} tokens in 300 s")
        time.sleep(0.001)
    t0 = time.perf_counter()
    first_token_ms = []
    for name in names * 2:
        sent = time.perf_counter()
        arrivals, done = _request(engine, name, 4)
        assert done.wait(300), f"the request for {name} did not finish"
        first_token_ms.append((arrivals[0] - sent) * 1e3)
    t1 = time.perf_counter()
    assert base_done.wait(300), "the base request did not finish"
    assert base_done.is_set() and len(base) == BASE_TOKENS
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(base)]
    during = [g for g, a, b in gaps if b > t0 and a < t1]
    outside = [g for g, a, b in gaps if b <= t0 or a >= t1]
    return {
        "window_s": t1 - t0,
        "base_tokens_during": sum(1 for t in base if t0 < t < t1),
        "max_gap_during_ms": max(during, default=0.0) * 1e3,
        "median_gap_during_ms": statistics.median(during) * 1e3 if during else None,
        "median_gap_outside_ms": statistics.median(outside) * 1e3 if outside else None,
        "adapter_first_token_ms_median": statistics.median(first_token_ms),
        "adapter_first_token_ms_max": max(first_token_ms),
        "adapter_requests": len(first_token_ms),  # each evicts another adapter: a slot load
    }


def main(argv: list[str] | None = None) -> int:
    from loraplane.worker.bench.common import engine_probe_parser, engine_probe_result

    p = engine_probe_parser(__doc__, rounds=3)
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters (>= 3)")
    args = p.parse_args(argv)
    if args.adapters < 3:
        p.error("--adapters must be >= 3: with two slots, fewer would not evict each time")

    from loraplane.worker.bench.common import probe_fixtures
    from loraplane.worker.server.factory import ServeConfig, build_engine

    result = engine_probe_result("slot_stall", args)
    names = [f"ad{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        model, paths = probe_fixtures(Path(tmp), args.arch, args.layers, args.hidden, names)
        config = ServeConfig(
            model=str(model),
            device=args.device,
            dtype="float32" if args.device == "cpu" else None,
            warmup=False,
            max_loras_per_batch=2,
            max_loaded_loras=args.adapters,
            max_lora_rank=16,
            max_running=8,
        )
        engine = build_engine(config)
        manager = engine.executor.runner.lora
        engine.start()
        try:
            for name, path in paths.items():
                loaded = engine.load_adapter(name, str(path)).result(timeout=300)
                assert loaded.success, loaded.error_message
            plan = [("warm-up trial", True)]
            for _ in range(args.rounds):
                plan += [("step stream", False), ("copy stream", True)]
            for label, overlap in plan:
                engine._on_engine(lambda o=overlap: setattr(manager, "overlap_loads", o))
                row = {"setting": label, **trial(engine, names)}
                print(json.dumps(row), flush=True)
                result["trials"].append(row)
        finally:
            engine.stop()
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
