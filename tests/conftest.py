"""Shared test fixtures: the standard tiny models and adapters (built once, reused).

Triton runs its kernels on the CPU through its interpreter unless a GPU run opts out with
TRITON_INTERPRET=0; the variable must be set before anything imports triton.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

REPO = Path(__file__).resolve().parent.parent


def fixtures_root() -> Path:
    return Path(os.environ.get("LORAPLANE_FIXTURES", REPO / ".fixtures"))


@pytest.fixture(scope="session")
def suite() -> dict[str, tuple[Path, list[tuple[str, Path]]]]:
    """{arch: (model_dir, [(adapter name, adapter dir)])} for llama, qwen2, qwen3, qwen3-moe."""
    from loraplane.worker.fixtures.suite import build_suite

    return build_suite(fixtures_root())
