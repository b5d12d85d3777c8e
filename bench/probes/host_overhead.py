"""Probe: the host time of our own code around the Triton launches (runs on any CPU).

    python bench/probes/host_overhead.py [OUT.json]

Eager LoRA decode pays host time per projection: our wrappers (checks, configs, buffers)
and Triton's launcher, twice (shrink and expand). On the H200's host an eager LoRA step
costs ~5 ms more than LoRA-off over 8 layers (docs/performance.md), which graphs hide on one
GPU but multi-rank workers pay. This probe measures the first part alone, on the CPU: it runs
under the Triton interpreter with every kernel launch replaced by a counter, so what is left
is Python and torch's host work, with no device and no kernel in the way.

- ``apply``: one ``LoRABackend.apply`` (a stacked qkv shrink + expand, 16 rows, rank 16,
  1 adapter), microseconds per call, and launches per call;
- ``decode``: the eager decode step of the ``tiny`` shape, 8 layers, bs 16, LoRA off and with
  1 adapter (``loraplane.worker.bench.decode``), ms per step.

Prints one JSON object. Compare two commits as ratios of runs on the same machine.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
from triton.runtime.interpreter import InterpretedFunction

LAUNCHES: collections.Counter[str] = collections.Counter()


def _count_launch(self: Any, *args: Any, **kwargs: Any) -> None:
    LAUNCHES[self.fn.__name__] += 1


InterpretedFunction.run = _count_launch  # type: ignore[method-assign]


def apply_us(calls: int = 3000) -> dict[str, float]:
    from loraplane.worker.lora.backend import LoRABackend
    from loraplane.worker.lora.batch_info import LoRABatchInfo

    rows, hidden, rank, slots, n, slices = 16, 4096, 16, 4, 6144, 3
    dt = torch.float16  # (the launches are counted, not run; bf16 is refused on the CPU)
    x = torch.randn(rows, hidden, dtype=dt)
    lora_a = torch.zeros(slots, slices * rank, hidden, dtype=dt)
    lora_b = torch.zeros(slots, n, rank, dtype=dt)
    offsets = torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32)
    out = torch.zeros(rows, n, dtype=dt)
    ranks = torch.full((slots,), rank, dtype=torch.int32)
    info = LoRABatchInfo.build([0] * rows, ranks, torch.ones(slots), "cpu")
    assert info is not None
    backend = LoRABackend("triton", overlap="off")
    for _ in range(200):
        backend.apply(x, lora_a, lora_b, info, offsets, out)
    LAUNCHES.clear()
    t0 = time.perf_counter()
    for _ in range(calls):
        backend.apply(x, lora_a, lora_b, info, offsets, out)
    us = (time.perf_counter() - t0) / calls * 1e6
    return {"us_per_call": us, "launches_per_call": sum(LAUNCHES.values()) / calls}


def decode_ms() -> dict[str, float]:
    from loraplane.worker.bench import decode

    args = "--device cpu --shape tiny --layers 8 --batch-sizes 16 --adapters 1 --rank 16"
    args += " --context 64 --steps 20 --rounds 3 --warmup 3 --backend triton"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "decode.json")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            decode.main([*args.split(), "--out", out])
        with open(out) as f:
            rows = json.load(f)["rows"]
    return {r["variant"]: r["step_ms"] for r in rows if r["variant"] in ("off", "1")}


def main() -> int:
    torch.set_num_threads(1)
    result: dict[str, Any] = {"probe": "host_overhead", "apply": apply_us(), "decode": decode_ms()}
    result["decode"]["lora_minus_off_ms"] = result["decode"]["1"] - result["decode"]["off"]
    text = json.dumps(result, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
