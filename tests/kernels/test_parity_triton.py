"""Issue 2 acceptance with the Triton backend (interpreter on CPU): same mixed-batch check."""

from __future__ import annotations

import pytest
from tests.unit.runtime.test_parity import ARCHS, assert_parity

from loraplane.worker.check.parity import check_parity

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_peft_and_merged_triton_backend(suite, arch: str) -> None:
    model_dir, adapters = suite[arch]
    report = check_parity(model_dir, adapters, prompts=10, max_new_tokens=5, backend="triton")
    assert_parity(report)
