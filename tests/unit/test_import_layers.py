"""The layering of docs/architecture.md, checked by import-linter's contracts in pyproject.toml:
the worker imports neither the control plane nor the operator; the control plane talks to
workers only over HTTP; the operator only through Kubernetes and the control plane's HTTP API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    exe = Path(sys.executable).with_name("lint-imports")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            str(REPO / r / "src") for r in ("worker", "controlplane", "operator")
        ),
    )
    result = subprocess.run(
        [str(exe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
