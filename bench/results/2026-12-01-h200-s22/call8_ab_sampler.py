"""A/B in one process: ``sample_rows`` at 50b9730 against the tree's, on a GPU.

    git show 50b9730:worker/src/loraplane/worker/engine/sampling.py > out/base_sampling.py
    python bench/results/2026-12-01-h200-s22/call8_ab_sampler.py OUT.json

Cases over bf16 logits of N(0, scale) (scale 3: language-model-like nuclei at top_p 0.9;
scale 1: flat), bs 16 and 128, vocabularies of Llama-3 and Qwen3; four alternating blocks of
30 calls each way, median ms. A seeded case also checks that both give the same tokens.
"""

import importlib.util
import json
import statistics
import sys
import time
from typing import Any

import torch

from loraplane.worker.engine import sampling as new

CASES: dict[str, tuple[dict[str, Any] | None, float]] = {
    "sampled": ({"temperature": 0.7, "top_p": 0.9}, 3.0),
    "flat": ({"temperature": 0.7, "top_p": 0.9}, 1.0),
    "top_k": ({"temperature": 0.7, "top_p": 0.9, "top_k": 50}, 3.0),
    "seeded": ({"temperature": 0.7, "top_p": 0.9, "seed": 1}, 3.0),
    "plain": ({"temperature": 0.7}, 3.0),
    "mixed": (None, 3.0),  # a quarter each greedy, plain, top_p and top_k rows
}
MIXED = (
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 50},
)


def _load_base() -> Any:
    spec = importlib.util.spec_from_file_location("base_sampling", "out/base_sampling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_sampling"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _params(module: Any, case: str, bs: int) -> list[Any]:
    kw = CASES[case][0]
    if kw is None:
        return [module.SamplingParams(**MIXED[i % 4]) for i in range(bs)]
    return [module.SamplingParams(**kw)] * bs


def _median_ms(fn: Any, reps: int = 30) -> float:
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main(out: str) -> None:
    old = _load_base()
    rows = []
    for vocab in (128256, 151936):
        for bs in (16, 128):
            for case, (_, scale) in CASES.items():
                logits = (torch.randn(bs, vocab, device="cuda") * scale).bfloat16()
                po, pn, idx = _params(old, case, bs), _params(new, case, bs), [0] * bs
                ta, tb = [], []
                for _ in range(4):  # alternating blocks
                    ta.append(_median_ms(lambda x=logits, p=po, i=idx: old.sample_rows(x, p, i)))
                    tb.append(_median_ms(lambda x=logits, p=pn, i=idx: new.sample_rows(x, p, i)))
                row: dict[str, Any] = {
                    "vocab": vocab,
                    "bs": bs,
                    "case": case,
                    "old_ms": round(statistics.median(ta), 3),
                    "new_ms": round(statistics.median(tb), 3),
                }
                if case == "seeded":
                    same = old.sample_rows(logits, po, idx) == new.sample_rows(logits, pn, idx)
                    row["same_tokens"] = same
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
