"""Helpers for control-plane unit tests: PEFT adapter directories written without torch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.peft_files import write_adapter


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "adapter", **kwargs: Any) -> Path:
        return write_adapter(tmp_path / name, **kwargs)

    return make
