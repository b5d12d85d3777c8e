"""A bfloat16 model on the CPU with the Triton LoRA backend is refused before anything loads.

Triton runs on the CPU only through its interpreter, which keeps bfloat16 values as raw
uint16 and multiplies them as integers in ``tl.dot``: LoRA outputs would be garbage. The
worker names the flags that avoid it instead of serving them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplane.worker.server.factory import ServeConfig, make_executor, unsupported_reason

pytestmark = pytest.mark.unit


@pytest.fixture
def bf16_model(suite, tmp_path: Path) -> Path:
    """The standard llama fixture with its config.json saying bfloat16 (its weights stay
    float32: nothing here loads them)."""
    model_dir, _ = suite["llama"]
    dst = tmp_path / "llama-bf16"
    shutil.copytree(model_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_checkpoint_dtype_bfloat16_is_refused_naming_the_fix(bf16_model: Path) -> None:
    reason = unsupported_reason(ServeConfig(model=str(bf16_model)))
    assert reason is not None
    assert "--dtype float32" in reason and "--lora-backend torch" in reason
    with pytest.raises(ValueError, match="raw 16-bit integers"):
        make_executor(ServeConfig(model=str(bf16_model)), max_len=64)


def test_asking_for_bfloat16_on_a_float32_checkpoint_is_refused(suite) -> None:
    model_dir, _ = suite["llama"]
    assert unsupported_reason(ServeConfig(model=str(model_dir))) is None
    assert "--dtype float32" in str(
        unsupported_reason(ServeConfig(model=str(model_dir), dtype="bfloat16"))
    )


def test_the_suggested_flags_are_accepted(bf16_model: Path) -> None:
    assert unsupported_reason(ServeConfig(model=str(bf16_model), dtype="float32")) is None
    assert unsupported_reason(ServeConfig(model=str(bf16_model), lora_backend="torch")) is None
