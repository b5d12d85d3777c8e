"""Probe: what a fresh worker's first requests wait for, with and without the warm-up.

    python bench/probes/cold_start.py OUT.json [--device cuda|cpu] [--arch llama|qwen3-moe]
        [--layers 8] [--hidden 2048] [--max-running 64] [--settings both|warmup|cached]

Writes a bf16 fixture model and two rank-16 adapters (every target) to a temporary
directory, then runs one child process per setting, ``--no-warmup`` then ``--warmup``, each
with an empty Triton cache (``TRITON_CACHE_DIR``, set before triton is imported), as a new
pod has. Each child builds the worker's engine as ``loraplane worker serve`` does
(``factory.build_engine``: no HTTP stack), loads both adapters and times requests of 8 new tokens, each
kind twice in a row (``first``, ``again``): one greedy base request, 16 at once, one with
an adapter, 16 at once with both adapters, 40 at once with one, one top_p and one top_k
request. Each kind also lists the Triton kernel variants its requests compiled (``compiled``:
the ones the warm-up missed). ``start_s`` is the time from the start of ``build_engine`` to an engine that
serves (model load, warm-up, engine start), ``warmup_s`` the warm-up's own part. The
``first - again`` of a kind is what its first request waited for: compiles, captures and
slot loads; ``first_events`` / ``again_events`` say when each slot load ended and each step
began (ms after the submit), which places the wait.
``--settings cached`` runs ``--warmup`` twice on one Triton cache directory: the second run
is a restarted pod whose compile cache was kept (a ``LoRAPool`` ``spec.compileCache``
claim), so its warm-up loads kernels instead of compiling them. Prints and writes one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REQUEST_TOKENS = 8
# Child runs per --settings: (label, --warmup, Triton cache directory under the temp root).
# A directory first used by a run is empty then; a later run on it finds what that one wrote.
SETTINGS: dict[str, list[tuple[str, bool, str]]] = {
    "both": [("no warm-up", False, "cache_a"), ("warm-up", True, "cache_b")],
    "warmup": [("warm-up", True, "cache_a")],
    "cached": [("warm-up", True, "cache_a"), ("warm-up, kept cache", True, "cache_a")],
}


def _requests(engine: Any, count: int, adapters: list[str | None], params: Any) -> float:
    """Wall seconds until ``count`` requests (adapter ``adapters[i % len]``) all finish."""
    done = threading.Semaphore(0)
    errors: list[str] = []

    def sink(event: Any) -> None:
        if event.error:
            errors.append(event.error)
        if event.finished:
            done.release()

    t0 = time.perf_counter()
    for i in range(count):
        prompt = [1 + (13 * i + j) % 200 for j in range(12)]
        engine.submit(f"r{i}", prompt, params, adapters[i % len(adapters)], sink)
    for _ in range(count):
        if not done.acquire(timeout=600):
            raise TimeoutError("a request did not finish in 600 s")
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return time.perf_counter() - t0


def _trace_compiles() -> list[str]:
    """The Triton kernels compiled (or loaded from the disk cache) from now on in this process,
    as "name {constexprs}": each is a variant the warm-up did not run. (Triton's
    ``jit_cache_hook``, called before a variant's first launch in a process.)"""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # an older Triton: nothing traced
        return compiled

    def hook(**kwargs: Any) -> bool:
        constants = kwargs.get("compile", {}).get("constants", {})
        compiled.append(f"{kwargs['fn'].name} {constants}"[:400])
        return False  # (True would skip the compile)

    knobs.runtime.jit_cache_hook = hook
    return compiled


def child(
    model: str, adapters: list[str], warmup: bool, max_running: int, device: str
) -> dict[str, Any]:
    from loraplane.worker.engine.sampling import SamplingParams
    from loraplane.worker.server.factory import ServeConfig, build_engine

    config = ServeConfig(
        model=model,
        device=device,
        dtype="float32" if device == "cpu" else None,  # (the CPU's Triton interpreter)
        warmup=warmup,
        max_running=max_running,
        max_lora_rank=64,
    )

    class Warmed:
        """The warm-up's seconds, and when each slot load and step began (the engine's
        thread calls ``slot_loaded`` after a load, ``step`` before the step runs)."""

        def __init__(self) -> None:
            self.seconds: float | None = None
            self.events: list[tuple[str, float]] = []

        def warmed_up(self, seconds: float) -> None:
            self.seconds = seconds

        def slot_loaded(self, adapter: str) -> None:
            self.events.append((f"slot {adapter}", time.perf_counter()))

        def step(self, *_args: Any) -> None:
            self.events.append(("step", time.perf_counter()))

        def __getattr__(self, _name: str) -> Any:  # the engine's other hooks: ignored
            return lambda *a, **k: None

    warmed = Warmed()

    def timed(count: int, which: list[str | None], params: Any) -> tuple[float, list[Any]]:
        """``_requests`` and its events as [what, ms after the submit]."""
        start = len(warmed.events)
        t0 = time.perf_counter()
        seconds = _requests(engine, count, which, params)
        events = [[what, round((t - t0) * 1e3, 2)] for what, t in warmed.events[start:]]
        return seconds, events

    t0 = time.perf_counter()
    engine = build_engine(config, observer=warmed)  # type: ignore[arg-type]
    engine.start()
    result: dict[str, Any] = {
        "warmup": warmup,
        "start_s": time.perf_counter() - t0,
        "warmup_s": warmed.seconds,
    }
    names = ["a", "b"]
    t0 = time.perf_counter()
    for name, path in zip(names, adapters, strict=True):
        loaded = engine.load_adapter(name, path).result()
        assert loaded.success, loaded.error_message
    result["load_two_s"] = time.perf_counter() - t0
    greedy = SamplingParams(max_new_tokens=REQUEST_TOKENS, temperature=0.0, ignore_eos=True)
    top_p = SamplingParams(
        max_new_tokens=REQUEST_TOKENS, temperature=0.7, top_p=0.9, ignore_eos=True
    )
    top_k = SamplingParams(
        max_new_tokens=REQUEST_TOKENS, temperature=0.7, top_k=50, ignore_eos=True
    )
    kinds: list[tuple[str, int, list[str | None], Any]] = [
        ("base bs1", 1, [None], greedy),
        ("base bs16", 16, [None], greedy),
        ("lora bs1", 1, ["a"], greedy),
        ("lora bs16 two adapters", 16, ["a", "b"], greedy),
        ("lora bs40", 40, ["a"], greedy),
        ("top_p bs1", 1, [None], top_p),
        ("top_k bs1", 1, [None], top_k),
    ]
    result["requests"] = []
    compiled = _trace_compiles()
    try:
        for label, count, which, params in kinds:
            before = len(compiled)
            first, first_events = timed(count, which, params)
            again, again_events = timed(count, which, params)
            row = {"kind": label, "first_s": first, "again_s": again, "waited_s": first - again,
                   "compiled": compiled[before:], "first_events": first_events,
                   "again_events": again_events}  # fmt: skip
            print(json.dumps(row), flush=True)
            result["requests"].append(row)
    finally:
        engine.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda", help="cuda, or cpu to try the probe itself")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen3-moe"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument(
        "--settings",
        default="both",
        choices=tuple(SETTINGS),
        help="both: --no-warmup, then --warmup (each on an empty Triton cache); warmup: only "
        "--warmup; cached: --warmup on an empty cache, then again on the cache it filled",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON args of one child run
    args = p.parse_args(argv)
    if args.child:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        spec = json.loads(args.child)
        args.out.write_text(json.dumps(child(**spec)))
        return 0

    from loraplane.worker.bench.common import env_info, probe_fixtures

    payload: dict[str, Any] = {"probe": "cold_start", "env": env_info(args.device), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, paths = probe_fixtures(root, args.arch, args.layers, args.hidden)
        adapters = [str(path) for path in paths.values()]
        for i, (label, warmup, cache) in enumerate(SETTINGS[args.settings]):
            out = root / f"child_{i}.json"
            spec = {
                "model": str(model),
                "adapters": adapters,
                "warmup": warmup,
                "max_running": args.max_running,
                "device": args.device,
            }
            env = {**os.environ, "TRITON_CACHE_DIR": str(root / cache)}
            cmd = [sys.executable, __file__, str(out), "--child", json.dumps(spec)]
            subprocess.run(cmd, env=env, check=True)
            files = [f for f in (root / cache).rglob("*") if f.is_file()]
            run = {
                "setting": label,
                **json.loads(out.read_text()),
                "cache_mb": sum(f.stat().st_size for f in files) / 1e6,  # after this run
                "cache_files": len(files),
            }
            print(json.dumps({k: v for k, v in run.items() if k != "requests"}), flush=True)
            payload["runs"].append(run)
    args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
