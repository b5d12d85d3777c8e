#!/usr/bin/env bash
# Issue 37 on two GPUs (kind nvidia-h200-x2), a device call per line (each under 10 minutes):
#   OUT=/some/dir ONLY="rank_graphs parity_dp2" bash bench/run_gpu_x2.sh
#   OUT=/some/dir ONLY="parity_one" bash bench/run_gpu_x2.sh    (the one-GPU run it compares with)
#   OUT=/some/dir ONLY="decode_dense_dp2 decode_dense_tp2" bash bench/run_gpu_x2.sh
#   OUT=/some/dir ONLY="decode_moe_dp2 decode_moe_tp2" bash bench/run_gpu_x2.sh
#   serving (the HTTP wheels first, as bench/run_gpu_serve.sh says):
#   OUT=/some/dir ONLY="moe-tp2 moe-dp2" bash bench/run_gpu_serve.sh
# What each step checks against the issue's acceptance:
# - rank_graphs: every rank's decode graphs captured with their NCCL collectives give the eager
#   ranks' and one GPU's tokens and logprobs (fp32 fixtures; tests/gpu/test_rank_graphs_nccl.py:
#   tp=2 dp=2 with both groups busy and with one idle, tp=2; dense and MoE).
# - parity_one / parity_dp2: bf16 parity on the 1.1B-shaped llama, one GPU against tp=2 dp=2
#   DP attention over NCCL (scripts/gpu-numerics.sh; the ranks' decode steps replay their own
#   graphs, ADR 0018): delta corr and greedy matches of the second within the first's, base
#   rows bitwise equal.
# - decode_*: `bench decode` on every rank with graphs (rows per DP group of 8..64; the
#   summary prints each 4-adapter graph row's ratio against the 0.93 target).
# Writes $OUT/numerics/*.json, $OUT/decode_*.json, $OUT/run.log, $OUT/summary.txt.
. "$(dirname "$0")/gpu_env.sh"
steps rank_graphs parity_one parity_dp2 decode_dense_dp2 decode_dense_tp2 decode_moe_dp2 decode_moe_tp2
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -lt 2 ]; then
  echo "bench/run_gpu_x2.sh needs 2 GPUs; this machine has $ngpu" >&2; exit 2
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1

step rank_graphs 280 "$PY" -m pytest -p no:cacheprovider -q tests/gpu/test_rank_graphs_nccl.py \
  -o addopts="" -rs
step parity_one 280 env OUT="$OUT/numerics" bash scripts/gpu-numerics.sh parity
step parity_dp2 280 env OUT="$OUT/numerics" bash scripts/gpu-numerics.sh dist
# the dense 8B shape (8 of 32 layers) and the Qwen3-30B-A3B shape (4 of 48), as bench/run_gpu.sh
DECODE=(-m loraplane.worker.bench.decode --device cuda --batch-sizes 8,16,32,64 --adapters 1,4,16
        --rank 16 --context 512 --steps 10 --rounds 5 --warmup 3 --cuda-graphs --control)
DENSE=(--shape llama3-8b --layers 8)
MOE=(--shape qwen3-30b-a3b --layers 4)
step decode_dense_dp2 280 "$PY" "${DECODE[@]}" "${DENSE[@]}" --tp 2 --dp 2 --dp-attention \
  --out "$OUT/decode_dense_dp2.json"
step decode_dense_tp2 280 "$PY" "${DECODE[@]}" "${DENSE[@]}" --tp 2 --out "$OUT/decode_dense_tp2.json"
step decode_moe_dp2 280 "$PY" "${DECODE[@]}" "${MOE[@]}" --tp 2 --dp 2 --dp-attention \
  --out "$OUT/decode_moe_dp2.json"
step decode_moe_tp2 280 "$PY" "${DECODE[@]}" "${MOE[@]}" --tp 2 --out "$OUT/decode_moe_tp2.json"

"$PY" - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
from loraplane.worker.bench import decode
keys = ("delta_corr", "greedy_identical", "base_rows_bitwise_equal", "mean_abs_logprob_diff_merged")
for line in (out / "run.log").read_text().splitlines():
    if re.match(r"^\d+ (passed|failed|skipped|error)", line):
        print("--- rank_graphs:", line)  # (pytest's last line; run.log has the rest)
for name in ("parity_1b_bf16.json", "parity_1b_bf16_tp2dp2.json"):
    p = out / "numerics" / name
    if p.exists():
        r = json.loads(p.read_text())
        print(f"--- {name}: " + " ".join(f"{k}={r.get(k)}" for k in keys))
for p in sorted(out.glob("decode_*.json")):
    r = json.loads(p.read_text())
    print(f"--- {p.name}")
    print(decode.summary_table(r))
    for row in r.get("rows", []):
        if row["mode"] == "graph" and row["variant"] == "4":
            verdict = "ok" if row.get("ratio_vs_off", 0) >= 0.93 else "BELOW"
            print(f"4 adapters, graphs, bs {row['bs']} per group: {row.get('ratio_vs_off', 0):.3f} "
                  f"of LoRA-off (target >= 0.93: {verdict})")
PY
echo "total $(( $(date +%s) - T0 ))s"
