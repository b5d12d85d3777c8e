#!/usr/bin/env bash
# GPU numerics (issues 2 and 3), run on an H200 through the device tool:
#   kernels vs torch references in bf16, CUDA-graph decode vs eager, and `check parity` on a bf16 model of ~1.1B
#   parameters' shape against HF + PEFT and merged weights.
#   With 2 GPUs (kind nvidia-h200-x2) it also runs tp=2 dp=2 DP attention over NCCL.
# FP32_REFERENCE=1: the parity runs also report ours and HF + PEFT in bf16 against HF + PEFT in fp32
#   (check parity --fp32-reference; docs/numerics.md).
# Results: $OUT/*.json (or ./out/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/worker/src:$PWD/controlplane/src:$PWD/operator/src:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PY=${PY:-python3}
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
$PY -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)' | tee -a "$OUT/device.txt"

MODE="${1:-all}"
if [ "$MODE" = all ] || [ "$MODE" = kernels ]; then
  echo "== kernels bf16 vs torch reference; runtime decode graphs vs eager"
  LORAPLANE_GPU_REPORT="$OUT/kernels_bf16.json" $PY -m pytest -p no:cacheprovider -q tests/gpu -o addopts="" 2>&1 | tail -8
fi

big=/tmp/loraplane-1b
if [ "$MODE" = all ] || [ "$MODE" = parity ] || [ "$MODE" = dist ]; then
  echo "== fixtures: llama of 1.1B parameters' shape, bf16, 4 adapters"
  $PY - <<'PY'
from pathlib import Path
from loraplane.worker.fixtures.models import make_model
from loraplane.worker.fixtures.adapters import make_adapter
root = Path("/tmp/loraplane-1b")
if not (root / "model" / "config.json").exists():
    make_model(root / "model", "llama", seed=3, dtype="bfloat16", hidden_size=2048, num_layers=16, num_heads=16,
               num_kv_heads=8, intermediate_size=8192, vocab_size=32000)
for i, (r, a) in enumerate([(4, 8.0), (8, 32.0), (16, 16.0), (32, 64.0)]):
    if not (root / f"a{r}" / "adapter_config.json").exists():
        make_adapter(root / "model", root / f"a{r}", rank=r, alpha=a, seed=50 + i, dtype="bfloat16",
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
print("fixtures ready")
PY
fi
ADAPTERS=(a4="$big/a4" a8="$big/a8" a16="$big/a16" a32="$big/a32")
if [ "$MODE" = all ] || [ "$MODE" = parity ] || [ "$MODE" = moe ]; then
  echo "== check parity: qwen3-moe (64 experts, top-8), bf16, triton experts + expert LoRA, one GPU"
  $PY - "$OUT/parity_moe_bf16.json" <<'PY'
import json, os, sys
from pathlib import Path
from loraplane.worker.check.parity import check_parity
from loraplane.worker.fixtures.models import make_model
from loraplane.worker.fixtures.adapters import make_adapter
root = Path("/tmp/loraplane-moe")
if not (root / "model" / "config.json").exists():
    make_model(root / "model", "qwen3-moe", seed=5, dtype="bfloat16", hidden_size=1024, num_layers=4, num_heads=16,
               num_kv_heads=4, intermediate_size=2048, vocab_size=32000, num_experts=64, num_experts_per_tok=8,
               moe_intermediate_size=384, head_dim=64)
adapters = []
for i, r in enumerate((8, 16)):
    p = root / f"a{r}"
    if not (p / "adapter_config.json").exists():
        make_adapter(root / "model", p, rank=r, alpha=2.0 * r, seed=70 + i, dtype="bfloat16", experts=True,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapters.append((f"a{r}", str(p)))
rep = check_parity(root / "model", adapters, prompts=12, max_new_tokens=8, backend="triton", device="cuda", dtype="bfloat16",
                   fp32_reference=os.environ.get("FP32_REFERENCE") == "1")
json.dump(rep.as_dict(), open(sys.argv[1], "w"), indent=2)
print(json.dumps(rep.as_dict(), indent=1))
PY
fi
if [ "$MODE" = all ] || [ "$MODE" = parity ]; then
  echo "== check parity: 1.1B bf16, triton, one GPU"
  $PY - "$OUT/parity_1b_bf16.json" <<'PY'
import json, os, sys
from loraplane.worker.check.parity import check_parity
adapters = [(f"a{r}", f"/tmp/loraplane-1b/a{r}") for r in (4, 8, 16, 32)]
rep = check_parity("/tmp/loraplane-1b/model", adapters, prompts=16, max_new_tokens=8, backend="triton", device="cuda", dtype="bfloat16",
                  fp32_reference=os.environ.get("FP32_REFERENCE") == "1")
json.dump(rep.as_dict(), open(sys.argv[1], "w"), indent=2)
print(json.dumps(rep.as_dict(), indent=1))
PY
fi
if [ "$ngpu" -ge 2 ] && { [ "$MODE" = all ] || [ "$MODE" = dist ]; }; then
  echo "== check parity: tp=2 dp=2 DP attention, NCCL, bf16"
  # Spawned ranks re-import __main__, so this one runs from a file, not stdin.
  cat > /tmp/loraplane-dist.py <<'PY'
import json, sys
from loraplane.worker.check.parity_dist import check_parity_dist
adapters = [(f"a{r}", f"/tmp/loraplane-1b/a{r}") for r in (4, 8, 16, 32)]
if __name__ == "__main__":
  rep = check_parity_dist("/tmp/loraplane-1b/model", adapters, prompts=16, max_new_tokens=8, backend="triton", device="cuda",
                        dtype="bfloat16", tp=2, dp=2, dp_attention=True)
if __name__ == "__main__":
    json.dump(rep.as_dict(), open(sys.argv[1], "w"), indent=2, default=str)
    print(json.dumps(rep.as_dict(), indent=1, default=str))
PY
  $PY /tmp/loraplane-dist.py "$OUT/parity_1b_bf16_tp2dp2.json"
fi
ls -la "$OUT"
