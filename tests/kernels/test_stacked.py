"""The stacked-GEMM LoRA epilogues (kernels/stacked.py) against their torch references.

A batch here has what the runtime's graphs give, and more: each adapter's rows scattered
through the batch, rows with no adapter, an adapter below the buffers' rank, a stage
position that names a slot no row reads, one that names none, and a GEMM that computes more
stage positions than the batch reads. The expected
values come from ``full = x [W; A_stage]^T`` computed here and the reference's fp32 math.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.kernels.test_lora_kernels_segmented import DEVICE, DTYPES, TOL

from loraplane.worker.kernels import reference, stacked
from loraplane.worker.kernels._triton_utils import TILE_ROWS, TILE_WORDS, StageInfo, with_tiles

pytestmark = pytest.mark.kernels

R = 16  # the stage rank: y columns per slice of a position
R_MAX = 32  # the slot buffers' rank (B's last dimension): columns past R are never read


@pytest.fixture(autouse=True, params=["by-tile", "by-rows"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both kernel variants: programs per (tile of a position's rows, columns)
    as decode steps run them (``StageInfo.tiles``), and per row block visiting its positions
    as prompt steps do (``ROWS_KERNEL_MIN``)."""
    if request.param == "by-rows":
        monkeypatch.setattr(stacked, "ROWS_KERNEL_MIN", 1)
    return str(request.param)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol)


def _batch(
    rows: int, n_base: int, n_slices: int, dtype: torch.dtype, width: int = 4, k: int = 48
) -> tuple[torch.Tensor, torch.Tensor, StageInfo]:
    """``full`` of a stacked GEMM, ``lora_b`` of 3 slots, and each row's stage position.

    Rows ``perm[:5]`` use slot 2 at stage position 3 (rank 16; with a width of 4 or more),
    ``perm[5:9]`` slot 0 at position 0 with rank 5 (A/B past the rank are zero, as in the
    slot buffers), the rest no adapter. Position 1 names slot 1, which no row reads;
    position 2 names none. At a width of 2 or above 4, rows ``perm[9:12]`` use slot 1 at
    the last position. B is of rank ``R_MAX``, with nonzero columns past the stage rank ``R``:
    the kernels must not read them."""
    g = torch.Generator().manual_seed(rows * 31 + n_base)
    n_r = n_slices * R
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n_base, k, generator=g) / k**0.5
    a = torch.randn(width, n_r, k, generator=g) / k**0.5  # stage rows by position
    b = torch.randn(3, n_base, R_MAX, generator=g) * 0.5
    a[0].view(n_slices, R, k)[:, 5:] = 0  # position 0 holds a rank-5 adapter
    b[0, :, 5:R] = 0
    full = (x @ torch.cat([w, a.reshape(-1, k)]).T).to(dtype)
    perm = torch.randperm(rows, generator=g)
    row_pos = torch.full((rows,), -1, dtype=torch.int32)
    row_pos[perm[5:9]] = 0
    pos_slots, pos_scalings = [0, 1, -1, 2][:width], [2.0, 1.0, 0.0, 0.5][:width]
    if width > 3:
        row_pos[perm[:5]] = 3
    pos_slots += [-1] * (width - 4)
    pos_scalings += [0.0] * (width - 4)
    if width == 2 or width > 4:
        row_pos[perm[9:12]] = width - 1
        pos_slots[-1], pos_scalings[-1] = 1, 3.0
    stage = StageInfo(
        row_pos=row_pos.to(DEVICE),
        pos_slots=torch.tensor(pos_slots, dtype=torch.int32, device=DEVICE),
        pos_scalings=torch.tensor(pos_scalings, device=DEVICE),
        width=width,
        rank=R,
    )
    return full.to(DEVICE), b.to(dtype).to(DEVICE), with_tiles(stage)


def _rows(stage: StageInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with an adapter, rows without one)."""
    pos = stage.row_pos.cpu()
    return (pos >= 0).nonzero()[:, 0].to(DEVICE), (pos < 0).nonzero()[:, 0].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(12, 4), (40, 4), (40, 1)])
def test_plain_adds_each_rows_own_lora_over_unequal_slices(
    dtype: torch.dtype, rows: int, width: int
) -> None:
    n_base = 96 + 2 * 40  # q | k | v, GQA widths; column blocks straddle the slices
    full, b, stage = _batch(rows, n_base, 3, dtype, width)
    offsets = torch.tensor([0, 96, 136, 176], dtype=torch.int32, device=DEVICE)
    got = stacked.stacked_plain(full, n_base, 3 * R, b, stage, offsets)
    assert got.shape == (rows, n_base) and got.is_contiguous()
    want = reference.stacked_plain(full, n_base, 3 * R, b, stage, offsets)
    _close(got, want, dtype)
    # rows without an adapter are the base output, bit for bit
    lora_rows, base_rows = _rows(stage)
    assert torch.equal(got[base_rows], full[base_rows, :n_base])
    # and the LoRA is really there for the others (not a copy of the base)
    assert (got[lora_rows].float() - full[lora_rows, :n_base].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 2, 4, 6, 8, 72])
def test_residual_adds_base_and_lora_into_the_residual_in_place(
    dtype: torch.dtype, width: int
) -> None:
    """(At a width of 72 some rows sit past position 63: the row-block programs find their
    positions 64 at a time.)"""
    rows, n_base = 40, 72
    full, b, stage = _batch(rows, n_base, 1, dtype, width)
    residual = torch.randn(rows, n_base).to(dtype).to(DEVICE)
    want = reference.stacked_residual(full, n_base, R, b, stage, residual.clone())
    got = stacked.stacked_residual(full, n_base, R, b, stage, residual)
    assert got.data_ptr() == residual.data_ptr()
    _close(residual, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("inter", "width"), [(40, 6), (200, 6), (40, 1)])
def test_silu_mul_adds_gate_and_up_loras_before_the_activation(
    dtype: torch.dtype, inter: int, width: int
) -> None:
    rows = 40
    full, b, stage = _batch(rows, 2 * inter, 2, dtype, width)
    got = stacked.stacked_silu_mul(full, 2 * inter, 2 * R, b, stage)
    assert got.shape == (rows, inter)
    _close(got, reference.stacked_silu_mul(full, 2 * inter, 2 * R, b, stage), dtype)


def test_a_prompt_steps_rows_match_the_reference() -> None:
    """A prompt-step graph's batch (as ``PromptGraphs`` orders it): long runs of rows at one
    position each (prompt chunks, 37 and 150 rows: tiles of 16 and a partial one), decode
    rows over every position, then the graph's padding rows with no adapter. Over tiles (a
    prompt-step graph's, below ``ROWS_KERNEL_MIN``) and by row blocks, the same sums."""
    g = torch.Generator().manual_seed(11)
    width, k, n_base, inter = 4, 48, 72, 40
    layout = [0] * 37 + [2] * 150 + [p % width for p in range(13)] + [-1] * 56
    rows = len(layout)
    row_pos = torch.tensor(layout, dtype=torch.int32)
    stage = with_tiles(
        StageInfo(
            row_pos=row_pos.to(DEVICE),
            pos_slots=torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=DEVICE),
            pos_scalings=torch.tensor([0.5, 2.0, 1.0, 0.0], device=DEVICE),
            width=width,
            rank=R,
        )
    )
    x = torch.randn(rows, k, generator=g)
    lora = ((row_pos >= 0) & (row_pos < 3)).to(DEVICE)  # rows at a position with a slot
    for n_slices, n in ((1, n_base), (2, 2 * inter)):
        w = torch.randn(n, k, generator=g) / k**0.5
        a = torch.randn(width * n_slices * R, k, generator=g) / k**0.5
        full = (x @ torch.cat([w, a]).T).to(DEVICE)
        b = (torch.randn(3, n, R_MAX, generator=g) * 0.5).to(DEVICE)
        bare = torch.zeros_like(b)  # the same step with every B zero: the base values
        if n_slices == 1:
            residual = torch.randn(rows, n, generator=g).to(DEVICE)
            want = reference.stacked_residual(full, n, R, b, stage, residual.clone())
            got = stacked.stacked_residual(full, n, R, b, stage, residual.clone())
            plain = stacked.stacked_residual(full, n, R, bare, stage, residual.clone())
        else:
            want = reference.stacked_silu_mul(full, n, 2 * R, b, stage)
            got = stacked.stacked_silu_mul(full, n, 2 * R, b, stage)
            plain = stacked.stacked_silu_mul(full, n, 2 * R, bare, stage)
        _close(got, want, torch.float32)
        assert torch.equal(got[~lora], plain[~lora])  # no B reaches a row without an adapter
        assert (got[lora] - plain[lora]).abs().amax(1).min() > 0  # every adapter row has its term


def test_columns_past_the_stage_positions_are_never_read() -> None:
    """The staged GEMM may read more weight rows than the positions need (lora/extents.py):
    its extra output columns, NaN here, change nothing."""
    rows, n_base = 24, 72
    full, b, stage = _batch(rows, n_base, 1, torch.float32)
    wide = torch.cat([full, torch.full((rows, 40), float("nan"), device=DEVICE)], dim=1)
    residual = torch.randn(rows, n_base, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = stacked.stacked_residual(full, n_base, R, b, stage, residual.clone())
    got = stacked.stacked_residual(wide, n_base, R, b, stage, residual.clone())
    assert torch.equal(got, want)


def test_stacked_kernels_name_a_bad_input() -> None:
    full, b, stage = _batch(12, 72, 1, torch.float32)
    with pytest.raises(ValueError, match=r"stacked_residual: full must have at least 136 columns"):
        stacked.stacked_residual(full[:, :100], 72, R, b, stage, torch.zeros(12, 72))
    with pytest.raises(ValueError, match=r"stacked_residual: residual.shape\[1\] must be 72"):
        stacked.stacked_residual(full, 72, R, b, stage, torch.zeros(12, 70, device=DEVICE))
    with pytest.raises(ValueError, match=r"stacked_silu_mul: lora_b.shape\[1\] must be 70"):
        stacked.stacked_silu_mul(full, 70, R, b, stage)
    offsets = torch.tensor([0, 72], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"stacked_plain: lora_b must have dtype torch\.float32"):
        stacked.stacked_plain(full, 72, R, b.half(), stage, offsets)
    with pytest.raises(ValueError, match=r"stacked_plain: slice_offsets must have dtype"):
        stacked.stacked_plain(full, 72, R, b, stage, offsets.long())
    with pytest.raises(ValueError, match=r"stacked_silu_mul: n_r must be 2 slices x stage.rank 16"):
        stacked.stacked_silu_mul(full, 72, R, b, stage)
    with pytest.raises(ValueError, match=r"stacked_residual: stage.row_pos must have dtype"):
        bad = dataclasses.replace(stage, row_pos=stage.row_pos.long())
        stacked.stacked_residual(full, 72, R, b, bad, torch.zeros(12, 72, device=DEVICE))
    with pytest.raises(
        ValueError, match=r"stacked_residual: stage.pos_slots.shape\[0\] must be 4 \(one per stage"
    ):
        bad = dataclasses.replace(stage, pos_slots=stage.pos_slots[:3])
        stacked.stacked_residual(full, 72, R, b, bad, torch.zeros(12, 72, device=DEVICE))
    with pytest.raises(
        ValueError, match=r"stacked_residual: stage.row_pos.shape\[0\] must be 12 \(one per row"
    ):
        bad = dataclasses.replace(stage, row_pos=stage.row_pos[:11])
        stacked.stacked_residual(full, 72, R, b, bad, torch.zeros(12, 72, device=DEVICE))
    stage.rank = 64
    with pytest.raises(ValueError, match=r"stacked_plain: stage.rank must be in 1..32"):
        stacked.stacked_plain(full, 72, R, b, stage, offsets)


def test_a_row_only_ever_reads_its_own_positions_b() -> None:
    """A NaN in one adapter's B reaches that adapter's rows only: rows of another position
    and rows with no adapter come out as without it, and B of a slot no row reads (or past
    the stage rank) is never read."""
    full, b, stage = _batch(40, 72, 1, torch.float32)
    residual = torch.randn(40, 72, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = stacked.stacked_residual(full, 72, R, b, stage, residual.clone())
    unread = b.clone()
    unread[0, :, R:] = float("nan")  # past the stage rank
    unread[1] = float("nan")  # slot 1: position 1 names it, no row reads it
    got = stacked.stacked_residual(full, 72, R, unread, stage, residual.clone())
    assert torch.equal(got, want)
    poisoned = b.clone()
    poisoned[2] = float("nan")  # slot 2: the rows at position 3
    got = stacked.stacked_residual(full, 72, R, poisoned, stage, residual.clone())
    at_3 = (stage.row_pos == 3).nonzero()[:, 0]
    others = (stage.row_pos != 3).nonzero()[:, 0]
    assert torch.isnan(got[at_3]).all()
    assert torch.equal(got[others], want[others])


@pytest.mark.parametrize("width", [1, 4])
def test_rows_at_no_readable_position_get_the_base_value_bit_for_bit(width: int) -> None:
    """A row at -1, at a position past the width or at a position that names no slot (none
    of which ``StaticLoRABatch`` gives with an adapter) is written once, with the base value;
    a -0.0 there stays -0.0."""
    rows, n_base = 40, 72
    full, b, stage = _batch(rows, n_base, 1, torch.float32, width)
    _, base_rows = _rows(stage)
    odd = base_rows[:6]
    stage.row_pos[odd[:3]] = width + 3  # past the width
    if width == 4:
        stage.row_pos[odd[3:]] = 2  # position 2 names no slot
    stage = with_tiles(stage)  # the tiles of the rows as they are now
    full[base_rows, 0] = -0.0
    offsets = torch.tensor([0, n_base], dtype=torch.int32, device=DEVICE)
    got = stacked.stacked_plain(full, n_base, R, b, stage, offsets)
    assert torch.equal(got[base_rows], full[base_rows, :n_base])
    assert torch.signbit(got[base_rows, 0]).all()
    _close(got, reference.stacked_plain(full, n_base, R, b, stage, offsets), torch.float32)
    residual = torch.zeros(rows, n_base, device=DEVICE)
    got = stacked.stacked_residual(full, n_base, R, b, stage, residual)
    assert torch.equal(got[base_rows], full[base_rows, :n_base])


@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_reads_each_segments_y_from_its_own_columns(dtype: torch.dtype) -> None:
    """``y_seg_cols`` (the probes' stacked mode): segment ``s`` reads ``y`` from column
    ``y_seg_cols[s]`` of a wider buffer; the same as a compact ``y`` for the plain expand."""
    from loraplane.worker.kernels import expand

    g = torch.Generator().manual_seed(3)
    rows, n, slots = 10, 40, 2
    y_wide = torch.randn(rows, 3 * R, generator=g).to(dtype).to(DEVICE)
    b = (torch.randn(slots, n, R, generator=g) * 0.5).to(dtype).to(DEVICE)
    indptr = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    seg_slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    cols = torch.tensor([2 * R, 0], dtype=torch.int32, device=DEVICE)
    ranks = torch.tensor([R, R], dtype=torch.int32, device=DEVICE)
    scal = torch.tensor([0.5, 2.0], device=DEVICE)
    offsets = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    base = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE)
    got = base.clone()
    expand.expand_segments(
        y_wide, b, got, indptr, seg_slots, ranks, scal, None, offsets, 6, y_seg_cols=cols
    )
    compact = torch.cat([y_wide[:4, 2 * R :], y_wide[4:, :R]])
    want = base.clone()
    reference.lora_expand(compact, b, indptr, seg_slots, ranks, scal, None, offsets, want, 6)
    _close(got, want, dtype)


def test_the_runtime_entry_gives_the_checked_wrappers_bits() -> None:
    """``runtime_stacked`` (what ``LoRABackend.stacked`` calls, no operand checks) returns
    what each checked wrapper returns, bit for bit, and names an unknown op."""
    rows, inter = 40, 40
    full, b, stage = _batch(rows, 2 * inter, 2, torch.float32, 4)
    want = stacked.stacked_silu_mul(full, 2 * inter, 2 * R, b, stage)
    assert torch.equal(stacked.runtime_stacked("silu_mul", full, 2 * inter, 2 * R, b, stage), want)
    full, b, stage = _batch(rows, 72, 1, torch.float32, 4)
    residual = torch.randn(rows, 72).to(DEVICE)
    want = stacked.stacked_residual(full, 72, R, b, stage, residual.clone())
    got = stacked.runtime_stacked("residual", full, 72, R, b, stage, residual)
    assert got.data_ptr() == residual.data_ptr() and torch.equal(got, want)
    full, b, stage = _batch(rows, 176, 3, torch.float32, 4)
    offsets = torch.tensor([0, 96, 136, 176], dtype=torch.int32, device=DEVICE)
    want = stacked.stacked_plain(full, 176, 3 * R, b, stage, offsets)
    assert torch.equal(stacked.runtime_stacked("plain", full, 176, 3 * R, b, stage, offsets), want)
    with pytest.raises(ValueError, match="op must be plain, residual or silu_mul"):
        stacked.runtime_stacked("gelu", full, 176, 3 * R, b, stage)


def test_a_stage_without_tiles_runs_by_rows_at_any_size() -> None:
    """A ``StageInfo`` built without tiles (a caller other than ``StaticLoRABatch``) gets the
    row-block programs however few rows it has: the same sums as the tiles, and tiles that
    name a wrong slot change the result (they are what the decode programs read)."""
    rows, n_base = 40, 72
    full, b, stage = _batch(rows, n_base, 1, torch.float32, 4)
    residual = torch.randn(rows, n_base, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    tiled = stacked.stacked_residual(full, n_base, R, b, stage, residual.clone())
    bare = dataclasses.replace(stage, tiles=None)
    untiled = stacked.stacked_residual(full, n_base, R, b, bare, residual.clone())
    _close(untiled, tiled, torch.float32)
    assert stage.tiles is not None
    wrong = stage.tiles.clone().view(-1, TILE_WORDS)
    wrong[0, TILE_ROWS + 1] = 1  # the first tile's rows read slot 1's B
    got = stacked.stacked_residual(
        full, n_base, R, b, dataclasses.replace(stage, tiles=wrong.view(-1)), residual.clone()
    )
    if rows < stacked.ROWS_KERNEL_MIN:  # (the by-rows run reads no tiles)
        assert not torch.equal(got, tiled)
