"""A/B in one process: sample_rows at 50b9730 (out/base_sampling.py) against HEAD's."""
import importlib.util, json, statistics, sys, time
import torch
from loraplane.worker.engine import sampling as new
spec = importlib.util.spec_from_file_location("base_sampling", "out/base_sampling.py")
old = importlib.util.module_from_spec(spec); sys.modules["base_sampling"] = old; spec.loader.exec_module(old)
CASES = {"sampled": (dict(temperature=0.7, top_p=0.9), 3.0), "flat": (dict(temperature=0.7, top_p=0.9), 1.0),
         "top_k": (dict(temperature=0.7, top_p=0.9, top_k=50), 3.0), "seeded": (dict(temperature=0.7, top_p=0.9, seed=1), 3.0),
         "plain": (dict(temperature=0.7), 3.0), "mixed": (None, 3.0)}
def params_for(mod, case, bs):
    kw, _ = CASES[case]
    if kw is None:  # a quarter each greedy, plain, top_p, top_k
        kinds = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=50)]
        return [mod.SamplingParams(**kinds[i % 4]) for i in range(bs)]
    return [mod.SamplingParams(**kw)] * bs
def med(fn, reps=30):
    ts = []
    for _ in range(reps + 3):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts[3:]) * 1e3
rows = []
for vocab in (128256, 151936):
    for bs in (16, 128):
        for case in CASES:
            logits = (torch.randn(bs, vocab, device="cuda") * CASES[case][1]).bfloat16()
            po, pn = params_for(old, case, bs), params_for(new, case, bs)
            idx = [0] * bs
            a = b = 0.0; ta = []; tb = []
            for r in range(4):  # alternate
                ta.append(med(lambda: old.sample_rows(logits, po, idx)))
                tb.append(med(lambda: new.sample_rows(logits, pn, idx)))
            row = {"vocab": vocab, "bs": bs, "case": case, "old_ms": round(statistics.median(ta), 3), "new_ms": round(statistics.median(tb), 3)}
            if case == "seeded":
                row["same_tokens"] = old.sample_rows(logits, po, idx) == new.sample_rows(logits, pn, idx)
            rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
