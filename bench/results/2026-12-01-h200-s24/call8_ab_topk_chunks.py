# old (c887bce: top_k rows in one program) against new (top_k rows' first passes in chunks), alternating
import importlib.util
import json
import os
import statistics
import time

import torch

from loraplane.worker.engine import sampling as S
from loraplane.worker.kernels import sampling as new

spec = importlib.util.spec_from_file_location("old_sampling", "out/pre_topk_chunks_kernel.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
P = S.SamplingParams


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


cases = {
    "top_k50_top_p": (P(temperature=0.7, top_p=0.9, top_k=50, seed=1), 3.0),
    "top_k50": (P(temperature=0.7, top_k=50, seed=1), 3.0),
    "top_k20_flat": (P(temperature=1.0, top_k=20, top_p=0.95, seed=1), 0.5),
    "top_k1000": (P(temperature=1.0, top_k=1000, top_p=0.9, seed=1), 3.0),
    "top_k2000": (P(temperature=1.0, top_k=2000, seed=1), 3.0),
    "top_p": (P(temperature=0.7, top_p=0.9, seed=1), 3.0),
    "mixed": (None, 3.0),
}
res = []
for vocab in (128256, 151936):
    for bs in (1, 16, 32, 64, 128):
        for name, (p, scale) in cases.items():
            if vocab == 151936 and name not in ("top_k50_top_p", "mixed"):
                continue
            params = (
                [p] * bs
                if p
                else [
                    P(temperature=0.7, top_p=0.9, top_k=(40 if i % 2 else -1), seed=i)
                    for i in range(bs)
                ]
            )
            x = (torch.randn(bs, vocab, device="cuda") * scale).bfloat16()
            t = S._fused_table(params, list(range(bs)), [0] * bs, vocab).cuda()
            tk = any(q.top_k > 0 for q in params)
            pl = any(q.top_k <= 0 for q in params)
            ks = [max(q.top_k, 0) for q in params]
            o1 = torch.empty(bs, dtype=torch.int64, device="cuda")
            o2 = torch.empty_like(o1)
            a, b = [], []
            for _ in range(4):
                a.append(
                    ms(
                        lambda x=x, t=t, o=o1, tk=tk, pl=pl: old.sample_table(
                            x, t, o, top_k=tk, plain=pl
                        )
                    )
                )
                b.append(ms(lambda x=x, t=t, o=o2, ks=ks: new.sample_table(x, t, o, ks)))
            row = {
                "vocab": vocab,
                "bs": bs,
                "case": name,
                "old_ms": round(statistics.median(a), 3),
                "new_ms": round(statistics.median(b), 3),
                "same": torch.equal(o1, o2),
                "chunks": new.chunking(bs, vocab)[0],
            }
            row["ratio"] = round(row["new_ms"] / row["old_ms"], 3)
            res.append(row)
            print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "ab_topk_chunks.json"), "w") as f:
    json.dump(res, f, indent=1)
