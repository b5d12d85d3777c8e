"""Print the graph-mode throughput ratios (LoRA variant / LoRA off) of decode bench JSONs.

python bench/probes/ratios.py A.json [B.json ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def ratios(path: str) -> dict[str, dict[int, float]]:
    with open(path) as f:
        rows = json.load(f)["rows"]
    tok: dict[tuple[int, str], float] = {}
    for r in rows:
        if r.get("mode") == "graph" and r.get("tok_s"):
            tok[(r["bs"], r["variant"])] = r["tok_s"]
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for (bs, variant), t in sorted(tok.items()):
        off = tok.get((bs, "off"))
        if off and variant not in ("off", "head"):
            out[variant][bs] = t / off
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path)
        for variant, by_bs in ratios(path).items():
            cells = " ".join(f"bs{bs}={v:.3f}" for bs, v in sorted(by_bs.items()))
            print(f"  {variant:>5}: {cells}")
