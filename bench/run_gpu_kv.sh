#!/usr/bin/env bash
# The paged KV cache's acceptance runs on one H200 (issue 42, ADR 0015), in one device call:
#   OUT=/some/dir bash bench/run_gpu_kv.sh      (the device tool sets $OUT)
# The worker's HTTP stack (FastAPI, pydantic, uvicorn) is not in the device image: install the
# wheels first (docs/performance.md, "How to run"). The 32-layer Llama-3-8B shape in bf16
# (--fixture dense --layers 32), 4 rank-16 adapters, --max-model-len 8192, the pool sized by
# --mem-fraction (default 0.85), --max-running 256. One worker serves every row (its warm-up
# dominates a call), 1088-token prompts and 128 new tokens over the 4 adapters:
#   shared_prefix 0     64 then 256 clients: out tok/s at 256 vs 64 clients; errors must be 0
#   shared_prefix 1024  the same loads with the first 1024 ids shared by all the requests of
#                       an adapter: TTFT p50 at 64 clients should be >= 3x lower than without
# Writes $OUT/serve_kv.json; summary.txt lists every row. The last step, `prefill_attention`
# (`loraplane bench prefill-attention`: a mixed step's attention, the prompt chunks through
# one Triton launch vs one SDPA per chunk), needs a device call of its own, the kv step
# taking most of one: ONLY=prefill_attention.
. "$(dirname "$0")/gpu_env.sh"
steps kv prefill_attention
WORK=/tmp/loraplane-bench-kv
COMMON=(--fixture dense --layers 32 --num-adapters 4 --workdir "$WORK" --device cuda
        --slots 4 --max-running 256 --output-len 128 --adapters 4 --transports http
        --worker-arg=--max-model-len=8192 --worker-log-level info)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
step kv 560 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --prompt-len 1088 \
  --shared-prefix 0,1024 --clients 64,256 --warmup 8 --duration 20 --out "$OUT/serve_kv.json"
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
from loraplane.worker.bench.serve import diagnosis
for p in sorted(pathlib.Path(sys.argv[1]).glob("serve_*.json")):
    rows = json.loads(p.read_text())["rows"]
    print(f"--- {p.name}")
    print("clients adapters prefix  tok/s  ttft50  ttft99  itl50  itl99  req  err  busy")
    for r in rows:
        print(f"{r['clients']:>7} {r['adapters']:>8} {r.get('shared_prefix', 0):>6} "
              f"{r['out_tok_s']:>6} {r['ttft_ms_p50']!s:>7} {r['ttft_ms_p99']!s:>7} "
              f"{r['itl_ms_p50']!s:>6} {r['itl_ms_p99']!s:>6} {r['requests']:>4} "
              f"{r['errors']:>4} {r['gpu_busy']!s:>5}")
        print(f"        {diagnosis(r)}")  # cpu per process, the worker's figures, error kinds
PY
# the workers' logs without the access lines, last lines (a failed start says why there)
for f in "$WORK"*/worker*.log; do [ -f "$f" ] && grep -v uvicorn.access "$f" | tail -n 400 >"$OUT/$(basename "$f")"; done
step prefill_attention 240 "$PY" -m loraplane.worker.bench.prefill_attention \
  --out "$OUT/prefill_attention.json"
echo "total $(( $(date +%s) - T0 ))s"
