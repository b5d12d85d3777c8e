"""What a worker process does once warmed up: log every Triton kernel variant it first
launches after that, and keep its start-up heap out of the garbage collector.

A variant the warm-up (ADR 0008) did not cover is compiled, or read from the Triton cache
and loaded, at the first step that needs it: the requests of that step wait for it (up to
seconds). After the warm-up, every such first launch logs one WARNING line naming the
kernel and its specialization, which is how `bench/run_gpu_serve.sh` counts what the
warm-up missed (besides the decode graphs captured after it, `engine.graphs`).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("loraplane.worker.compile_watch")

MESSAGE = "a Triton kernel was compiled or loaded after the warm-up: %s"


def _after_compile(**kw: Any) -> bool:
    fn = kw.get("fn")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or repr(fn)
    # one line: its constexprs and types, and the cache key (the argument specializations,
    # which some Triton versions leave out of ``repr``)
    spec = " ".join(f"{kw.get('repr', '')} key={kw.get('key', '')!r}".split())
    log.warning(MESSAGE, f"{name} {spec}".strip()[:3000])
    return False  # (a pre-compile hook's true answer would skip the compile)


def watch_compiles() -> bool:
    """From now on, log each Triton kernel variant this process compiles or loads. False when
    this Triton has no hook for it (then nothing is logged)."""
    try:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = _after_compile
        return True
    except (ImportError, AttributeError):
        pass
    try:  # Triton before 3.4: one hook, called before each compile
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = _after_compile  # type: ignore[attr-defined]
        return True
    except (ImportError, AttributeError):
        return False


# a full collection that stops a stepping process at least this long logs a line
GC_PAUSE_WARN_S = 0.05
_gc_started: list[float] = []


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        paused = time.perf_counter() - _gc_started.pop()
        if paused >= GC_PAUSE_WARN_S:
            log.warning(
                "a full garbage collection paused this process %.0f ms (%d objects collected)",
                paused * 1e3,
                info.get("collected", 0),
            )


def settle_heap() -> None:
    """Move everything alive now (the model's modules, the captured graphs, the kernels and
    what the warm-up made, which live as long as the process) out of the cyclic garbage
    collector's reach, so a full collection while serving walks only what requests made;
    then log each full collection that pauses the process 50 ms or more. vLLM freezes its
    heap the same way after capturing its graphs: a full pass over a model's objects stops
    a step for tens to hundreds of milliseconds."""
    if _on_gc in gc.callbacks:  # settled before in this process: freeze what came since
        gc.freeze()
        return
    gc.collect()
    gc.freeze()
    gc.callbacks.append(_on_gc)


def after_warmup() -> bool:
    """``watch_compiles`` and ``settle_heap``: what each worker process does once its
    warm-up is done. False where this Triton cannot report compiles."""
    settle_heap()
    return watch_compiles()
