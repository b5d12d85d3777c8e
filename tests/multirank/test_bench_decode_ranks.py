"""`loraplane bench decode --tp 2 --dp 2 --dp-attention --cuda-graphs` on the CPU: every rank
of the worker (gloo) runs the bench in step, every DP group decodes its own rows, and the JSON
has a row per variant with graphs off (eager) and on (each rank's static graph path, run
without capture on the CPU). No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

TINY = [
    "--device", "cpu", "--batch-sizes", "2", "--adapters", "2", "--rank", "4", "--context", "4",
    "--steps", "1", "--warmup", "1", "--rounds", "1",
]  # fmt: skip


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_bench_decode_over_ranks_gives_rows_with_graphs_on_and_off(
    tmp_path: Path, shape: str
) -> None:
    out = tmp_path / "decode.json"
    args = [*TINY, "--shape", shape, "--tp", "2", "--dp", "2", "--dp-attention", "--cuda-graphs"]
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane.worker.bench.decode", *args, "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout[proc.stdout.index("{") :]  # (the rows' lines come first)
    assert json.loads(printed) == json.loads(out.read_text())
    result = json.loads(printed)
    settings = result["settings"]
    assert (settings["tp"], settings["dp"], settings["dp_attention"]) == (2, 2, True)
    assert settings["modes"] == ["eager", "graph"] and settings["graph_capture"] is False
    assert not result.get("errors"), result.get("errors")
    rows = {(r["mode"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(m, v) for m in ("eager", "graph") for v in ("head", "off", "none", "2")}
    for (mode, variant), row in rows.items():
        assert row["tok_s"] > 0 and row["timed_steps"] == 1, row
        if variant != "head":
            assert row["ratio_vs_off"] > 0, row
        if mode == "graph":  # the graph path ran, and gave the eager step's logits
            assert row["graph_replayed"] is True, row
            assert row["graph_vs_eager_max_abs"] <= 1e-5, row
            assert row["graph_vs_eager_same_argmax"] is True, row


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (["--tp", "3", "--dp", "2", "--dp-attention"], "tp (3) must be divisible by dp (2)"),
        (["--tp", "2", "--dp", "2"], "needs --dp-attention"),
        (["--tp", "2", "--profile"], "--profile and --profile-graphs profile one rank"),
    ],
)
def test_bench_decode_refuses_a_bad_layout_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str], layout: list[str], message: str
) -> None:
    from loraplane.worker.bench.decode import main

    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--shape", "tiny", *layout])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
