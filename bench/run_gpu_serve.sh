#!/usr/bin/env bash
# The serving benchmark on one H200 or H100, a step or two per device call:
#   OUT=/some/dir bash bench/run_gpu_serve.sh     (the device tool sets $OUT)
# The worker's HTTP stack (FastAPI, pydantic, uvicorn) is not in the device image: install
# the wheels first (docs/performance.md, "How to run"). ONLY picks steps (default "k8 k32": two calls on a fresh machine).
# On a fresh machine (compiles and a 2-3 minute warm-up per worker) steps k8 + poisson or
# k32 alone fit one call of 10 minutes; p512, overlap and chunk0 (below) need calls of their own.
# Writes $OUT/serve_k8.json (16 adapters on 8 slots, 32 clients) and $OUT/serve_k32.json
# (0/4/16/32 adapters on 32 slots, 48 clients; two 15 s windows per row, the first one
# starting when the worker is ready; TRANSPORTS=http,in-process adds the engine driven in
# the benchmark's process), $OUT/captures.txt and $OUT/run.log.
ONLY="${ONLY:-k8 k32}"
. "$(dirname "$0")/gpu_env.sh"
steps k8 k32 p512 poisson overlap chunk0 moe-tp2 moe-dp2
WORK=/tmp/loraplane-bench-serve
COMMON=(--fixture dense --layers 16 --num-adapters 32 --workdir "$WORK" --device cuda
        --max-running 64 --prompt-len 256 --output-len 128 --worker-log-level info)
# SERVE_ARGS: more `bench serve` flags for every step, e.g. SERVE_ARGS=--worker-arg=--stage-slots=32
read -r -a EXTRA <<<"${SERVE_ARGS:-}"
COMMON+=("${EXTRA[@]}")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
step k8 300 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --slots 8 --clients 32 \
  --adapters 0,16 --warmup 5 --duration 15 --transports http --out "$OUT/serve_k8.json"
step k32 560 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --slots 32 --clients 48 \
  --adapters 0,4,16,32 --warmup 0 --windows 2 --duration 15 --transports ${TRANSPORTS:-http} \
  --out "$OUT/serve_k32.json"
# The issue-36 targets at other loads (each its own worker; run them in a later call with
# ONLY="p512 poisson" or ONLY="overlap chunk0" when a call's 9 minutes are spent):
# 512-token prompts with 64 new tokens; Poisson arrivals at 80 % of each closed-loop row's
# rate; overlapped steps; whole-prompt prefills (--chunked-prefill-size 0) against the
# default chunking.
step p512 300 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]/256/512}" --output-len 64 \
  --slots 32 --clients 48 --adapters 0,4,16 --warmup 5 --duration 15 --transports http \
  --out "$OUT/serve_p512.json"
step poisson 300 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --slots 32 --clients 48 \
  --adapters 0,16 --warmup 5 --duration 15 --poisson-fraction 0.8 --transports http \
  --out "$OUT/serve_poisson.json"
step overlap 300 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --slots 32 --clients 48 \
  --adapters 0,4,16 --warmup 5 --duration 15 --transports http --worker-arg=--overlap \
  --out "$OUT/serve_overlap.json"
step chunk0 300 "$PY" -m loraplane.worker.bench.serve "${COMMON[@]}" --slots 32 --clients 48 \
  --adapters 0,16 --warmup 5 --duration 15 --transports http \
  --worker-arg=--chunked-prefill-size --worker-arg=0 --out "$OUT/serve_chunk0.json"
# Issue 37 on two GPUs (nvidia-h200-x2; ONLY="moe-tp2 moe-dp2"): the Qwen3-30B-A3B shape
# (16 of its 48 layers) at 64 and 128 clients, TP only against DP attention.
MOE=(--fixture moe --layers 16 --num-adapters 16 --workdir "$WORK-moe" --device cuda
     --max-running 128 --prompt-len 256 --output-len 128 --worker-log-level info --tp 2
     --slots 16 --clients 64,128 --adapters 0,4,16 --warmup 5 --duration 15 --transports http)
step moe-tp2 550 "$PY" -m loraplane.worker.bench.serve "${MOE[@]}" --out "$OUT/serve_moe_tp2.json"
step moe-dp2 550 "$PY" -m loraplane.worker.bench.serve "${MOE[@]}" --dp 2 --dp-attention \
  --out "$OUT/serve_moe_dp2.json"
"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
from loraplane.worker.bench.serve import diagnosis
for p in sorted(pathlib.Path(sys.argv[1]).glob("serve_*.json")):
    rows = json.loads(p.read_text())["rows"]
    print(f"--- {p.name}")
    print("transport  clients adapters slots window  tok/s  ttft50  ttft99  itl50  itl99  req  err  busy")
    for r in rows:
        print(f"{r['transport']:<10} {r['clients']:>7} {r['adapters']:>8} {r['slots']:>5} {r['window']:>6} "
              f"{r['out_tok_s']:>6} {r['ttft_ms_p50']!s:>7} {r['ttft_ms_p99']!s:>7} {r['itl_ms_p50']!s:>6} "
              f"{r['itl_ms_p99']!s:>6} {r['requests']:>4} {r['errors']:>4} {r['gpu_busy']!s:>5}")
        print(f"        {diagnosis(r)}")  # cpu per process, the worker's figures, error kinds
PY
# the decode graphs each worker captured, and the Triton kernels it compiled, after its
# warm-up (what a client waited for)
for f in "$WORK"/worker-k*.log; do
  [ -f "$f" ] || continue
  echo "--- $(basename "$f"): graphs captured after the warm-up: $(sed -n '/warm-up done/,$p' "$f" | grep -c 'captured a \(decode\|prompt-step\) graph'), Triton kernels compiled or loaded after it: $(grep -c 'compiled or loaded after the warm-up' "$f"), full garbage collections of 50 ms or more: $(grep -c 'full garbage collection paused' "$f")"
  sed -n '/warm-up done/,$p' "$f" | grep 'captured a decode graph\|captured a prompt-step graph\|compiled or loaded after the warm-up\|full garbage collection paused' | head -40
done | tee "$OUT/captures.txt"
# the workers' logs without the access lines, last lines (a failed start says why there)
for f in "$WORK"*/worker*.log; do [ -f "$f" ] && grep -v uvicorn.access "$f" | tail -n 400 >"$OUT/$(basename "$f")"; done
echo "total $(( $(date +%s) - T0 ))s"
