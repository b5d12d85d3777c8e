#!/usr/bin/env bash
# Everything issue 9 measures on one H200, in one call (budget: well under 9 minutes).
#   OUT=/some/dir bash bench/run_gpu.sh     (the device tool sets $OUT)
#   The device's copy of the tree may report a stale git HEAD: pass LORAPLANE_COMMIT=<hash>.
#   ONLY="decode_dense decode_moe" runs those steps alone (default: every step).
# Writes $OUT/kernels.json, $OUT/decode_dense.json, $OUT/decode_moe.json, $OUT/run.log and
# prints a short table last. Each step is time-capped and guarded: one failure keeps the rest;
# every JSON is rewritten after each measured row, so a timeout keeps what was done.
. "$(dirname "$0")/gpu_env.sh"
steps kernels decode_dense decode_moe
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; "$PY" -c 'import torch,triton;print(torch.__version__,triton.__version__)'; } >>"$LOG" 2>&1

# 1. kernels: decode T=16/64/128 + prefill 2048, ranks 16/64, 1/4/16 adapters, both shapes.
step kernels 250 "$PY" -m loraplane.worker.bench.kernels --device cuda \
  --shapes llama3-8b,qwen3-30b-a3b --ranks 16,64 --adapters 1,4,16 --tokens 16,64,128,2048 \
  --rep-ms 6 --max-seconds 200 --out "$OUT/kernels.json"
# 2. dense decode (8 of 32 layers, real vocab), eager + CUDA graphs, with a short eager profile
#    and the kernel time per graph step at bs 16 and 32 (what limits the LoRA there).
step decode_dense 170 "$PY" -m loraplane.worker.bench.decode --device cuda --shape llama3-8b \
  --layers 8 --batch-sizes 16,32,64,128 --adapters 1,4,16 --rank 16 --context 512 \
  --steps 10 --rounds 8 --warmup 3 --cuda-graphs --control --profile --profile-graphs 16,32 \
  --out "$OUT/decode_dense.json"
# 3. MoE decode (4 of 48 layers), eager + CUDA graphs (experts are routed on the device).
step decode_moe 150 "$PY" -m loraplane.worker.bench.decode --device cuda --shape qwen3-30b-a3b \
  --layers 4 --batch-sizes 16,32,64,128 --adapters 1,4,16 --rank 16 --context 512 \
  --steps 10 --rounds 8 --warmup 3 --cuda-graphs --control --out "$OUT/decode_moe.json"

ONLY="${ONLY:-}" "$PY" - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, os, sys, pathlib
out = pathlib.Path(sys.argv[1])
only = os.environ["ONLY"].split()
from loraplane.worker.bench import decode, kernels
for name, mod in (("kernels.json", kernels), ("decode_dense.json", decode), ("decode_moe.json", decode)):
    if only and name.removesuffix(".json") not in only:
        print(f"--- {name}: skipped (ONLY)"); continue  # a file there now is from another run
    p = out / name
    if not p.exists():
        print(f"--- {name}: missing"); continue
    try:
        r = json.loads(p.read_text())
    except Exception as e:
        print(f"--- {name}: unreadable {e!r}"); continue
    print(f"--- {name}")
    if mod is kernels:  # rank 16: 4 adapters at T=16/128/2048, 16 adapters at T=128 (all in the JSON)
        keep = lambda c: c["rank"] == 16 and ((c["adapters"] == 4 and c["tokens"] in (16, 128, 2048)) or (c["adapters"] == 16 and c["tokens"] == 128))
        r = dict(r, cases=[c for c in r.get("cases", []) if keep(c)])
    print(mod.summary_table(r))
PY
echo "total $(( $(date +%s) - T0 ))s"
