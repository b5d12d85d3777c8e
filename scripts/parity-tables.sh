#!/usr/bin/env bash
# The parity tables in docs/numerics.md: every architecture and both backends on one rank,
# and tp=4 dp=4 DP attention, fp32 on CPU. JSON under bench/results/cpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
out=bench/results/cpu; mkdir -p "$out"
.venv/bin/python -c "from pathlib import Path; from loraplane.worker.fixtures.suite import build_suite; build_suite(Path('.fixtures'))"
for arch in llama qwen2 qwen3 qwen3-moe; do
  f=.fixtures/$arch-float32
  ads=(--adapter a4=$f/a4 --adapter a8=$f/a8 --adapter a16=$f/a16 --adapter a32=$f/a32)
  for backend in torch triton; do
    .venv/bin/loraplane check parity --model $f/model "${ads[@]}" --backend $backend --json > "$out/parity_${arch}_${backend}.json"
  done
  if [ "$arch" = llama ] || [ "$arch" = qwen3-moe ]; then
    .venv/bin/loraplane check parity --model $f/model "${ads[@]}" --backend torch --tp 4 --dp 4 --dp-attention --prompts 12 --json > "$out/parity_${arch}_tp4dp4.json"
  fi
done
