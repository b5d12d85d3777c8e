# old (674a92d: one program a row) against new sample_table (chunks) and chunk settings, alternating
import importlib.util
import json
import os
import statistics
import time

import torch

from loraplane.worker.engine import sampling as S
from loraplane.worker.kernels import sampling as new

spec = importlib.util.spec_from_file_location("old_sampling", "out/pre_chunks_kernel.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
P = S.SamplingParams


def table(params, vocab):
    return S._fused_table(params, list(range(len(params))), [0] * len(params), vocab).cuda()


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


D = dict(CHUNK_PROGRAMS=512, CHUNK_BLOCK=1024, CHUNK_WARPS=4, CHUNK_MIN=8192)
variants = {
    "p512": {},
    "p256": dict(CHUNK_PROGRAMS=256),
    "p1024": dict(CHUNK_PROGRAMS=1024, CHUNK_MIN=4096),
    "w8b2048": dict(CHUNK_BLOCK=2048, CHUNK_WARPS=8),
}


def run_new(v, x, t, o):
    for k, val in {**D, **variants[v]}.items():
        setattr(new, k, val)
    new.sample_table(x, t, o, top_k=False, plain=True)


cases = {
    "top_p": (P(temperature=0.7, top_p=0.9, seed=1), 3.0),
    "temp": (P(temperature=0.7, seed=1), 3.0),
    "flat_top_p": (P(temperature=0.7, top_p=0.9, seed=1), 1.0),
}
res = []
for vocab in (128256, 151936):
    for bs in (1, 16, 32, 64, 128):
        for name, (p, scale) in cases.items():
            if vocab == 151936 and name != "top_p":
                continue
            x = (torch.randn(bs, vocab, device="cuda") * scale).bfloat16()
            t = table([p] * bs, vocab)
            o1 = torch.empty(bs, dtype=torch.int64, device="cuda")
            outs = {v: torch.empty_like(o1) for v in variants}
            a = []
            b = {v: [] for v in variants}
            for _ in range(4):
                a.append(ms(lambda x=x, t=t, o=o1: old.sample_table(x, t, o, top_k=False)))
                for v in variants:
                    b[v].append(ms(lambda v=v, x=x, t=t, o=outs[v]: run_new(v, x, t, o)))
            row = {
                "vocab": vocab,
                "bs": bs,
                "case": name,
                "old_ms": round(statistics.median(a), 3),
                "chunks": new.chunking(bs, vocab)[0],
            }
            for v in variants:
                row[v] = round(statistics.median(b[v]) / row["old_ms"], 3)
                row["same_" + v] = torch.equal(o1, outs[v])
            res.append(row)
            print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "ab_chunks.json"), "w") as f:
    json.dump(res, f, indent=1)
