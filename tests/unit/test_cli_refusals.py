"""Issue 38: every command prints a refusal as one `error: …` line on stderr and exits 2, with
no traceback: a bad option value, a config field the model does not implement, a usage error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def loraplane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(
        str(ROOT / p) for p in ("worker/src", "controlplane/src", "operator/src")
    )
    return subprocess.run(
        [sys.executable, "-m", "loraplane.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "llama"
    result = loraplane("fixtures", "make-model", "--arch", "llama", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_fixtures_make_adapter_bad_targets(model_dir: Path, tmp_path: Path) -> None:
    result = loraplane(
        "fixtures", "make-adapter", "--model", str(model_dir), "--rank", "4", "--alpha", "8",
        "--targets", "q_proj,rotary", "--out", str(tmp_path / "a"),
    )  # fmt: skip
    assert_refused(result, "targets", "'rotary'", "q_proj")
    assert not (tmp_path / "a").exists()


@pytest.fixture()
def biased_model(model_dir: Path, tmp_path: Path) -> Path:
    """The fixture model with config.json asking for MLP biases, which the model lacks."""
    out = tmp_path / "biased"
    out.mkdir()
    for f in model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["mlp_bias"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_check_parity_refused_config_field(biased_model: Path) -> None:
    assert_refused(
        loraplane("check", "parity", "--model", str(biased_model), "--backend", "torch"),
        "config.mlp_bias",
    )


def test_worker_serve_refused_config_field(biased_model: Path) -> None:
    assert_refused(
        loraplane("worker", "serve", "--model", str(biased_model), "--port", "1"),
        "config.mlp_bias",
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("worker", "serve"), ("Missing option '--model'",)),
        (("fixtures", "make-model", "--arch", "gpt2", "--out", "/nonexistent"), ("--arch 'gpt2'",)),
        (("controlplane", "serve", "--db", "not a url"), ("--db", "'not a url'")),
        (("controlplane", "serve", "--redis", "http://x"), ("--redis", "redis://")),
        (("operator", "run", "--worker-pod-label", "gpu"), ("--worker-pod-label 'gpu'",)),
        (("operator", "run", "--metrics-port", "70000"), ("--metrics-port", "70000")),
        (("cluster", "up", "--nodes", "0", "--no-build"), ("nodes=0",)),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) and v and v[0][0] != "-" else None,
)
def test_refusals_are_one_line_and_exit_2(
    args: tuple[str, ...], needles: tuple[str, ...], tmp_path: Path
) -> None:
    assert_refused(loraplane(*args, env={"LORAPLANE_CLUSTER_DIR": str(tmp_path)}), *needles)
