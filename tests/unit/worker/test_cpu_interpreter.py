"""Triton kernels on a CPU run through Triton's interpreter, which the runner selects
before it builds the model (torch imports triton on its first ops). Where triton was
imported before that and nobody chose, the runner refuses and names the fix."""

from __future__ import annotations

import os
import sys

import pytest

from loraplane.worker.engine.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.unit


def test_triton_imported_first_is_refused_naming_the_fix(
    suite, monkeypatch: pytest.MonkeyPatch
) -> None:
    import triton  # noqa: F401  (imported first, as torch's first ops may)

    model_dir, _ = suite["llama"]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "triton" in sys.modules
    with pytest.raises(RuntimeError, match=r"start the worker with TRITON_INTERPRET=1") as err:
        ModelRunner(RunnerConfig(model=str(model_dir), device="cpu", sampler="triton"))
    assert "--sampler torch" in str(err.value)
    # torch kernels need no interpreter: the same runner with the torch sampler starts
    runner = ModelRunner(RunnerConfig(model=str(model_dir), device="cpu", sampler="torch"))
    assert runner.model_config.vocab_size > 0
    assert "TRITON_INTERPRET" not in os.environ


def test_compiled_kernels_asked_for_on_a_cpu_are_refused(
    suite, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, _ = suite["llama"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=0 asks for compiled Triton kernels"):
        ModelRunner(RunnerConfig(model=str(model_dir), device="cpu", lora_backend="torch",
                                 sampler="triton"))  # fmt: skip
