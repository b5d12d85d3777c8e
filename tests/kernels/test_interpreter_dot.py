"""What the bit-for-bit checks of the kernels tier rely on in Triton's interpreter.

The interpreter computes ``tl.dot`` with numpy's matmul. Batch invariance (a row's result
does not depend on the other rows of its tile: ADR 0001, ``base_rows_bitwise_equal``) holds
there only if the BLAS gives a row the same bits whatever the number of rows. OpenBLAS's
Haswell and Zen sgemm kernels do not on an AMD EPYC; ``scripts/test.sh`` sets
``OPENBLAS_CORETYPE=Sandybridge``, whose kernels do."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.kernels


def test_a_rows_matmul_result_does_not_depend_on_the_row_count() -> None:
    rng = np.random.default_rng(0)
    varied = []
    for k in (16, 32, 64, 128):
        a = rng.standard_normal((64, k)).astype(np.float32)
        b = rng.standard_normal((k, 32)).astype(np.float32)
        full = a @ b
        varied += [
            (rows, k) for rows in (16, 32, 48) if not np.array_equal(a[:rows] @ b, full[:rows])
        ]
    assert not varied, (
        f"numpy's matmul gives rows other bits at another row count ({varied} as (rows, K)): "
        "the interpreter's dots are then not batch invariant; run the tier through "
        "scripts/test.sh, or set OPENBLAS_CORETYPE=Sandybridge before Python starts"
    )
