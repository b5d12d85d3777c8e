"""Probe: the decode bench with the runtime's performance switches set (CUDA).

    python bench/probes/switches.py fold=1,split=8 OUT.json [decode bench args...]

Switches (unset ones keep their defaults, so one device call can compare settings; see
docs/performance.md):

- ``fold``: o/down LoRA added into the residual (``RowLoRA.fold_residual``);
- ``split``: a fixed cap on the shrink's K splits (``MAX_SPLIT_K``; unset: 512 columns per
  split at least, ``MIN_K_PER_SPLIT``);
- ``rope``: rotation, per-head norms and KV write in one kernel, a staged qkv LoRA inside it
  (``Attention.fused_rope``; 0: the torch ops and ``stacked_plain``);
- ``norm``: RMSNorm as one kernel (``RMSNorm.fused``; 0: the torch ops);
- ``attn``: a fixed number of decode-attention splits over positions
  (``attention.SPLITS_OVERRIDE``; 1: one program per (token, KV head), no split);
- ``ralign``: rank columns an expand load rounds up to (``expand.RANK_ALIGN``; 1: the loaded
  rank masks every column, which splits B's loads into single elements);
- ``extents``: ``0`` makes the staged GEMM read exactly the rows its stage positions need,
  not the GPU table's wider extent (``lora/extents.py``).

Name OUT without ``=`` or ``,``: the device tool does not bring such files back.
"""

from __future__ import annotations

import sys

from loraplane.worker.bench import decode
from loraplane.worker.kernels import _triton_utils, attention, expand
from loraplane.worker.lora import extents
from loraplane.worker.lora.layers import RowLoRA
from loraplane.worker.models.layers import RMSNorm
from loraplane.worker.models.model import Attention


def apply_switches(spec: str) -> None:
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "fold":
            RowLoRA.fold_residual = value == "1"
        elif key == "split":
            _triton_utils.MAX_SPLIT_K = int(value)
        elif key == "rope":
            Attention.fused_rope = value == "1"
        elif key == "norm":
            RMSNorm.fused = value == "1"
        elif key == "attn":
            attention.SPLITS_OVERRIDE = int(value)
        elif key == "ralign":
            expand.RANK_ALIGN = int(value)
        elif key == "extents":
            extents.ENABLED = value == "1"
        else:
            raise SystemExit(
                f"unknown switch {key!r}: expected fold, split, rope, norm, attn, ralign or extents"
            )


if __name__ == "__main__":
    apply_switches(sys.argv[1])
    sys.exit(decode.main(["--out", sys.argv[2], *sys.argv[3:]]))
