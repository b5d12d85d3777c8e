"""Probe: the time of the engine's sampling stage, per step: on the device against on the host.

    python bench/probes/sampling_stage.py [OUT.json] [--device cpu|cuda] [--samplers]

``sampling.sample_rows`` picks every row's token where the logits are. The reference is
the host path it replaced (7bc9a0f and earlier): each sequence's last-token logits moved to
the host as fp32 (``logits.float().cpu()``) and sampled there one row at a time. This times, over a logits tensor of a real
vocabulary (bf16; on a CPU also fp32) at bs 16 and 128 (median of 20 calls, of 5 when a
call takes over 0.1 s; ms):

- ``greedy``: every row greedy, on the host against ``sample_rows``;
- ``sampled``: every row at temperature 0.7, top_p 0.9 (common chat settings), on the host
  against ``sample_rows``; and the same over flat logits, with top_k 50,
  and seeded (``CASES``).

On ``cuda`` the times include the device-to-host copies; on ``cpu`` they are host work
alone.

``--samplers`` times ``sample_rows`` with the torch sampler against the fused one
(``--sampler triton``, ``kernels/sampling.py``) over the same cases, alternating the two
call by call, and says whether their tokens agree on the seeded case (they should, up to
rounding).
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

from loraplane.worker.engine.sampling import SamplingParams, sample_rows

VOCABS = (128256, 151936)  # Llama-3, Qwen3
# (parameters, logits scale): N(0, 3) logits give nuclei of about 50-500 tokens at
# temperature 0.7 and top_p 0.9 over 128k (a language model's range); N(0, 1) ones are flat,
# with nuclei of ~56k tokens, past the sampler's candidates (it then sorts the vocabulary).
CASES = {
    "greedy": (SamplingParams(temperature=0.0), 1.0),
    "sampled": (SamplingParams(temperature=0.7, top_p=0.9), 3.0),
    "sampled_flat": (SamplingParams(temperature=0.7, top_p=0.9), 1.0),
    "sampled_top_k": (SamplingParams(temperature=0.7, top_p=0.9, top_k=50), 3.0),
    "sampled_seeded": (SamplingParams(temperature=0.7, top_p=0.9, seed=1), 3.0),
}


def _host_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """The host reference: one fp32 row sampled on the host."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits / params.temperature
    if 0 < params.top_k < scores.numel():
        scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[-1], -1e30)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _before(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    host = logits.float().cpu()
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return [_host_row(host[i], params, gen) for i in range(host.shape[0])]


def _after(logits: torch.Tensor, params: list[SamplingParams], sampler: str = "torch") -> list[int]:
    return sample_rows(logits, params, [0] * len(params), sampler)


def _samplers(device: str, out: Path | None) -> list[dict[str, Any]]:
    """torch against triton, per case, vocabulary and batch size (bf16 logits), ms."""
    rows: list[dict[str, Any]] = []
    for vocab, bs, case in ((v, b, c) for v in VOCABS for b in (16, 64, 128) for c in CASES):
        params, scale = CASES[case]
        logits = (torch.randn(bs, vocab, device=device) * scale).bfloat16()
        batch = [params] * bs
        torch_ms, triton_ms = [], []
        for _ in range(5):  # alternate, so a slow phase of the machine falls on both
            torch_ms.append(_median_ms(lambda x=logits, p=batch: _after(x, p), device))
            triton_ms.append(_median_ms(lambda x=logits, p=batch: _after(x, p, "triton"), device))
        row = {
            "case": case,
            "vocab": vocab,
            "bs": bs,
            "torch_ms": round(statistics.median(torch_ms), 3),
            "triton_ms": round(statistics.median(triton_ms), 3),
        }
        row["ratio"] = round(row["triton_ms"] / row["torch_ms"], 3)
        if params.seed is not None or params.greedy:
            row["same_tokens"] = _after(logits, batch) == _after(logits, batch, "triton")
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return rows


def _median_ms(fn: Any, device: str) -> float:
    """Median of 20 timed calls after 2 untimed ones (5 after 1 when a call takes > 0.1 s)."""
    times: list[float] = []
    count = 22
    while len(times) < count:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) == 1 and times[0] > 0.1:
            count = 6
    return statistics.median(times[2 if count == 22 else 1 :]) * 1e3


def _ops(device: str, bs: int, vocab: int) -> dict[str, float]:
    """The batched sampler's steps one by one over ``[bs, vocab]`` bf16 logits, ms."""
    logits = torch.randn(bs, vocab, device=device).bfloat16()
    scores = logits.float() / 0.7
    probs = torch.softmax(scores, dim=-1)
    steps = {
        "float_div": lambda: logits.float() / 0.7,
        "softmax": lambda: torch.softmax(scores, dim=-1),
        "sort": lambda: torch.sort(probs, dim=-1, descending=True),
        "cumsum": lambda: torch.cumsum(probs, dim=-1),
        "topk_50": lambda: torch.topk(scores, 50, dim=-1),
        "topk_1024": lambda: torch.topk(probs, 1024, dim=-1),
        "exponential": lambda: torch.empty_like(probs).exponential_(),
        "div_argmax": lambda: (probs / probs).argmax(-1),
        "argmax_tolist": lambda: logits.argmax(-1).tolist(),
    }

    def synced(fn: Any) -> Any:
        def run() -> None:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    return {name: round(_median_ms(synced(fn), device), 3) for name, fn in steps.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", action="store_true", help="time the sampler's steps one by one")
    p.add_argument(
        "--after-only", action="store_true", help="time sample_rows alone (not the host path)"
    )
    p.add_argument(
        "--samplers", action="store_true", help="time the torch sampler against the fused one"
    )
    args = p.parse_args(argv)
    if args.samplers:
        _samplers(args.device, args.out)
        return 0
    if args.ops:
        for bs in (16, 128):
            row = {"bs": bs, "vocab": VOCABS[0], **_ops(args.device, bs, VOCABS[0])}
            print(json.dumps(row), flush=True)
        return 0
    dtypes = [torch.bfloat16] if args.device == "cuda" else [torch.float32, torch.bfloat16]
    rows: list[dict[str, Any]] = []
    for vocab, dtype, bs, case in (
        (v, d, b, c) for v in VOCABS for d in dtypes for b in (16, 128) for c in CASES
    ):
        params, scale = CASES[case]
        logits = (torch.randn(bs, vocab, device=args.device) * scale).to(dtype)
        if params.greedy and not args.after_only:  # (the same tokens both ways)
            assert _before(logits, params) == _after(logits, [params] * bs)
        before = (
            None
            if args.after_only
            else _median_ms(lambda x=logits, p=params: _before(x, p), args.device)
        )
        after = _median_ms(lambda x=logits, p=params, n=bs: _after(x, [p] * n), args.device)
        rows.append(
            {
                "case": case,
                "vocab": vocab,
                "dtype": str(dtype).removeprefix("torch."),
                "bs": bs,
                "before_ms": None if before is None else round(before, 3),
                "after_ms": round(after, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if args.out:  # after each row: a time cap keeps what was measured
            args.out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    result = {"device": args.device, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
