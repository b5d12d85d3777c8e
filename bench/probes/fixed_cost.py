"""Probe: split each kernel's decode time into a fixed cost and a streaming rate.

    python bench/probes/fixed_cost.py KERNELS.json [OUT.json]

Reads a ``loraplane bench kernels`` result (no device needed) and, for the shrink and the
expand of the dense and of the MoE modules at decode, fits ``time = fixed + bytes / rate`` by
least squares over the graph-timed cases, next to the same fit of a device copy of the same
bytes (``*_copy_graph_us``, same run). A kernel whose rate matches the copy's but whose fixed
cost is larger misses a bandwidth target on small cases for latency, not for streaming: it
reaches a given share of the peak only from ``bytes_for_share`` on. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SHARE = 0.60  # issue 9: shrink/expand at >= 60% of the measured peak


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * x`` over ``(x, t)`` points: ``(a, b)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx if sxx else 0.0
    return mt - b * mx, b


def line(points: list[tuple[float, float]], peak_mb_per_us: float) -> dict[str, Any]:
    fixed, us_per_mb = fit(points)
    den = 1.0 - SHARE * peak_mb_per_us * us_per_mb
    return {
        "fixed_us": round(fixed, 2),
        "rate_tb_s": round(1.0 / us_per_mb, 2) if us_per_mb > 0 else None,
        # bytes / (fixed + bytes / rate) = SHARE * peak  <=>  bytes = SHARE*peak*fixed / den
        "mb_for_share": round(SHARE * peak_mb_per_us * fixed / den, 1) if den > 0 else None,
    }


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    peak = result["peak"]["gbytes_per_s"] * 1e-3  # MB per microsecond
    out: dict[str, Any] = {"peak_gb_s": round(result["peak"]["gbytes_per_s"]), "share": SHARE}
    cases = [c for c in result["cases"] if c.get("phase") == "decode"]
    for kernel in ("shrink", "expand"):
        for family in ("dense", "moe"):
            sub = [c for c in cases if c["module"].startswith("moe") == (family == "moe")]
            sub = [
                c for c in sub if c.get(f"{kernel}_graph_us") and c.get(f"{kernel}_copy_graph_us")
            ]
            if len(sub) < 2:
                continue
            mb = [c[f"{kernel}_bytes"] / 1e6 for c in sub]
            own = list(zip(mb, (c[f"{kernel}_graph_us"] for c in sub), strict=True))
            copy = list(zip(mb, (c[f"{kernel}_copy_graph_us"] for c in sub), strict=True))
            out[f"{kernel}_{family}"] = {
                "cases": len(sub),
                "mb_range": [round(min(mb), 2), round(max(mb), 1)],
                "at_share": sum(c[f"{kernel}_graph_pct_peak"] >= 100 * SHARE for c in sub),
                "copy_at_share": sum(
                    c[f"{kernel}_copy_graph_pct_peak"] >= 100 * SHARE for c in sub
                ),
                "kernel": line(own, peak),
                "copy": line(copy, peak),
            }
    return out


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    report = analyse(json.loads(Path(argv[0]).read_text()))
    text = json.dumps(report, indent=1)
    if len(argv) > 1:
        Path(argv[1]).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
