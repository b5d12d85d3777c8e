"""Segmented shrink/expand: Triton (interpreter) vs torch reference vs a dense per-row einsum.

Every case gives each slot distinct weights, a distinct rank and a distinct scaling, and fills
the rows of A / columns of B beyond each slot's rank with NaN: a segment that read another
slot's weights, rank or scaling, or read past its rank, fails the dense comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from loraplane.worker.kernels import expand, reference, shrink

pytestmark = pytest.mark.kernels

# Under the interpreter (the default tier) everything runs on CPU; with TRITON_INTERPRET=0 on
# a GPU machine the same tests run compiled on CUDA, in bf16 too.
ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Triton vs the torch reference: both accumulate in fp32 and round once.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

SLICES = {
    "plain": [0, 48],
    "qkv_gqa": [0, 32, 48, 64],  # q = 32 wide, k = v = 16 wide
    "gate_up": [0, 40, 80],
}


@dataclass
class Case:
    x: torch.Tensor  # [T, K]
    lora_a: torch.Tensor  # [num_slots, num_slices * R, K], NaN beyond each rank
    lora_b: torch.Tensor  # [num_slots, N_total, R], NaN beyond each rank
    seg_indptr: torch.Tensor  # int32 [S + 1]
    seg_slots: torch.Tensor  # int32 [S]
    slot_ranks: torch.Tensor  # int32 [num_slots]
    slot_scalings: torch.Tensor  # float32 [num_slots]
    row_order: torch.Tensor | None  # int64 [positions]
    slice_offsets: torch.Tensor  # int32 [num_slices + 1]
    max_seg_len: int
    row_slot: torch.Tensor  # int64 [T]: slot of each row, -1 = no adapter (test bookkeeping)

    @property
    def num_slices(self) -> int:
        return self.slice_offsets.shape[0] - 1


def make_case(
    *,
    seg_lens: list[int],
    seg_slots: list[int],
    slot_ranks: list[int],
    max_rank: int = 16,
    hidden: int = 40,
    offsets: list[int] | None = None,
    base_rows: int = 5,
    permute: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets or SLICES["plain"]
    num_slices, num_slots, n_total = len(offsets) - 1, len(slot_ranks), offsets[-1]
    covered = sum(seg_lens)
    total_rows = covered + base_rows
    x = torch.randn(total_rows, hidden, generator=gen)
    # Distinct weights and scalings per slot; NaN poison beyond each slot's rank.
    lora_a = torch.randn(num_slots, num_slices, max_rank, hidden, generator=gen) * 0.3
    lora_b = torch.randn(num_slots, n_total, max_rank, generator=gen) * 0.3
    for slot, rank in enumerate(slot_ranks):
        lora_a[slot, :, rank:] = float("nan")
        lora_b[slot, :, rank:] = float("nan")
    scalings = torch.tensor([0.5 + 1.25 * slot for slot in range(num_slots)], dtype=torch.float32)

    if permute:
        # Segment positions gather arbitrary rows; the base rows are scattered among them.
        perm = torch.randperm(total_rows, generator=gen)
        row_order: torch.Tensor | None = perm[:covered].to(torch.int64)
        rows_of_position = perm[:covered]
    else:
        # Contiguous segments; rows with no adapter lie after the last segment.
        row_order = None
        rows_of_position = torch.arange(covered)
    indptr = [0]
    for length in seg_lens:
        indptr.append(indptr[-1] + length)
    row_slot = torch.full((total_rows,), -1, dtype=torch.int64)
    for s, slot in enumerate(seg_slots):
        row_slot[rows_of_position[indptr[s] : indptr[s + 1]]] = slot

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    return Case(
        x=dev(x.to(dtype)),
        lora_a=dev(lora_a.reshape(num_slots, num_slices * max_rank, hidden).to(dtype)),
        lora_b=dev(lora_b.to(dtype)),
        seg_indptr=dev(torch.tensor(indptr, dtype=torch.int32)),
        seg_slots=dev(torch.tensor(seg_slots, dtype=torch.int32)),
        slot_ranks=dev(torch.tensor(slot_ranks, dtype=torch.int32)),
        slot_scalings=dev(scalings),
        row_order=dev(row_order) if row_order is not None else None,
        slice_offsets=dev(torch.tensor(offsets, dtype=torch.int32)),
        max_seg_len=max(seg_lens, default=0),
        row_slot=row_slot,
    )


def dense_delta(case: Case) -> torch.Tensor:
    """Independent float64 LoRA delta: per-row einsum with each row's own explicit weights."""
    num_slots = case.slot_ranks.shape[0]
    max_rank = case.lora_b.shape[2]
    hidden = case.x.shape[1]
    ranks = case.slot_ranks.cpu().to(torch.int64)
    keep = torch.arange(max_rank)[None, :] < ranks[:, None]  # [num_slots, R]
    a = case.lora_a.cpu().double().view(num_slots, case.num_slices, max_rank, hidden)
    a = torch.where(keep[:, None, :, None], a, torch.zeros((), dtype=torch.float64))
    b = torch.where(
        keep[:, None, :], case.lora_b.cpu().double(), torch.zeros((), dtype=torch.float64)
    )
    scalings = case.slot_scalings.cpu().double()

    slot = case.row_slot.clamp(min=0)  # [T]
    a_rows, b_rows = a[slot], b[slot]  # [T, slices, R, K], [T, N, R]
    h = torch.einsum("tc,tirc->tir", case.x.cpu().double(), a_rows)  # [T, slices, R]
    offsets = case.slice_offsets.tolist()
    delta = torch.zeros(case.x.shape[0], offsets[-1], dtype=torch.float64)
    for i in range(case.num_slices):
        lo, hi = offsets[i], offsets[i + 1]
        delta[:, lo:hi] = torch.einsum("tr,tnr->tn", h[:, i], b_rows[:, lo:hi])
    delta *= scalings[slot][:, None]
    delta[case.row_slot < 0] = 0.0
    return delta


def run_shrink(impl: object, case: Case) -> torch.Tensor:
    return impl.lora_shrink(  # type: ignore[attr-defined, no-any-return]
        case.x,
        case.lora_a,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.row_order,
        case.num_slices,
        case.max_seg_len,
    )


def run_expand(impl: object, case: Case, y: torch.Tensor, out: torch.Tensor) -> None:
    impl.lora_expand(  # type: ignore[attr-defined]
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


def run_apply(case: Case, out: torch.Tensor, per_segment: bool = False) -> None:
    seg_meta = (
        {
            "seg_ranks": case.slot_ranks.index_select(0, case.seg_slots),
            "seg_scalings": case.slot_scalings.index_select(0, case.seg_slots),
        }
        if per_segment
        else {}
    )
    expand.lora_apply(*apply_operands(case), out, case.max_seg_len, **seg_meta)


def split_k_case(dtype: torch.dtype) -> Case:
    """Three segments (one of a rank-0 slot) of gate_up over K = 1024: decode-sized, so the
    shrink splits K."""
    return make_case(
        seg_lens=[3, 5, 1],
        seg_slots=[1, 0, 2],
        slot_ranks=[16, 7, 0],
        hidden=1024,
        offsets=SLICES["gate_up"],
        permute=True,
        dtype=dtype,
    )


def apply_operands(case: Case) -> tuple[object, ...]:
    """``lora_apply``'s (and ``lora_apply_shrink``'s) leading operands for ``case``."""
    return (
        case.x,
        case.lora_a,
        case.lora_b,
        case.seg_indptr,
        case.seg_slots,
        case.slot_ranks,
        case.slot_scalings,
        case.row_order,
        case.slice_offsets,
    )


def base_output(case: Case, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n_total = int(case.slice_offsets[-1])
    return torch.randn(case.x.shape[0], n_total, generator=gen).to(case.x.dtype).to(DEVICE)


def check_case(case: Case) -> None:
    """Triton == reference (shrink and expand separately), reference == dense, base rows bitwise."""
    dtype = case.x.dtype
    tol = TOL[dtype]
    y_ref = run_shrink(reference, case)
    y_tri = run_shrink(shrink, case)
    assert y_tri.shape == y_ref.shape and y_tri.dtype == dtype
    torch.testing.assert_close(y_tri, y_ref, atol=tol, rtol=tol)

    out0 = base_output(case)
    out_ref, out_tri = out0.clone(), out0.clone()
    run_expand(reference, case, y_ref, out_ref)
    run_expand(expand, case, y_ref, out_tri)  # same y: isolates expand
    torch.testing.assert_close(out_tri, out_ref, atol=tol, rtol=tol)

    delta = dense_delta(case)
    dense_tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        (out_ref.cpu().double() - out0.cpu().double()), delta, atol=dense_tol, rtol=dense_tol
    )
    assert torch.isfinite(out_tri).all()

    # The runtime's path: shrink and expand in two launches, split-K partials summed in the shrink;
    # against the independent float64 delta (its own shrink rounds differently from y_ref).
    out_app = out0.clone()
    run_apply(case, out_app)
    torch.testing.assert_close(
        (out_app.cpu().double() - out0.cpu().double()), delta, atol=dense_tol, rtol=dense_tol
    )
    # With rank and scaling resolved per segment ahead (the batch info's seg_ranks): the same
    # arithmetic, so the same bits.
    out_seg = out0.clone()
    run_apply(case, out_seg, per_segment=True)
    assert torch.equal(out_seg, out_app)

    base = (case.row_slot < 0).nonzero().flatten().to(DEVICE)
    assert base.numel() > 0
    assert torch.equal(out_tri[base], out0[base]), "rows with no adapter must be untouched"
    assert torch.equal(out_app[base], out0[base]), "rows with no adapter must be untouched"
    assert torch.equal(out_ref[base], out0[base])


# Segments: an empty one, one-token ones, one longer than a block, a slot used twice, the
# max-rank slot (16), a rank-0 (empty) slot, and mixed ranks 4/8/16 in one launch.
MIXED = dict(
    seg_lens=[3, 0, 1, 70, 1, 6, 2],
    seg_slots=[2, 1, 0, 1, 3, 0, 4],
    slot_ranks=[4, 8, 16, 5, 0],
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slices", list(SLICES), ids=str)
@pytest.mark.parametrize("permute", [False, True], ids=["contiguous", "row_order"])
def test_mixed_slots_match_reference_and_dense(
    dtype: torch.dtype, slices: str, permute: bool
) -> None:
    check_case(make_case(**MIXED, offsets=SLICES[slices], permute=permute, dtype=dtype))  # type: ignore[arg-type]


def test_decode_one_token_per_segment_and_long_hidden() -> None:
    # Decode shape: every segment one token; hidden 300 makes the K loop take two masked steps.
    case = make_case(
        seg_lens=[1] * 6,
        seg_slots=[3, 1, 0, 2, 1, 3],
        slot_ranks=[16, 2, 7, 11],
        hidden=300,
        offsets=SLICES["qkv_gqa"],
        permute=True,
    )
    check_case(case)


def test_decode_with_k_split_in_many_parts() -> None:
    # hidden 2000 at one token per segment: the shrink splits K over 4 programs per segment
    # and slice (512 columns each), and the last of them sums their fp32 partials. A
    # rank-0 slot's segment and the base rows are never written by the shrink nor read by
    # the expand.
    case = make_case(
        seg_lens=[1, 1, 1, 1, 1],
        seg_slots=[0, 2, 1, 2, 3],
        slot_ranks=[16, 5, 9, 0],
        hidden=2000,
        offsets=SLICES["gate_up"],
        permute=True,
    )
    block_k = shrink.shrink_config(1, 16, 2000).block_k
    assert shrink.split_k_for(5 * 2, 2000, block_k) == 4  # five segments, two slices
    check_case(case)


def test_max_rank_in_every_slot() -> None:
    check_case(make_case(seg_lens=[5, 9], seg_slots=[1, 0], slot_ranks=[32, 32], max_rank=32))


def test_test_would_catch_a_segment_reading_slot_zero() -> None:
    """The dense check is sharp: running every segment with slot 0 (seed 003's bug) fails it."""
    case = make_case(seg_lens=[2, 3, 1], seg_slots=[1, 2, 0], slot_ranks=[4, 8, 16])
    wrong = Case(**{**case.__dict__, "seg_slots": torch.zeros_like(case.seg_slots)})
    out0 = base_output(case)
    out = out0.clone()
    run_expand(expand, wrong, run_shrink(shrink, wrong), out)
    delta = out.cpu().double() - out0.cpu().double()
    assert not torch.allclose(delta, dense_delta(case), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("target_slot", [0, 1, 2])
def test_segments_never_read_other_slots(target_slot: int) -> None:
    """Rewrite everything slot ``target_slot`` owns (weights, rank, scaling) with garbage:
    rows of segments on other slots stay bitwise identical."""
    case = make_case(
        seg_lens=[2, 3, 1, 4],
        seg_slots=[1, 2, 0, 1],
        slot_ranks=[4, 8, 16],
        offsets=SLICES["gate_up"],
    )
    out0 = base_output(case)
    clean = out0.clone()
    run_expand(expand, case, run_shrink(shrink, case), clean)

    garbage = Case(**case.__dict__)
    garbage.lora_a = case.lora_a.clone()
    garbage.lora_b = case.lora_b.clone()
    garbage.lora_a[target_slot] = float("nan")
    garbage.lora_b[target_slot] = 1e30
    garbage.slot_ranks = case.slot_ranks.clone()
    garbage.slot_ranks[target_slot] = 1
    garbage.slot_scalings = case.slot_scalings.clone()
    garbage.slot_scalings[target_slot] = float("nan")
    dirty = out0.clone()
    run_expand(expand, garbage, run_shrink(shrink, garbage), dirty)

    others = ((case.row_slot >= 0) & (case.row_slot != target_slot)).nonzero().flatten().to(DEVICE)
    assert torch.equal(dirty[others], clean[others])
    mine = (case.row_slot == target_slot).nonzero().flatten().to(DEVICE)
    assert not torch.equal(dirty[mine], clean[mine])  # the garbage did reach its own rows


def test_values_beyond_rank_are_never_read() -> None:
    """NaN vs zeros beyond each rank: bitwise identical results (masked loads, not multiplies)."""
    case = make_case(**MIXED, offsets=SLICES["qkv_gqa"], permute=True)  # type: ignore[arg-type]
    zeroed = Case(**case.__dict__)
    zeroed.lora_a = torch.nan_to_num(case.lora_a, nan=0.0)
    zeroed.lora_b = torch.nan_to_num(case.lora_b, nan=0.0)
    results = []
    for c in (case, zeroed):
        y = run_shrink(shrink, c)
        out = base_output(c)
        run_expand(expand, c, y, out)
        results.append((y, out))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.isfinite(results[0][1]).all()


def test_no_segments_and_only_empty_segments() -> None:
    for seg_lens, seg_slots in (([], []), ([0, 0], [0, 1])):
        case = make_case(seg_lens=seg_lens, seg_slots=seg_slots, slot_ranks=[4, 8])
        for impl in (reference, shrink):
            y = run_shrink(impl, case)
            assert y.shape == (case.x.shape[0], 16) and not y.any()
        out0 = base_output(case)
        for impl in (reference, expand):
            out = out0.clone()
            run_expand(impl, case, torch.zeros(case.x.shape[0], 16, device=DEVICE), out)
            assert torch.equal(out, out0)


def test_expand_into_strided_output_view() -> None:
    """``out`` may be a column slice of a wider buffer (unit last stride, any row stride)."""
    case = make_case(
        seg_lens=[2, 3], seg_slots=[0, 1], slot_ranks=[4, 8], offsets=SLICES["gate_up"]
    )
    y = run_shrink(reference, case)
    wide0 = torch.randn(case.x.shape[0], 100).to(DEVICE)
    wide_ref, wide_tri = wide0.clone(), wide0.clone()
    run_expand(reference, case, y, wide_ref[:, 10:90])
    run_expand(expand, case, y, wide_tri[:, 10:90])
    torch.testing.assert_close(wide_tri, wide_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(wide_tri[:, :10], wide0[:, :10]) and torch.equal(
        wide_tri[:, 90:], wide0[:, 90:]
    )


@pytest.mark.parametrize("slices", list(SLICES), ids=str)
def test_expand_loads_rounded_up_past_the_rank_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, slices: str
) -> None:
    """The expand loads B and y over each slot's rank rounded up to 8 columns (ranks 4, 8,
    16, 5 and 0 here, NaN past each rank) and zeroes what lies past the rank: the output is
    the rank-masked loads' output, bit for bit, and no NaN reaches it."""
    case = make_case(**MIXED, offsets=SLICES[slices], permute=True)  # type: ignore[arg-type]
    y = run_shrink(reference, case).clone()
    max_rank, indptr = case.lora_b.shape[2], case.seg_indptr.tolist()
    for s, slot in enumerate(case.seg_slots.tolist()):  # y past each segment's rank: NaN too
        rank = int(case.slot_ranks[slot])
        for i in range(case.num_slices):
            y[indptr[s] : indptr[s + 1], i * max_rank + rank : (i + 1) * max_rank] = float("nan")
    out0 = base_output(case)
    outs = []
    for align in (8, 1):
        monkeypatch.setattr(expand, "RANK_ALIGN", align)
        assert expand.rank_align(16) == align and expand.rank_align(12) == 1
        out = out0.clone()
        run_expand(expand, case, y, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_shrink_is_one_launch_that_repeats_bit_for_bit(dtype: torch.dtype) -> None:
    """At decode the shrink splits K; the last program of each tile sums the fp32 partials.

    Every step of a decode must give the same bits (graph replays and eager steps are
    compared on a GPU in tests/gpu), so: the result matches the reference, repeats exactly
    over launches, and each launch leaves its fix-up counts zero for the next one.
    """
    case = split_k_case(dtype)
    config = shrink.shrink_config(case.max_seg_len, 16, 1024, case.x.element_size())
    tiles = case.seg_slots.shape[0] * 2  # one row block per segment, two slices
    assert shrink.split_k_for(tiles, 1024, config.block_k) > 1, (
        "K must split, or this tests nothing"
    )
    counts = shrink.split_counts(case.x.device)
    seg_lens = case.seg_indptr.diff().cpu()
    position_rank = case.slot_ranks.cpu()[case.seg_slots.cpu().repeat_interleave(seg_lens)]
    ys = []
    for _ in range(3):
        pending = expand.lora_apply_shrink(*apply_operands(case), case.max_seg_len)  # type: ignore[arg-type]
        assert pending.y.shape == (position_rank.shape[0], 2 * 16) and pending.y.dtype == dtype
        assert not counts.any(), "a launch left fix-up counts behind; the next would misread them"
        ys.append(pending.y)
    rows = (position_rank > 0).nonzero().flatten().to(DEVICE)  # what the shrink writes
    assert 0 < rows.numel() < position_rank.shape[0]
    for y in ys[1:]:
        assert torch.equal(y[rows], ys[0][rows])
    y_ref = run_shrink(reference, case)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ys[0][rows].float(), y_ref[rows].float(), atol=tol, rtol=tol)


def test_a_stream_first_met_in_a_graph_capture_gets_zeroed_counts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A capture may allocate, but a fill it records runs only when that graph replays: a
    stream first met while capturing takes a spare buffer zeroed earlier, outside any
    capture, and with none made yet the shrink refuses rather than count on garbage."""
    device = torch.device("cpu")
    monkeypatch.setattr(shrink, "_counts", {})
    monkeypatch.setattr(shrink, "_spares", {})
    monkeypatch.setattr(shrink, "_capturing", lambda _device: True)
    with pytest.raises(RuntimeError, match="outside the capture first"):
        shrink.split_counts(device)
    assert not shrink._counts, "a failed call must record nothing"
    monkeypatch.setattr(shrink, "_capturing", lambda _device: False)
    eager = shrink.split_counts(device)  # a warm-up: its own buffer, and spares made
    spares = list(shrink._spares[device])
    assert len(spares) == shrink._SPARES and not any(t.any() for t in spares)
    shrink._counts.clear()  # the next call is a stream not seen before...
    monkeypatch.setattr(shrink, "_capturing", lambda _device: True)  # ...inside a capture
    captured = shrink.split_counts(device)
    assert captured is spares[-1] and captured is not eager and not captured.any()
    assert len(shrink._spares[device]) == shrink._SPARES - 1  # nothing allocated in capture


def test_bfloat16_on_the_cpu_is_refused_naming_the_operand() -> None:
    """The interpreter multiplies bfloat16 as raw integers: the wrappers refuse, not compute."""
    x = torch.randn(4, 32).bfloat16()
    a = torch.randn(2, 8, 32).bfloat16()
    b = torch.randn(2, 16, 8).bfloat16()
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    ranks = torch.tensor([8, 8], dtype=torch.int32)
    scalings = torch.ones(2)
    offsets = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lora_shrink: x is bfloat16 on the CPU"):
        shrink.lora_shrink(x, a, indptr, slots, ranks, None, 1, 2)
    y = torch.zeros(4, 8).bfloat16()
    out = torch.zeros(4, 16).bfloat16()
    with pytest.raises(ValueError, match=r"lora_expand: y is bfloat16 on the CPU"):
        expand.lora_expand(y, b, indptr, slots, ranks, scalings, None, offsets, out, 2)
    with pytest.raises(ValueError, match=r"lora_apply: x is bfloat16 on the CPU"):
        expand.lora_apply(x, a, b, indptr, slots, ranks, scalings, None, offsets, out, 2)
    assert not out.any()  # nothing was written


def test_the_runtime_apply_skips_only_checks() -> None:
    """``runtime_apply_shrink`` (what ``LoRABackend`` calls, no operand checks) adds exactly
    what ``lora_apply`` adds with per-segment ranks and scalings, and still refuses an ``x``
    whose columns are not contiguous (the kernels would read the wrong elements)."""
    case = split_k_case(torch.float32)
    want = base_output(case)
    got = want.clone()
    run_apply(case, want, per_segment=True)
    seg_ranks = case.slot_ranks.index_select(0, case.seg_slots)
    seg_scalings = case.slot_scalings.index_select(0, case.seg_slots)
    operands = (case.lora_a, case.lora_b, case.seg_indptr, case.seg_slots, seg_ranks)
    operands += (seg_scalings, case.row_order, case.slice_offsets, case.max_seg_len)
    expand.runtime_apply_shrink(case.x, *operands, got).expand_into(got)  # type: ignore[arg-type]
    assert torch.equal(got, want)
    x_t = case.x.t().contiguous().t()  # the same values, column stride != 1
    with pytest.raises(ValueError, match="x must be 2-D with unit column stride"):
        expand.runtime_apply_shrink(x_t, *operands, got)  # type: ignore[arg-type]


@pytest.mark.parametrize("graph_bound", [False, True])
def test_segment_tiles_give_the_full_grids_bits(graph_bound: bool) -> None:
    """Short segments (decodes) beside long ones (prompt chunks), one of a rank-0 slot, run
    over the (segment, block) pairs that hold rows: the same bits as the full grid of every
    segment times the longest one's blocks, and the dense delta. ``graph_bound``: as a
    graph's static batch launches it, the longest segment bounded by every row and the
    tiles padded to the capacity the batch's rows can need."""
    from loraplane.worker.lora.batch_info import segment_tiles, tile_capacity

    case = make_case(
        seg_lens=[3, 150, 2, 70, 1, 65],
        seg_slots=[1, 0, 3, 2, 4, 1],
        slot_ranks=[16, 7, 0, 12, 9],
        offsets=SLICES["qkv_gqa"],
        permute=True,
    )
    rows = case.x.shape[0]
    bound = rows if graph_bound else case.max_seg_len
    segments = case.seg_slots.shape[0]
    indptr = case.seg_indptr.tolist()
    capacity = tile_capacity(rows, segments, 64) if graph_bound else None
    pairs = segment_tiles(indptr, 64, capacity)
    tiles = torch.tensor(pairs, dtype=torch.int32).view(2, -1).to(DEVICE)
    assert tiles.shape[1] == (capacity or 1 + 3 + 1 + 2 + 1 + 2)
    seg_ranks = case.slot_ranks.index_select(0, case.seg_slots)
    seg_scalings = case.slot_scalings.index_select(0, case.seg_slots)
    operands = (case.lora_a, case.lora_b, case.seg_indptr, case.seg_slots, seg_ranks)
    operands += (seg_scalings, case.row_order, case.slice_offsets, bound)
    want = base_output(case)
    got = want.clone()
    expand.runtime_apply_shrink(case.x, *operands, want).expand_into(want)  # type: ignore[arg-type]
    pending = expand.runtime_apply_shrink(case.x, *operands, got, None, tiles)  # type: ignore[arg-type]
    pending.expand_into(got)
    assert torch.equal(got, want)
    delta = dense_delta(case)
    torch.testing.assert_close(
        got.cpu().double() - base_output(case).cpu().double(), delta, atol=1e-4, rtol=1e-4
    )
