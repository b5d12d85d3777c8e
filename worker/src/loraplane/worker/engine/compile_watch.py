"""Log every Triton kernel variant a process first launches after its warm-up.

A variant the warm-up (ADR 0008) did not cover is compiled, or read from the Triton cache
and loaded, at the first step that needs it: the requests of that step wait for it (up to
seconds). After the warm-up, every such first launch logs one WARNING line naming the
kernel and its specialization, which is how `bench/run_gpu_serve.sh` counts what the
warm-up missed (besides the decode graphs captured after it, `engine.graphs`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("loraplane.worker.compile_watch")

MESSAGE = "a Triton kernel was compiled or loaded after the warm-up: %s"


def _after_compile(**kw: Any) -> bool:
    fn = kw.get("fn")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or repr(fn)
    spec = " ".join(str(kw.get("repr", "")).split())  # one line: its constexprs and types
    log.warning(MESSAGE, f"{name} {spec}".strip()[:2000])
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
