# old (3e7928a) against new sample_table on the same tables, alternating in one process
import importlib.util
import json
import os
import statistics
import time

import torch

from loraplane.worker.engine import sampling as S
from loraplane.worker.kernels import sampling as new

spec = importlib.util.spec_from_file_location("old_sampling", "out/pre_topk_kernel.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def table(params, vocab, dev):
    rows = [
        [
            i,
            p.top_k if 0 < p.top_k < vocab else 0,
            S._float_bits(p.temperature),
            S._float_bits(max(p.top_p, S.TOP_P_MIN)),
            S.draw_seed(i, 0),
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


P = S.SamplingParams
cases = {
    "top_k50_top_p": (P(temperature=0.7, top_p=0.9, top_k=50), 3.0),
    "top_k50": (P(temperature=0.7, top_k=50), 3.0),
    "top_k20_flat": (P(temperature=1.0, top_k=20, top_p=0.95), 0.5),
    "top_k1000": (P(temperature=1.0, top_k=1000, top_p=0.9), 3.0),
    "top_k8000": (P(temperature=1.0, top_k=8000), 3.0),
    "top_p": (P(temperature=0.7, top_p=0.9), 3.0),
}
res = []
for vocab in (128256, 151936):
    for bs in (16, 64, 128):
        for name, (p, scale) in cases.items():
            if vocab == 151936 and name not in ("top_k50_top_p", "top_k50"):
                continue
            x = (torch.randn(bs, vocab, device="cuda") * scale).bfloat16()
            t = table([p] * bs, vocab, "cuda")
            o1 = torch.empty(bs, dtype=torch.int64, device="cuda")
            o2 = torch.empty_like(o1)
            a, b = [], []
            for _ in range(5):
                a.append(ms(lambda x=x, t=t, o=o1: old.sample_table(x, t, o)))
                b.append(
                    ms(lambda x=x, t=t, o=o2, k=p.top_k > 0: new.sample_table(x, t, o, top_k=k))
                )
            row = {
                "vocab": vocab,
                "bs": bs,
                "case": name,
                "old_ms": round(statistics.median(a), 3),
                "new_ms": round(statistics.median(b), 3),
                "same": torch.equal(o1, o2),
            }
            row["ratio"] = round(row["new_ms"] / row["old_ms"], 3)
            res.append(row)
            print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "ab_topk.json"), "w") as f:
    json.dump(res, f, indent=1)
