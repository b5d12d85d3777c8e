"""Shared pieces of the benchmarks: timing, environment record, incremental JSON output.

Timing rules (docs/performance.md): device work is timed with CUDA events after warm-up
(``triton.testing.do_bench``, median, L2 flushed before every repetition); host code that is
part of the real step (batch building, ``tolist`` of sampled tokens) is timed with the host
clock around whole steps that end in a synchronisation. On CPU every time is a host-clock
median and means nothing beyond "it ran".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loraplane.worker.lora.adapter import AdapterWeights


def is_cuda(device: str | torch.device) -> bool:
    return bool(torch.device(device).type == "cuda")


def sync(device: str | torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": os.environ.get("LORAPLANE_COMMIT") or git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a worker dependency
        info["triton"] = None
    if is_cuda(device):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_sms"] = props.multi_processor_count
        info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def time_device(
    fn: Callable[[], object],
    device: str,
    *,
    warmup_ms: float = 2.0,
    rep_ms: float = 8.0,
    cpu_reps: int = 2,
) -> float:
    """Median time of ``fn`` in microseconds.

    CUDA: ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed before each,
    median). The event pair brackets the launch too, so a call whose host launch is slower
    than its kernel shows that (the flush before it gives the host a head start of ~50 us).
    CPU: host-clock median of ``cpu_reps`` calls after one warm-up call.
    """
    if is_cuda(device):
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return float(ms) * 1e3
    return time_host(fn, device, reps=cpu_reps, warmup=1)


def copy_of(nbytes: int, device: str) -> Callable[[], object]:
    """A device-to-device copy moving ``nbytes`` (half read, half written): the ceiling a kernel
    moving that many bytes is compared with (``time_graph`` it the same way as the kernel)."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def time_graph(
    fn: Callable[[], object],
    device: str,
    *,
    inner: int = 20,
    replays: int = 15,
    warm: Sequence[torch.Tensor] = (),
) -> float | None:
    """GPU time (us) of ``fn`` without its host launch cost, from cold L2; CUDA only.

    ``inner`` repetitions of (a 128 MiB write that evicts L2, ``fn``) are captured in one CUDA
    graph, and the same repetitions of the write alone in another; each graph is replayed
    ``replays`` times between CUDA events, and the difference of the median replays, over
    ``inner``, is the time of one ``fn`` as it runs inside a captured decode step (where a
    layer's weights were last read one whole step earlier). Returns None off CUDA.

    ``warm``: tensors read back into L2 after each eviction, in both graphs (so their reads
    are not in the difference): what a decode step has just written or keeps reading (the
    activations, the batch's index tables), leaving only the rest (the weights) cold.
    """
    if not is_cuda(device):
        return None
    scratch = torch.empty(128 << 20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                scratch.zero_()
                for t in warm:
                    t.sum()  # a reduction reads every element (its result is not needed)
                if with_fn:
                    fn()
        graphs.append(graph)
    medians = []
    for graph in graphs:
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        medians.append(statistics.median(times))
    del graphs
    return max(0.0, float(medians[0] - medians[1]) / inner)


def time_host(fn: Callable[[], object], device: str, *, reps: int = 3, warmup: int = 1) -> float:
    """Median wall time (us) of ``fn`` with a device sync after each call (for host-heavy
    references such as the torch kernels, which read device tensors back anyway)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return float(statistics.median(times))


def host_launch_us(fn: Callable[[], object], device: str, calls: int = 50) -> float | None:
    """Host time per call with no sync in between (launch overhead of a wrapper): the
    device queue absorbs the kernels, so this is what the CPU spends per call. CUDA only."""
    if not is_cuda(device):
        return None
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync(device)
    return (t1 - t0) / calls * 1e6


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> dict[str, float]:
    """Peak memory bandwidth measured with a large device-to-device copy (read + write)."""
    if not is_cuda(device):
        nbytes = min(nbytes, 64 << 20)
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_device(lambda: dst.copy_(src), device, warmup_ms=5, rep_ms=50)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes": float(moved), "us": us, "gbytes_per_s": moved / us / 1e3}


class JsonSink:
    """A result dict written to ``path`` (atomically) after every update, so a crash or a
    timeout keeps what was measured so far."""

    def __init__(self, path: Path | None, payload: dict[str, Any]) -> None:
        self.path = path
        self.payload = payload
        self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.payload, indent=1, default=_json_default))
        tmp.replace(self.path)

    def append(self, key: str, item: Any) -> None:
        self.payload.setdefault(key, []).append(item)
        self.flush()

    def set(self, key: str, value: Any) -> None:
        self.payload[key] = value
        self.flush()

    def guarded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; on an exception record it under ``errors`` and return None."""
        try:
            return fn(*args)
        except Exception as exc:
            self.append(
                "errors",
                {"what": what, "error": repr(exc), "traceback": traceback.format_exc()[-4000:]},
            )
            print(f"[bench] {what} failed: {exc!r}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None


def _json_default(obj: object) -> object:
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def engine_probe_parser(doc: str | None, rounds: int) -> argparse.ArgumentParser:
    """The options the engine probes (``bench/probes/load_stall.py``, ``slot_stall.py``) share:
    where their JSON goes, the device, and the fixture model's architecture and size
    (``probe_fixtures``), and how many rounds of trials."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", default="qwen3-moe", choices=("llama", "qwen3-moe"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=rounds)
    return p


def engine_probe_result(probe: str, args: argparse.Namespace) -> dict[str, Any]:
    """An engine probe's JSON object before its trials: the probe, the machine, its settings."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"probe": probe, "env": env_info(args.device), "settings": settings, "trials": []}


def probe_fixtures(
    root: Path, arch: str, layers: int, hidden: int, names: Sequence[str] = ("a", "b")
) -> tuple[Path, dict[str, Path]]:
    """The probes' bf16 fixture model (vocabulary 32000, head size 128; on qwen3-moe 64
    experts, top 8) and one rank-16 adapter per name on every target (and every expert)."""
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    model = make_model(
        root / "model",
        arch,  # type: ignore[arg-type]
        dtype="bfloat16",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 128,
        num_kv_heads=max(1, hidden // 512),
        intermediate_size=hidden * 11 // 4,
        vocab_size=32000,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=hidden // 2,
        head_dim=128,
        max_position_embeddings=4096,
    )
    moe = arch == "qwen3-moe"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if not moe:
        targets += ["gate_proj", "up_proj", "down_proj"]
    adapters = {
        name: make_adapter(
            model, root / name, rank=16, alpha=32, targets=targets, seed=seed, experts=moe,
            dtype="bfloat16",
        )
        for seed, name in enumerate(names)
    }  # fmt: skip
    return model, adapters


def host_tensors(weights: AdapterWeights) -> list[torch.Tensor]:
    """Every tensor an adapter holds in host memory (the experts' ids too)."""
    stacks = [(s.experts, s.a, s.b) for s in weights.expert_stacks.values()]
    return [t for group in [*weights.dense.values(), *stacks] for t in group]


def pageable_copy(weights: AdapterWeights) -> AdapterWeights:
    """The adapter in pageable host memory (as a worker holds one whose memory could not be
    locked): the probes' other side of a pinned copy."""
    from loraplane.worker.lora.adapter import ExpertStack

    return dataclasses.replace(
        weights,
        dense={k: (a.clone(), b.clone()) for k, (a, b) in weights.dense.items()},
        expert_stacks={
            k: ExpertStack(s.experts.clone(), s.a.clone(), s.b.clone())
            for k, s in weights.expert_stacks.items()
        },
    )
