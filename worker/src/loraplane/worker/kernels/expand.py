"""Segmented LoRA expand ``out += s * y B`` in Triton; reference: ``reference.lora_expand``.

Grid ``(segment blocks, segments, column blocks of N_total)``: one launch covers every slice
of a stacked projection (qkv with GQA widths, gate_up). A column block visits each slice whose
column range ``slice_offsets[i]:slice_offsets[i+1]`` it overlaps and multiplies that slice's
part of ``y`` with that slice's rows of B, so slice widths never have to be known on the host.
With segment tiles (``seg_tiles``) the first axis lists the ``(segment, block)`` pairs that
hold rows, as in the shrink; a program without rows loads no B.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    ExpandConfig,
    ShrinkConfig,
    TileMap,
    cdiv,
    check_dim,
    check_interpretable,
    check_max_seg_len,
    check_same_dtype,
    check_tensor,
    dot_precision,
    expand_config,
    launch_options,
    shrink_config,
)
from loraplane.worker.kernels.shrink import (
    check_segments,
    check_shrink_operands,
    shrink_segments,
    tile_map_args,
    tile_rows,
)

__all__ = [
    "PendingLoRA",
    "lora_apply",
    "lora_apply_shrink",
    "lora_expand",
    "runtime_apply_shrink",
]


@triton.jit
def slice_bounds(slice_offsets_ptr, i, n_cols, NUM_SLICES: tl.constexpr):
    """Columns ``[lo, hi)`` of slice ``i``: ``[0, n_cols)`` when there is one slice."""
    if NUM_SLICES == 1:
        return 0, n_cols
    return tl.load(slice_offsets_ptr + i), tl.load(slice_offsets_ptr + i + 1)


@triton.jit
def slice_term(
    y_ptrs,
    b_ptrs,
    offs_n,
    offs_r,
    y_mask,
    r_mask,
    y_load,
    r_load,
    col_lo,
    col_hi,
    DOT_PRECISION: tl.constexpr,
    RANK_ALIGNED: tl.constexpr,
):
    """``y_i B_i`` of one slice over a column block: ``y_ptrs [BLOCK_S, 1]`` (the slice's first
    y column per row), ``b_ptrs [BLOCK_R, BLOCK_N]``, B's columns masked to ``[col_lo, col_hi)``.

    The loads take the masks ``y_load``/``r_load``; with ``RANK_ALIGNED`` those cover the
    rank rounded up (see ``_lora_expand_kernel``) and what lies past ``y_mask``/``r_mask`` is
    zeroed after them (without it, callers pass the same masks twice)."""
    in_slice = (offs_n >= col_lo) & (offs_n < col_hi)
    y_i = tl.load(y_ptrs + offs_r[None, :], mask=y_load, other=0.0)  # [BLOCK_S, BLOCK_R]
    b_i = tl.load(b_ptrs, mask=r_load[:, None] & in_slice[None, :], other=0.0)
    if RANK_ALIGNED:
        y_i = tl.where(y_mask, y_i, 0.0)
        b_i = tl.where(r_mask[:, None], b_i, 0.0)
    return tl.dot(y_i, b_i, input_precision=DOT_PRECISION)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [positions, num_slices * R]
    b_ptr,  # [weight_slots, N_total, R]
    out_ptr,  # [T, N_total]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]: index into the weight buffer's first axis
    slot_ranks_ptr,  # int32 [num_slots], or [S] when RANK_BY_SEG
    slot_scalings_ptr,  # float32 [num_slots], or [S] when RANK_BY_SEG
    row_order_ptr,  # int64 [positions] (read only when HAS_ROW_ORDER)
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1]
    tile_seg_ptr,  # int32 [tiles] (read only when USE_TILE_MAP; so are the next three)
    tile_len_ptr,  # int32 [tiles]
    tile_rows_ptr,  # int64 [tiles * BLOCK_S]
    tile_rank_ptr,  # int32 [tiles] (read only when TILE_RANK)
    y_seg_col_ptr,  # int32 [S]: first column of each segment's y (read only when Y_SEG_COL)
    seg_tiles_ptr,  # int32 [2, programs]: each program's segment, then block (SEG_TILES)
    n_total,
    rank_max,
    y_stride_row,
    out_stride_row,
    b_stride_slot,
    b_stride_row,
    weights_per_slot,  # rank/scaling index = seg_slot // weights_per_slot (MoE: experts)
    NUM_SLICES: tl.constexpr,
    HAS_ROW_ORDER: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,  # programs over a TileMap (y indexed by row then)
    Y_BY_ROW: tl.constexpr,  # y indexed by row (MoE: pair) instead of segment position
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK_BY_SEG: tl.constexpr = False,  # rank/scaling given per segment: no load waits on the slot
    Y_SEG_COL: tl.constexpr = False,  # y columns start per segment (y from a stacked base GEMM)
    RANK_ALIGN: tl.constexpr = 1,  # loads round the rank up to this (rank_max a multiple of it)
    TILE_RANK: tl.constexpr = False,  # the tile map gives each tile's rank
    SEG_TILES: tl.constexpr = False,  # programs over listed (segment, block) pairs
):
    # Every load that only needs the program's segment is issued first, and nothing returns
    # on a loaded value after it, so the y, B and out loads leave together once the segment's
    # bounds arrive (two round trips to memory, not five). A program past its segment's end,
    # or on a rank-0 slot, masks everything off instead. The one branch is per slice of a
    # stacked projection, on slice bounds that arrive with the segment's.
    # With a tile map, the tile's slot, rows and rank arrive in the first round trip and the
    # y, B and out loads leave in the second (tile_rows).
    if USE_TILE_MAP:
        seg, weight_slot, rank, rows, s_mask = tile_rows(
            tile_seg_ptr,
            tile_len_ptr,
            tile_rows_ptr,
            tile_rank_ptr,
            slot_ranks_ptr,
            rank_max,
            weights_per_slot,
            BLOCK_S,
            TILE_RANK,
        )
        if seg < 0:  # tile map padding
            return
        scaling = tl.load(slot_scalings_ptr + weight_slot // weights_per_slot)
        y_rows = rows
        y_base = y_ptr
    else:
        if SEG_TILES:  # (one round trip more: the pair, then the segment)
            seg = tl.load(seg_tiles_ptr + tl.program_id(0))
            blk = tl.load(seg_tiles_ptr + tl.num_programs(0) + tl.program_id(0))
        else:
            blk = tl.program_id(0)
            seg = tl.program_id(1)
        seg_start = tl.load(seg_indptr_ptr + seg)
        seg_end = tl.load(seg_indptr_ptr + seg + 1)
        weight_slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        if RANK_BY_SEG:
            rank = tl.minimum(tl.load(slot_ranks_ptr + seg), rank_max)
            scaling = tl.load(slot_scalings_ptr + seg)
        else:
            slot = weight_slot // weights_per_slot
            rank = tl.minimum(tl.load(slot_ranks_ptr + slot), rank_max)
            scaling = tl.load(slot_scalings_ptr + slot)
        # a program past its segment's rows reads no B: rank 0 masks every load
        rank = tl.where(seg_start + blk * BLOCK_S < seg_end, rank, 0)
        y_base = y_ptr
        if Y_SEG_COL:
            y_base = y_ptr + tl.load(y_seg_col_ptr + seg)

        offs_s = seg_start + blk * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] segment positions
        s_mask = (offs_s < seg_end) & (rank > 0)
        if HAS_ROW_ORDER:
            rows = tl.load(row_order_ptr + offs_s, mask=s_mask, other=0)
        else:
            rows = offs_s.to(tl.int64)
        if Y_BY_ROW:
            y_rows = rows
        else:
            y_rows = offs_s.to(tl.int64)

    n0 = tl.program_id(2) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_mask = offs_r < rank  # columns of B at or beyond the rank never reach the sum
    if RANK_ALIGN > 1:
        # The loads cover the rank rounded up to RANK_ALIGN columns (inside the row: rank_max
        # is a multiple of it), a mask constant over RANK_ALIGN-wide groups, so they move
        # whole vectors; the extra columns are zeroed before the dot. Masked at the loaded
        # rank itself, which may end at any column, every B and y value is its own load (ncu
        # on an H200: the MoE expand then L1/TEX-bound at 91%, DRAM at 35%).
        r_load = (offs_r // RANK_ALIGN) < (rank + RANK_ALIGN - 1) // RANK_ALIGN
    else:
        r_load = r_mask
    b_base = b_ptr + weight_slot * b_stride_slot

    out_ptrs = out_ptr + rows[:, None] * out_stride_row + offs_n[None, :]  # [BLOCK_S, BLOCK_N]
    out_mask = s_mask[:, None] & (offs_n < n_total)[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0)

    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)  # [BLOCK_S, BLOCK_N]
    b_ptrs = b_base + offs_n[None, :].to(tl.int64) * b_stride_row + offs_r[:, None]
    y_ptrs = y_base + y_rows[:, None] * y_stride_row  # [BLOCK_S, 1]
    y_mask = s_mask[:, None] & r_mask[None, :]
    y_load = s_mask[:, None] & r_load[None, :]
    for i in tl.static_range(NUM_SLICES):
        # a column block may straddle slices: each slice's B columns are masked to its range
        col_lo, col_hi = slice_bounds(slice_offsets_ptr, i, n_total, NUM_SLICES)
        overlaps = True
        if NUM_SLICES > 1:  # branch past the slices the block misses: no loads, no dot
            overlaps = (col_lo < n0 + BLOCK_N) & (col_hi > n0)
        if overlaps:
            y_i = y_ptrs + i * rank_max
            acc += slice_term(
                y_i,
                b_ptrs,
                offs_n,
                offs_r,
                y_mask,
                r_mask,
                y_load,
                r_load,
                col_lo,
                col_hi,
                DOT_PRECISION,
                RANK_ALIGN > 1,
            )

    tl.store(
        out_ptrs, (base.to(tl.float32) + scaling * acc).to(out_ptr.dtype.element_ty), mask=out_mask
    )


# Rank columns an expand load rounds up to (bench/probes/switches.py ralign=1 turns it off).
RANK_ALIGN = 8


def rank_align(rank_max: int) -> int:
    """``RANK_ALIGN`` when B's rows (``rank_max`` values) hold whole groups of it, else 1."""
    return RANK_ALIGN if RANK_ALIGN > 1 and rank_max % RANK_ALIGN == 0 else 1


def launch_expand(
    y: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    config: ExpandConfig,
    grid_blocks: int,
    grid_segments: int,
    *,
    tile_map: TileMap | None = None,
    weights_per_slot: int = 1,
    y_by_row: bool = False,
    rank_by_seg: bool = False,
    y_seg_cols: torch.Tensor | None = None,
    seg_tiles: torch.Tensor | None = None,
) -> None:
    """Launch without checks (callers validated). ``weights [weight_slots, N_total, R]``,
    ``y [positions, slices*R]`` (with ``y_seg_cols``: segment ``s`` reads its columns from
    ``y_seg_cols[s]`` on). ``seg_tiles``: the programs' (segment, block) pairs in place of
    the ``grid_blocks x grid_segments`` grid (``launch_shrink``)."""
    n_total = weights.shape[1]
    if grid_blocks == 0 or grid_segments == 0 or n_total == 0:
        return
    rows = (grid_blocks, grid_segments) if seg_tiles is None else (seg_tiles.shape[1], 1)
    grid = (*rows, cdiv(n_total, config.block_n))
    _lora_expand_kernel[grid](
        y,
        weights,
        out,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order if row_order is not None else seg_indptr,
        slice_offsets,
        *tile_map_args(tile_map, seg_indptr),
        y_seg_cols if y_seg_cols is not None else seg_indptr,
        seg_tiles if seg_tiles is not None else seg_indptr,
        n_total,
        weights.shape[2],
        y.stride(0),
        out.stride(0),
        weights.stride(0),
        weights.stride(1),
        weights_per_slot,
        NUM_SLICES=slice_offsets.shape[0] - 1,
        HAS_ROW_ORDER=row_order is not None,
        USE_TILE_MAP=tile_map is not None,
        Y_BY_ROW=y_by_row,
        DOT_PRECISION=dot_precision(weights.dtype),
        BLOCK_S=config.block_s,
        BLOCK_R=config.block_r,
        BLOCK_N=config.block_n,
        RANK_BY_SEG=rank_by_seg,
        Y_SEG_COL=y_seg_cols is not None,
        RANK_ALIGN=rank_align(weights.shape[2]),
        TILE_RANK=tile_map is not None and tile_map.ranks is not None,
        SEG_TILES=seg_tiles is not None,
        **launch_options(config.num_warps),
    )


def check_expand_operands(
    fn: str,
    y_arg: object,
    lora_b: object,
    slot_scalings: object,
    slice_offsets: object,
    out: object,
    *,
    weight_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shared by ``lora_expand`` and ``moe_lora_expand``; returns the typed tensors."""
    y = check_tensor(fn, "y", y_arg, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "y", y)
    b, offsets = check_expand_weights(
        fn, lora_b, slot_scalings, slice_offsets, y.device, y.dtype, "y", weight_ndim=weight_ndim
    )
    o = check_out(fn, out, b, y.device)
    num_slices = offsets.shape[0] - 1
    rank_max = b.shape[-1]
    check_dim(
        fn, "y", y, 1, num_slices * rank_max, f"num_slices * max_rank = {num_slices} * {rank_max}"
    )
    return y, b, o, offsets


def check_expand_weights(
    fn: str,
    lora_b: object,
    slot_scalings: object,
    slice_offsets: object,
    device: torch.device,
    dtype: torch.dtype,
    dtype_of: str,
    *,
    weight_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks of B, the scalings and the slice offsets; returns (B, offsets) typed."""
    b = check_tensor(
        fn, "lora_b", lora_b, ndim=weight_ndim, dtypes=FLOAT_DTYPES, device=device, contiguous=True
    )
    check_same_dtype(fn, "lora_b", b, dtype_of, dtype)
    offsets = check_tensor(
        fn,
        "slice_offsets",
        slice_offsets,
        ndim=1,
        dtypes=(torch.int32,),
        device=device,
        contiguous=True,
    )
    if offsets.shape[0] < 2:
        raise ValueError(
            f"{fn}: slice_offsets must have num_slices + 1 >= 2 entries, got shape {tuple(offsets.shape)}"
        )
    scalings = check_tensor(
        fn,
        "slot_scalings",
        slot_scalings,
        ndim=1,
        dtypes=(torch.float32,),
        device=device,
        contiguous=True,
    )
    check_dim(
        fn, "slot_scalings", scalings, 0, b.shape[0], "one scaling per slot of the weight buffer"
    )
    return b, offsets


def check_out(fn: str, out: object, lora_b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``out [rows, N_total]``: floating, on ``device``, unit column stride, N_total of B."""
    o = check_tensor(
        fn, "out", out, ndim=2, dtypes=FLOAT_DTYPES, device=device, unit_last_stride=True
    )
    check_dim(fn, "out", o, 1, lora_b.shape[-2], "N_total, lora_b.shape[-2]")
    return o


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int,
) -> None:
    """Triton ``reference.lora_expand``: in place into ``out [T, N_total]``, one launch for all slices."""
    fn = "lora_expand"
    y, b, out, offsets = check_expand_operands(
        fn, y, lora_b, slot_scalings, slice_offsets, out, weight_ndim=3
    )
    check_segments(fn, y.device, seg_indptr, seg_slots, slot_ranks, row_order, b.shape[0])
    positions = row_order.shape[0] if row_order is not None else out.shape[0]
    check_dim(
        fn, "y", y, 0, positions, "one row per segment position: len(row_order), or out.shape[0]"
    )
    max_seg_len = check_max_seg_len(fn, max_seg_len)
    expand_segments(
        y, b, out, seg_indptr, seg_slots, slot_ranks, slot_scalings, row_order, offsets, max_seg_len
    )


def expand_segments(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    max_seg_len: int,
    *,
    rank_by_seg: bool = False,
    y_seg_cols: torch.Tensor | None = None,
    seg_tiles: torch.Tensor | None = None,
) -> None:
    """``launch_expand`` over the ``(segment blocks, segments, column blocks)`` grid, or over
    ``seg_tiles``' pairs (checked args)."""
    config = expand_config(max_seg_len, lora_b.shape[2], lora_b.shape[1])
    launch_expand(
        y,
        lora_b,
        out,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order,
        slice_offsets,
        config,
        grid_blocks=cdiv(max_seg_len, config.block_s),
        grid_segments=seg_slots.shape[0],
        rank_by_seg=rank_by_seg,
        y_seg_cols=y_seg_cols,
        seg_tiles=seg_tiles,
    )


def lora_apply(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int,
    *,
    seg_ranks: torch.Tensor | None = None,
    seg_scalings: torch.Tensor | None = None,
) -> None:
    """``lora_expand(lora_shrink(x, lora_a, ...), lora_b, ..., out)`` in two launches, no more.

    The same result, in place into ``out``; what it saves is the work between the two: the
    shrink's output is not zeroed first, and when K is split (decode) the shrink's last
    program of each tile sums the fp32 partials, not a ``sum`` kernel and a cast. ``num_slices`` is
    ``len(slice_offsets) - 1``. ``seg_ranks``/``seg_scalings`` (int32/float32 ``[S]``, both or
    neither): ``slot_ranks[seg_slots]`` and ``slot_scalings[seg_slots]`` gathered ahead (the
    batch info does it once per forward), so no load in the kernels waits on the slot's.
    """
    lora_apply_shrink(
        x,
        lora_a,
        lora_b,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order,
        slice_offsets,
        max_seg_len,
        seg_ranks=seg_ranks,
        seg_scalings=seg_scalings,
        out=out,
    ).expand_into(out)


@dataclass(slots=True)
class PendingLoRA:
    """The shrink of a ``lora_apply`` has been launched; ``expand_into`` launches the expand.

    Between the two, the caller may run other work on the stream of ``expand_into`` (the base
    projection): the shrink reads only ``x``. Its result lives in ``y`` until the expand.
    """

    fn: str
    rows: int
    y: torch.Tensor
    lora_b: torch.Tensor
    seg_indptr: torch.Tensor
    seg_slots: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    row_order: torch.Tensor | None
    slice_offsets: torch.Tensor
    max_seg_len: int
    rank_by_seg: bool
    checked_out: torch.Tensor | None = None
    y_seg_cols: torch.Tensor | None = None
    seg_tiles: torch.Tensor | None = None

    def expand_into(self, out: torch.Tensor) -> None:
        """``out [rows, N_total] += s * y B`` per segment (checks ``out``, then one launch)."""
        if out is not self.checked_out:
            check_apply_out(self.fn, out, self.lora_b, self.rows, self.y.device)
        expand_segments(
            self.y,
            self.lora_b,
            out,
            self.seg_indptr,
            self.seg_slots,
            self.ranks,
            self.scalings,
            self.row_order,
            self.slice_offsets,
            self.max_seg_len,
            rank_by_seg=self.rank_by_seg,
            y_seg_cols=self.y_seg_cols,
            seg_tiles=self.seg_tiles,
        )


def lora_apply_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    max_seg_len: int,
    *,
    seg_ranks: torch.Tensor | None = None,
    seg_scalings: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_split_k: int | None = None,
) -> PendingLoRA:
    """The first half of ``lora_apply``: its checks (``out``'s too when given), then the shrink.

    Runs on the current stream; ``PendingLoRA.expand_into(out)`` finishes on its own current
    stream, which must be ordered after this one (the runtime overlaps the base projection with
    the shrink on a side stream this way, see ``LoRABackend.apply_around``). ``max_split_k``
    caps the shrink's K splits (default: ``split_k_for``'s rule).
    """
    fn = "lora_apply"
    b, offsets = check_expand_weights(
        fn, lora_b, slot_scalings, slice_offsets, x.device, x.dtype, "x", weight_ndim=3
    )
    num_slices = offsets.shape[0] - 1
    positions, shrink_cfg = check_shrink_operands(
        fn, x, lora_a, seg_indptr, seg_slots, slot_ranks, row_order, num_slices, max_seg_len
    )
    check_dim(fn, "lora_b", b, 2, lora_a.shape[1] // num_slices, "the max rank of lora_a per slice")
    check_dim(fn, "lora_b", b, 0, lora_a.shape[0], "one weight slot per slot of lora_a")
    if (seg_ranks is None) != (seg_scalings is None):
        raise ValueError(f"{fn}: give seg_ranks and seg_scalings together, or neither")
    if seg_ranks is not None and seg_scalings is not None:
        num_segs = seg_slots.shape[0]
        for name, value, dtype in (
            ("seg_ranks", seg_ranks, torch.int32),
            ("seg_scalings", seg_scalings, torch.float32),
        ):
            t = check_tensor(
                fn, name, value, ndim=1, dtypes=(dtype,), device=x.device, contiguous=True
            )
            check_dim(fn, name, t, 0, num_segs, "one per segment: len(seg_slots)")
        slot_ranks, slot_scalings = seg_ranks, seg_scalings
    if out is not None:
        check_apply_out(fn, out, b, x.shape[0], x.device)
    return _start_apply(
        fn,
        x,
        lora_a,
        b,
        positions,
        shrink_cfg,
        seg_indptr,
        seg_slots,
        slot_ranks,
        slot_scalings,
        row_order,
        offsets,
        max_seg_len,
        seg_ranks is not None,
        out,
        max_split_k,
    )


def runtime_apply_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    seg_ranks: torch.Tensor,
    seg_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    max_seg_len: int,
    out: torch.Tensor | None = None,
    max_split_k: int | None = None,
    seg_tiles: torch.Tensor | None = None,
) -> PendingLoRA:
    """``lora_apply_shrink`` without its operand checks, for the runtime (``LoRABackend``).
    ``seg_tiles``: the batch's (segment, block) pairs (``LoRABatchInfo.seg_tiles``), which
    both launches then run over.

    Every operand comes from the runtime's own buffers: a wrapper's slot weights and
    ``slice_offsets``, which it built and checked once, and a ``LoRABatchInfo``, whose
    ``seg_ranks``/``seg_scalings`` it always fills; they checked per launch were about a third
    of an eager projection's host time in our own code (``bench/probes/host_overhead.py``).
    What the runtime does not build itself is ``x`` (and ``out``): only its layout is checked,
    as the kernels index its rows by stride and assume unit column stride."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"runtime_apply_shrink: x must be 2-D with unit column stride, got shape "
            f"{tuple(x.shape)} and strides {tuple(x.stride())}"
        )
    num_slices = slice_offsets.shape[0] - 1
    positions = row_order.shape[0] if row_order is not None else x.shape[0]
    config = shrink_config(max_seg_len, lora_a.shape[1] // num_slices, x.shape[1], x.element_size())
    return _start_apply(
        "lora_apply",
        x,
        lora_a,
        lora_b,
        positions,
        config,
        seg_indptr,
        seg_slots,
        seg_ranks,
        seg_scalings,
        row_order,
        slice_offsets,
        max_seg_len,
        True,
        out,
        max_split_k,
        seg_tiles,
    )


def _start_apply(
    fn: str,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    positions: int,
    shrink_cfg: ShrinkConfig,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    max_seg_len: int,
    by_seg: bool,
    out: torch.Tensor | None,
    max_split_k: int | None,
    seg_tiles: torch.Tensor | None = None,
) -> PendingLoRA:
    """The shrink launched over checked operands; the expand pending (``expand_into``).
    ``ranks``/``scalings`` are per segment when ``by_seg``, else per slot."""
    num_slices = slice_offsets.shape[0] - 1
    y = shrink_segments(
        x,
        lora_a,
        positions,
        seg_indptr,
        seg_slots,
        ranks,
        row_order,
        num_slices,
        shrink_cfg,
        max_seg_len,
        zeroed=False,
        rank_by_seg=by_seg,
        split_cap=max_split_k,
        seg_tiles=seg_tiles,
    )
    return PendingLoRA(
        fn=fn,
        rows=x.shape[0],
        y=y,
        lora_b=lora_b,
        seg_indptr=seg_indptr,
        seg_slots=seg_slots,
        ranks=ranks,
        scalings=scalings,
        row_order=row_order,
        slice_offsets=slice_offsets,
        max_seg_len=max_seg_len,
        rank_by_seg=by_seg,
        checked_out=out,
        seg_tiles=seg_tiles,
    )


def check_apply_out(
    fn: str, out: object, lora_b: torch.Tensor, rows: int, device: torch.device
) -> None:
    o = check_out(fn, out, lora_b, device)
    check_dim(fn, "out", o, 0, rows, "one row per row of x")
