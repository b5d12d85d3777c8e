"""The Triton kernel variants a GPU would compile, seen on the CPU under ``TRITON_INTERPRET=1``.

On a GPU, ``JITFunction.run`` compiles a kernel once per key: its constexpr values, the launch
options (``num_warps``, ``num_stages``) and, for every other argument, what Triton specializes
on. The interpreter compiles nothing, so ``record_keys`` hooks ``InterpretedFunction.run``
(test-only) and computes each launch's key with Triton's own binder
(``triton.runtime.jit.create_function_from_signature``) over the CUDA backend of an sm_90
target (``CUDABackend(GPUTarget("cuda", 90, 32))``, built without a GPU). In the Triton of
this venv (3.7) that binder asks ``native_specialize_impl``, which gives an int 1 as the
constexpr 1, any other int its type (``i32`` or ``i64``: past 2**31 - 1) and ``"D"`` when it
is divisible by 16, a tensor its dtype and ``"D"`` when its data pointer is 16-byte aligned,
a float, a bool or None no specialization, and honours each kernel's ``do_not_specialize``
and ``do_not_specialize_on_alignment``. A CPU tensor's pointer is aligned as a CUDA one is
(allocations at 64 bytes or more, views offset by their elements), so a view's alignment is
the same on both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

Key = tuple[Any, ...]


def _binder(fn: Any) -> Callable[..., Any]:
    """Triton's own argument binder for ``fn`` (an ``InterpretedFunction``), against CUDA."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    signature = inspect.signature(fn.fn)
    dns = fn.kwargs.get("do_not_specialize") or ()
    dns_oa = fn.kwargs.get("do_not_specialize_on_alignment") or ()
    params = [
        KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
        for i, p in enumerate(signature.parameters.values())
    ]
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    return create_function_from_signature(signature, params, backend)  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    """A hashable, printable form of a constexpr value (a dtype, a JIT function...)."""
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return getattr(value, "__name__", None) or str(value)


def launch_key(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """The GPU's compile key of one launch of ``fn`` with these arguments: the kernel, each
    parameter's specialization (a constexpr's value), and the launch options."""
    binder = getattr(fn, "_loraplane_binder", None)
    if binder is None:
        binder = fn._loraplane_binder = _binder(fn)
    params, specialization, options = binder(*args, **kwargs)
    spec = tuple(
        (name, kind, _plain(value))
        for name, (kind, value) in zip(params, specialization, strict=True)
    )
    return (fn.fn.__name__, spec, tuple(sorted((k, _plain(v)) for k, v in options.items())))


def describe(key: Key) -> str:
    name, spec, options = key
    args = " ".join(
        f"{p}={v}" if kind == "constexpr" else f"{p}:{kind}{'/' + v if v else ''}"
        for p, kind, v in spec
    )
    opts = " ".join(f"{k}={v}" for k, v in options)
    return f"{name}({args}) {opts}".rstrip()


@dataclass
class Recorder:
    """Keys of every launch, by the phase named when it ran (``phase``)."""

    phase: str = "start"
    keys: dict[str, set[Key]] = field(default_factory=dict)
    launches: int = 0
    shadow: bool = False  # record the key without running the kernel

    def add(self, key: Key) -> None:
        self.keys.setdefault(self.phase, set()).add(key)
        self.launches += 1

    def seen(self, *phases: str) -> set[Key]:
        return set().union(*(self.keys.get(p, set()) for p in phases))

    @contextmanager
    def shadowing(self) -> Iterator[None]:
        """Launches in this block are recorded and not run (a kernel the GPU path would
        launch where the CPU path computes the same thing with torch)."""
        before, self.shadow = self.shadow, True
        try:
            yield
        finally:
            self.shadow = before


@contextmanager
def record_keys() -> Iterator[Recorder]:
    """Record the compile key of every interpreted Triton launch in this block."""
    from triton.runtime.interpreter import InterpretedFunction

    recorder = Recorder()
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        recorder.add(launch_key(self, args, kwargs))
        if recorder.shadow:
            return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
