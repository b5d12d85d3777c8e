"""SwiGLU kernel, plain and with gate_up's LoRA expand fused in (kernels/swiglu.py).

The fused result is checked against the unfused path's references (shrink, expand into the
gate_up output, then SwiGLU) and against an independent float64 per-row einsum. Weights beyond
each slot's rank are NaN (see test_lora_kernels_segmented), so a row that read another slot's
rank, scaling or weights fails.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_lora_kernels_segmented import (
    DEVICE,
    DTYPES,
    SLICES,
    TOL,
    Case,
    base_output,
    dense_delta,
    make_case,
)

from loraplane.worker.kernels import expand, reference, swiglu
from loraplane.worker.lora.backend import LoRABackend
from loraplane.worker.lora.batch_info import LoRABatchInfo

pytestmark = pytest.mark.kernels


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, tol: float = 0.0) -> None:
    tol = tol or TOL[dtype]
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


def _fused(case: Case, gu: torch.Tensor) -> torch.Tensor:
    slots = case.row_slot.to(torch.int32).to(DEVICE)
    return expand.lora_apply_shrink(
        case.x,
        case.lora_a,
        case.lora_b,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.slot_scalings,
        case.row_order,
        case.slice_offsets,
        case.max_seg_len,
        by_row=True,
    ).silu_mul(gu, slots, case.slot_ranks, case.slot_scalings)


def _unfused(case: Case, gu: torch.Tensor) -> torch.Tensor:
    out = gu.clone()
    y = reference.lora_shrink(
        case.x,
        case.lora_a,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.row_order,
        case.num_slices,
        case.max_seg_len,
    )
    reference.lora_expand(
        y,
        case.lora_b,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.slot_scalings,
        case.row_order,
        case.slice_offsets,
        out,
        case.max_seg_len,
    )
    return reference.silu_and_mul(out)


CASES = {
    # decode: one row per request, two adapters interleaved with base rows
    "decode_mixed": dict(
        seg_lens=[3, 2, 4], seg_slots=[2, 0, 1], slot_ranks=[8, 16, 3], permute=True
    ),
    # one adapter over every row but the base rows after it
    "one_adapter": dict(seg_lens=[21], seg_slots=[1], slot_ranks=[4, 16]),
    # a rank-0 slot (cleared) among used ones: its rows get the plain activation
    "rank_zero": dict(seg_lens=[5, 6], seg_slots=[0, 1], slot_ranks=[0, 12], permute=True),
    # hidden 1024: the shrink splits K, the kernel sums the fp32 partials
    "split_k": dict(seg_lens=[2, 3], seg_slots=[0, 1], slot_ranks=[16, 5], hidden=1024),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_lora_silu_mul_matches_expand_then_silu_mul(name: str, dtype: torch.dtype) -> None:
    case = make_case(offsets=SLICES["gate_up"], dtype=dtype, **CASES[name])  # type: ignore[arg-type]
    gu = base_output(case)
    before = gu.clone()
    got = _fused(case, gu)
    assert torch.equal(gu, before), "the fused kernel must only read the gate_up output"
    _close(got, _unfused(case, gu), dtype)
    # Independent: a float64 per-row einsum of the delta, then the activation (the kernels
    # round the shrink's output to the dtype, this does not: the segmented tests' tolerance).
    want = reference.silu_and_mul((gu.cpu().double() + dense_delta(case)).to(dtype))
    _close(got, want, dtype, 1e-4 if dtype == torch.float32 else 5e-2)
    # Rows with no adapter are exactly the plain kernel's.
    base_rows = case.row_slot < 0
    assert torch.equal(got.cpu()[base_rows], swiglu.silu_and_mul(gu).cpu()[base_rows])


def test_fused_silu_mul_names_a_bad_input() -> None:
    case = make_case(offsets=SLICES["gate_up"], seg_lens=[3], seg_slots=[0], slot_ranks=[4])
    gu = base_output(case)
    slots = case.row_slot.to(torch.int32).to(DEVICE)
    by_position = expand.lora_apply_shrink(
        case.x,
        case.lora_a,
        case.lora_b,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.slot_scalings,
        case.row_order,
        case.slice_offsets,
        case.max_seg_len,
    )
    with pytest.raises(ValueError, match=r"lora_silu_mul: the shrink must index y by row"):
        by_position.silu_mul(gu, slots, case.slot_ranks, case.slot_scalings)
    assert _fused(case, gu).shape == (gu.shape[0], gu.shape[1] // 2)  # the right call works
    with pytest.raises(ValueError, match=r"lora_silu_mul: token_slots.shape\[0\] must be"):
        expand.lora_apply_shrink(
            case.x,
            case.lora_a,
            case.lora_b,
            case.seg_indptr,
            case.seg_slots,
            case.slot_ranks,
            case.slot_scalings,
            case.row_order,
            case.slice_offsets,
            case.max_seg_len,
            by_row=True,
        ).silu_mul(gu, slots[:-1], case.slot_ranks, case.slot_scalings)


@pytest.mark.parametrize("fuse", ["on", "off"])
def test_backend_fused_and_unfused_paths_agree(fuse: str) -> None:
    """``LoRABackend.apply_silu_mul``: the wiring (by-row shrink, token slots from the batch
    info) gives the unfused path's activation."""
    case = make_case(
        offsets=SLICES["gate_up"],
        seg_lens=[4, 3],
        seg_slots=[1, 0],
        slot_ranks=[6, 16],
        permute=True,
    )
    slots = case.row_slot.tolist()
    info = LoRABatchInfo.build(slots, case.slot_ranks, case.slot_scalings, DEVICE)
    assert info is not None
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(int(case.slice_offsets[-1]), case.x.shape[1], generator=gen).to(DEVICE)

    def base(x: torch.Tensor) -> torch.Tensor:
        return x @ weight.t()

    backend = LoRABackend("triton")
    backend.fuse_silu_mul = fuse  # type: ignore[assignment]
    got = backend.apply_silu_mul(case.x, base, case.lora_a, case.lora_b, info, case.slice_offsets)
    want = reference.silu_and_mul((base(case.x).cpu().double() + dense_delta(case)).float())
    _close(got, want, torch.float32)
