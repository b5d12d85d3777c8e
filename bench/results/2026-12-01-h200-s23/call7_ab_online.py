"""Call 7's A/B: the fused sampler kernel before a332e65 (9acc7d8's ``kernels/sampling.py``,
copied to ``out/pre_online_kernel.py``) against a332e65's, alternating in one process on the
same parameter tables and logits (bf16, 128k, bs 16/64/128), ms a launch with a device sync;
``same``: both wrote the same tokens."""

import importlib.util
import json
import os
import statistics
import time

import torch

from loraplane.worker.engine import sampling as S
from loraplane.worker.kernels import sampling as new

spec = importlib.util.spec_from_file_location("old_sampling", "out/pre_online_kernel.py")
assert spec is not None and spec.loader is not None
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def table(params, vocab, dev):
    rows = [
        [
            i,
            p.top_k if 0 < p.top_k < vocab else 0,
            S._float_bits(p.temperature),
            S._float_bits(max(p.top_p, S.TOP_P_MIN)),
            S.draw_seed(p.seed if p.seed is not None else i, 0),
        ]
        for i, p in enumerate(params)
    ]
    return torch.tensor(rows, dtype=torch.int64, device=dev)


def ms(fn):
    t = []
    for i in range(22):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


CASES = {
    "top_p": (S.SamplingParams(temperature=0.7, top_p=0.9), 3.0),
    "temp": (S.SamplingParams(temperature=0.7), 3.0),
    "flat_top_p": (S.SamplingParams(temperature=0.7, top_p=0.9), 1.0),
    "top_k_top_p": (S.SamplingParams(temperature=0.7, top_p=0.9, top_k=50), 3.0),
}
res = []
for bs in (16, 64, 128):
    for name, (p, scale) in CASES.items():
        x = (torch.randn(bs, 128256, device="cuda") * scale).bfloat16()
        t = table([p] * bs, 128256, "cuda")
        o1 = torch.empty(bs, dtype=torch.int64, device="cuda")
        o2 = torch.empty_like(o1)
        a, b = [], []
        for _ in range(5):
            a.append(ms(lambda x=x, t=t, o=o1: old.sample_table(x, t, o)))
            b.append(ms(lambda x=x, t=t, o=o2: new.sample_table(x, t, o)))
        row = {
            "bs": bs,
            "case": name,
            "old_ms": round(statistics.median(a), 3),
            "new_ms": round(statistics.median(b), 3),
            "same": torch.equal(o1, o2),
        }
        row["ratio"] = round(row["new_ms"] / row["old_ms"], 3)
        res.append(row)
        print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "ab_online.json"), "w") as f:
    json.dump(res, f, indent=1)
