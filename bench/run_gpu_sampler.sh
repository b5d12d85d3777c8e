#!/usr/bin/env bash
# The fused sampler (--sampler triton, kernels/sampling.py) on one GPU, in one call (~5 min):
#   OUT=/some/dir bash bench/run_gpu_sampler.sh   (the device tool sets $OUT)
# 1. its kernel tests compiled (tests/kernels/test_sampling_kernel.py: the torch sampler's
#    seeded tokens, bf16 included) -> $OUT/tests.txt;
# 2. torch against triton per case, vocabulary and batch size, alternating in one process
#    (bench/probes/sampling_stage.py --samplers) -> $OUT/samplers.json;
# 3. dense decode with chat sampling, torch then triton (graphs, 8 layers, one adapter and
#    LoRA off) -> $OUT/decode_chat_{torch,triton}.json.
# Each step is time-capped; one failure keeps the rest.
. "$(dirname "$0")/gpu_env.sh"
steps tests samplers decode_chat_torch decode_chat_triton
step tests 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_sampling_kernel.py
grep -E "passed|failed|error" "$LOG" | tail -3 > "$OUT/tests.txt"
step samplers 150 "$PY" bench/probes/sampling_stage.py "$OUT/samplers.json" --device cuda --samplers
for sampler in torch triton; do
  sampling=chat; [ "$sampler" = triton ] && sampling=chat-triton
  step "decode_chat_$sampler" 100 "$PY" -m loraplane.worker.bench.decode --device cuda \
    --shape llama3-8b --layers 8 --batch-sizes 16,64,128 --adapters 1 --rank 16 --context 512 \
    --steps 10 --rounds 4 --warmup 3 --cuda-graphs --sampling "$sampling" \
    --out "$OUT/decode_chat_$sampler.json"
done
cat "$OUT/tests.txt"
grep -h '"case"' "$LOG" | tail -40
