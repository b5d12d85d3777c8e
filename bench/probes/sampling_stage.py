"""Probe: the host time of the engine's sampling stage, before and after ``StepResult``.

    python bench/probes/sampling_stage.py [OUT.json] [--device cpu|cuda]

Until 7bc9a0f the executor returned every sequence's last-token logits as fp32 on the host
(``logits.float().cpu()``) and the engine sampled each row there, greedy ones included. Now
``step_result`` takes every row's argmax where the logits are and moves full rows only for
sequences that do not sample greedily. This times both over a logits tensor of a real
vocabulary (bf16; on a CPU also fp32), all sequences greedy, at bs 16 and 128 (median of 20,
ms). On ``cuda`` the times include the device-to-host copy of the logits; on ``cpu`` they
are host work alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.engine.executor import SeqWork, step_result
from loraplane.worker.engine.sampling import SamplingParams, sample

VOCABS = (128256, 151936)  # Llama-3, Qwen3


def _before(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    host = logits.float().cpu()
    return [sample(host[i], params, None) for i in range(host.shape[0])]


def _after(logits: torch.Tensor, work: list[SeqWork]) -> list[int]:
    return step_result(logits, work).argmax


def _median_ms(fn: Any, device: str) -> float:
    times = []
    for _ in range(22):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    params = SamplingParams(temperature=0.0)
    dtypes = [torch.bfloat16] if args.device == "cuda" else [torch.float32, torch.bfloat16]
    rows: list[dict[str, Any]] = []
    for vocab, dtype, bs in ((v, d, b) for v in VOCABS for d in dtypes for b in (16, 128)):
        logits = torch.randn(bs, vocab, device=args.device).to(dtype)
        work = [SeqWork(i, 0, (1,), greedy=True) for i in range(bs)]
        assert _before(logits, params) == _after(logits, work)
        before = _median_ms(lambda x=logits: _before(x, params), args.device)
        after = _median_ms(lambda x=logits, w=work: _after(x, w), args.device)
        rows.append(
            {
                "vocab": vocab,
                "dtype": str(dtype).removeprefix("torch."),
                "bs": bs,
                "before_ms": round(before, 3),
                "after_ms": round(after, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {"device": args.device, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
