"""The Triton SwiGLU (kernels/swiglu.py) against its torch reference, and its input errors."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_lora_kernels_segmented import DEVICE, DTYPES, TOL

from loraplane.worker.kernels import reference, swiglu

pytestmark = pytest.mark.kernels


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 40), (37, 40), (130, 200), (0, 40)])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int, inter: int) -> None:
    gu = (torch.randn(rows, 2 * inter) * 3).to(dtype).to(DEVICE)
    got = swiglu.silu_and_mul(gu)
    assert got.shape == (rows, inter) and got.dtype == dtype
    _close(got, reference.silu_and_mul(gu), dtype)


def test_silu_and_mul_names_a_bad_input() -> None:
    with pytest.raises(ValueError, match=r"silu_and_mul: gu must be \[rows, 2 \* intermediate\]"):
        swiglu.silu_and_mul(torch.zeros(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="silu_and_mul: gu must be a 2-D tensor"):
        swiglu.silu_and_mul(torch.zeros(4, 2, 8, device=DEVICE))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_stays_finite_at_large_gates(dtype: torch.dtype) -> None:
    """exp(-gate) overflows for very negative gates: silu must go to -0, not NaN."""
    gate = torch.tensor([[-200.0, -60.0, -1.0, 0.0, 1.0, 60.0, 200.0, 3.5]])
    gu = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1).to(dtype).to(DEVICE)
    got = swiglu.silu_and_mul(gu)
    assert torch.isfinite(got.float()).all()
    _close(got, reference.silu_and_mul(gu), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reads_a_row_strided_view(dtype: torch.dtype) -> None:
    """``gu`` may be a view into a wider buffer (row stride > 2I): rows are read at their
    stride, and the result is a new contiguous tensor."""
    wide = (torch.randn(9, 2 * 40 + 24) * 3).to(dtype).to(DEVICE)
    gu = wide[:, : 2 * 40]
    assert gu.stride(0) == 2 * 40 + 24
    got = swiglu.silu_and_mul(gu)
    assert got.is_contiguous()
    _close(got, reference.silu_and_mul(gu.contiguous()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_adds_a_delta_first(dtype: torch.dtype) -> None:
    """The MoE experts add their LoRA's per-pair output inside the SwiGLU: ``silu(g + dg) *
    (u + du)`` in fp32; a zero delta gives the bits of no delta (rows without an adapter)."""
    gen = torch.Generator().manual_seed(7)
    gu = (torch.randn(21, 2 * 40, generator=gen) * 3).to(dtype).to(DEVICE)
    delta = (torch.randn(21, 2 * 40, generator=gen)).to(dtype).to(DEVICE)
    delta[::3] = 0
    gu[0, :5] = -0.0  # silu(-0.0) * u is -0.0: a zero delta must keep it
    got = swiglu.silu_and_mul(gu, delta)
    _close(got, reference.silu_and_mul(gu, delta), dtype)
    plain = swiglu.silu_and_mul(gu)
    # the same bits, the sign of a zero included (torch.equal takes -0.0 for 0.0)
    assert torch.equal(
        got[::3].view(torch.int16 if dtype != torch.float32 else torch.int32),
        plain[::3].view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    assert not torch.allclose(got[1::3].float(), plain[1::3].float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=r"silu_and_mul: delta must have the shape of gu"):
        swiglu.silu_and_mul(gu, delta[:, :40])
    with pytest.raises(ValueError, match=r"silu_and_mul: delta must have dtype in"):
        swiglu.silu_and_mul(gu, delta.to(torch.float64))
