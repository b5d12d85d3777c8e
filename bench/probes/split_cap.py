"""Probe: the dense decode bench with a given cap on the shrink's K splits (MAX_SPLIT_K).

    python bench/probes/split_cap.py CAP OUT.json [decode bench args...]

Sets ``loraplane.worker.kernels._triton_utils.MAX_SPLIT_K`` before the bench runs, so one
device call can compare caps under the same settings (docs/performance.md).
"""

from __future__ import annotations

import sys

from loraplane.worker.bench import decode
from loraplane.worker.kernels import _triton_utils

if __name__ == "__main__":
    _triton_utils.MAX_SPLIT_K = int(sys.argv[1])
    sys.exit(decode.main(["--out", sys.argv[2], *sys.argv[3:]]))
