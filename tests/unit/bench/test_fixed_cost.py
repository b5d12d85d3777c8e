"""bench/probes/fixed_cost.py: the fit that splits a kernel's time into fixed cost and rate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PROBE = Path(__file__).resolve().parents[3] / "bench" / "probes" / "fixed_cost.py"


def load_probe():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fixed_cost", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(module: str, mb: float, kernel_us: float, copy_us: float) -> dict[str, object]:
    row: dict[str, object] = {"module": module, "phase": "decode"}
    for k in ("shrink", "expand"):
        row.update(
            {
                f"{k}_bytes": mb * 1e6,
                f"{k}_graph_us": kernel_us,
                f"{k}_copy_graph_us": copy_us,
                f"{k}_graph_pct_peak": 100 * mb / kernel_us / 4.0,
                f"{k}_copy_graph_pct_peak": 100 * mb / copy_us / 4.0,
            }
        )
    return row


def test_fit_recovers_fixed_cost_and_rate() -> None:
    """Kernel: 6 us + 0.25 us per MB (4 TB/s); copy: 2 us at the same rate. At a 4 TB/s peak,
    60% needs 0.6 * 4 * fixed / (1 - 0.6) MB: 36 MB for the kernel, 12 MB for the copy."""
    fixed_cost = load_probe()
    sizes = [1.0, 4.0, 16.0, 64.0]
    cases = [case("qkv", mb, 6.0 + mb / 4.0, 2.0 + mb / 4.0) for mb in sizes]
    cases.append({"module": "qkv", "phase": "prefill"})  # ignored
    report = fixed_cost.analyse({"peak": {"gbytes_per_s": 4000.0}, "cases": cases})
    shrink = report["shrink_dense"]
    assert shrink["cases"] == 4
    assert shrink["kernel"] == {"fixed_us": 6.0, "rate_tb_s": 4.0, "mb_for_share": 36.0}
    assert shrink["copy"] == {"fixed_us": 2.0, "rate_tb_s": 4.0, "mb_for_share": 12.0}
    # 64 MB: the kernel at 73% (22 us), the copy at 89%; 16 MB: the copy at 67%, the kernel 40%
    assert shrink["at_share"] == 1 and shrink["copy_at_share"] == 2
    assert "shrink_moe" not in report  # no MoE cases given
