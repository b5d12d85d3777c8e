"""LoRA from a stacked base GEMM: the expand fused into what follows the projection.

A projection whose weight has the batch's adapters' A rows stacked under it
(``W_ext = [W; A_pos0; A_pos1; ...]``, see ``lora/stage.py``) gets the base output and every
staged adapter's shrink ``y`` from one cuBLAS GEMM: ``full = x W_ext^T`` is
``[T, N + width * nR]``, row ``t``'s ``y`` for stage position ``p`` in columns
``N + p * nR ..``. No shrink kernel runs. What is left is the expand, and it is fused with the
elementwise work that follows the projection, over **every** row (rows without an adapter
take the base value), so it replaces that work instead of adding a launch:

* ``stacked_plain``: ``out = base + s * y B`` into a new contiguous ``[T, N]`` (qkv);
* ``stacked_residual``: ``residual += base + s * y B`` in place (o_proj, down_proj: the
  residual add that follows them);
* ``stacked_silu_mul``: ``act = silu(g + s * y_g B_g) * (u + s * y_u B_u)`` (gate_up and
  the SwiGLU after it).

Rows are read in place, and each row's stage position (``StageInfo.row_pos``) picks its own
``y`` columns. A graph's staged batch (below ``ROWS_KERNEL_MIN`` rows: decode steps and
prompt-step graphs) comes with **tiles** (``StageInfo.tiles``, ``_triton_utils.stage_tiles``):
its rows grouped by stage position, 16 to a tile, each tile with its position, slot and
scaling, written on the host with the rest of the step's metadata. Program ``(tile,
columns)`` loads the tile in its first round trip
and its rows' base values, ``y`` and B in the second, and adds ``s_p * y_p B_p`` to the
tile's rows (a tile of rows with no adapter has slot -1: the base value, bit for bit). No
program is launched without rows but a padding tile's. It replaced a program per (row block,
position, columns), most of which held no row at their position and returned after a round
trip: at 48 rows over 16 positions on an H100 (``bench/probes/stacked_width.py``) the SwiGLU
takes 11.7 us against 13.7, the residual add 4.3 against 4.8; at 128 rows 13.7 and 4.9
against 20.8 and 7.3; at 816 rows (three prompt chunks and 48 decode rows over 16 positions)
44.3 and 11.2 against 53.5 and 15.3 for the row blocks below. Steps of ``ROWS_KERNEL_MIN``
rows or more, and a ``StageInfo`` without tiles, run the kernel's ``BY_ROWS`` variant: a
program per (row block, column block) loads its rows' base values with their positions,
finds which positions they hold (a bit each, one reduction over
the block), then takes each of those in turn, adding its term to its rows only
(``tl.where``: nothing from B reaches another row). Every sum is in fp32 and rounded once.
Measured on an H200 (``bench/probes/concurrency.py``, mode ``fused``,
``bench/results/2026-11-30-h200-s7/``): an 8-layer Llama-3-8B-shaped decode stack keeps
0.97-1.00 of its base step with 1 or 4 adapters at 16-128 rows, against 0.90-0.95 for shrink +
expand kernels. References:
``reference.stacked_plain`` / ``stacked_residual`` / ``stacked_silu_mul``.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MIN_DOT_BLOCK,
    ROWS_KERNEL_MIN,
    TILE_ROWS,
    TILE_WORDS,
    StageInfo,
    cdiv,
    check_dim,
    check_interpretable,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
    rank_block,
)
from loraplane.worker.kernels.expand import slice_bounds

__all__ = [
    "ROWS_KERNEL_MIN",
    "StageInfo",
    "runtime_stacked",
    "stacked_plain",
    "stacked_residual",
    "stacked_silu_mul",
]

_PLAIN, _RESIDUAL, _SILU_MUL = 0, 1, 2


# (block_s, block_n, num_warps) for every launch instead of the rule in ``_launch`` when set
# (bench/probes/stacked_tune.py).
STACKED_OVERRIDE: tuple[int, int, int] | None = None
# The tile programs' output columns: (the residual add and the plain sum, the SwiGLU). H100,
# 48 rows (bench/probes/stacked_width.py): the SwiGLU at 16 / 32 positions 11.7 / 18.7 us at
# 128 columns against 12.0 / 20.3 at 64; the residual add at 4 positions 3.4 at 64 against 3.6.
TILE_BLOCK_N = (64, 128)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def positions_held(row_pos, s_mask, first: tl.constexpr):
    """A bit ``p - first`` for each stage position ``p`` in ``first .. first + 63`` that a row
    of the block is at (int64; one reduction over the block)."""
    rel = row_pos - first
    held = s_mask & (rel >= 0) & (rel < 64)
    bits = tl.full(rel.shape, 1, tl.int64) << tl.where(held, rel, 0).to(tl.int64)
    return tl.reduce(tl.where(held, bits, 0), 0, _bit_or)


@triton.jit
def position_slot(pos_slots_ptr, pos_scal_ptr, p):
    """Stage position ``p``'s B (its index into the kernel's ``lora_b``, int64; -1: none) and
    scaling."""
    return tl.load(pos_slots_ptr + p).to(tl.int64), tl.load(pos_scal_ptr + p)


@triton.jit
def block_holds(bits, p: tl.constexpr):
    """Whether a row of the block is at position ``p``, from ``bits``: ``positions_held`` of
    the 64 positions from ``p - p % 64``."""
    return ((bits >> (p % 64)) & 1) != 0


@triton.jit
def stage_tile(tiles_ptr, tile_id, BLOCK_S: tl.constexpr, TILE_WORDS: tl.constexpr):
    """Tile ``tile_id`` of ``stage_tiles``: its rows (int64, 0 where none), which of them are
    rows, its stage position (0 for the rows with no adapter, whose slot is -1), its slot
    (which B it reads: the index into the kernel's ``lora_b``, int64) and its scaling. One
    round trip."""
    tile = tiles_ptr + tile_id * TILE_WORDS
    idx = tl.load(tile + tl.arange(0, BLOCK_S))
    p = tl.maximum(tl.load(tile + BLOCK_S), 0)
    slot = tl.load(tile + BLOCK_S + 1).to(tl.int64)
    scaling = tl.load(tile + BLOCK_S + 2).to(tl.float32, bitcast=True)
    s_mask = idx >= 0
    return tl.where(s_mask, idx, 0).to(tl.int64), s_mask, p, slot, scaling


@triton.jit
def slices_term(
    base,
    hit,
    y_row,
    y_mask,
    b_tile,
    b_rows,
    offs_n,
    n_mask,
    offs_r,
    scaling,
    slice_offsets_ptr,
    n_cols,
    rank_max,
    NUM_SLICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``base`` plus ``s * y_i B_i`` of each slice over its columns, on the rows ``hit``
    (``[BLOCK_S, 1]``) only: the other rows keep their bits."""
    for i in tl.static_range(NUM_SLICES):
        col_lo, col_hi = slice_bounds(slice_offsets_ptr, i, n_cols, NUM_SLICES)
        in_slice = n_mask & (offs_n >= col_lo) & (offs_n < col_hi)
        y = tl.load(y_row + i * rank_max + offs_r[None, :], mask=y_mask, other=0.0)
        b = tl.load(b_tile, mask=b_rows[:, None] & in_slice[None, :], other=0.0)
        term = scaling * tl.dot(y, b, input_precision=DOT_PRECISION)
        base = tl.where(hit, base + term, base)
    return base


@triton.jit
def position_term(
    base,
    up,
    hit,
    y_row,
    b_tile,
    slot,
    offs_n,
    n_mask,
    offs_r,
    r_mask,
    scaling,
    slice_offsets_ptr,
    n_cols,
    rank_max,
    b_stride_row,
    MODE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``(base, up)`` with one stage position's term added on the rows ``hit`` (``[BLOCK_S,
    1]``): ``y_row`` is the rows' first ``y`` column of the position, ``b_tile`` its slot's B
    at ``[BLOCK_R, BLOCK_N]``. MODE 2 (gate | up): gate's ``y`` in the position's first
    ``rank_max`` columns, then up's; otherwise ``up`` is returned as given."""
    y_mask = hit & r_mask[None, :]
    b_rows = r_mask & (slot >= 0)
    if MODE == 2:
        b_mask = b_rows[:, None] & n_mask[None, :]
        y_g = tl.load(y_row + offs_r[None, :], mask=y_mask, other=0.0)
        y_u = tl.load(y_row + rank_max + offs_r[None, :], mask=y_mask, other=0.0)
        b_g = tl.load(b_tile, mask=b_mask, other=0.0)
        b_u = tl.load(b_tile + n_cols * b_stride_row, mask=b_mask, other=0.0)
        t_g = scaling * tl.dot(y_g, b_g, input_precision=DOT_PRECISION)
        t_u = scaling * tl.dot(y_u, b_u, input_precision=DOT_PRECISION)
        base = tl.where(hit, base + t_g, base)  # the other rows keep their bits
        up = tl.where(hit, up + t_u, up)
    else:
        base = slices_term(
            base, hit, y_row, y_mask, b_tile, b_rows, offs_n, n_mask, offs_r, scaling,
            slice_offsets_ptr, n_cols, rank_max, NUM_SLICES, DOT_PRECISION,
        )  # fmt: skip
    return base, up


@triton.jit
def _stacked_lora_kernel(
    full_ptr,  # [T, N + width * nR]: the stacked GEMM's output (base | y of each position)
    b_ptr,  # [B, N, R]: the Bs that pos_slots / the tiles name (a worker's: one per position)
    res_ptr,  # [T, N]: residual (MODE _RESIDUAL; may be out)
    out_ptr,  # [T, N] (PLAIN, RESIDUAL) or [T, N / 2] (SILU_MUL)
    row_pos_ptr,  # int32 [T]: each row's stage position, -1 for none
    pos_slots_ptr,  # int32 [WIDTH]: which B (b_ptr's first index) a position reads, -1: none
    pos_scal_ptr,  # float32 [WIDTH]
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1] (MODE _PLAIN with NUM_SLICES > 1)
    n_rows,
    n_cols,  # output columns: N, or N / 2 for SILU_MUL
    n_base,  # N: where y starts in a row of full
    n_r,  # nR: y columns per stage position
    rank_max,  # the stage rank: y columns per slice (B's columns past it are not read)
    full_stride,
    res_stride,
    out_stride,
    b_stride_slot,
    b_stride_row,
    MODE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    WIDTH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BY_ROWS: tl.constexpr = False,  # steps of ROWS_KERNEL_MIN rows or more, or no tiles
    tiles_ptr=None,  # int32 [tiles * TILE_WORDS] (``stage_tiles``; not BY_ROWS)
    TILE_WORDS: tl.constexpr = 0,
):
    # Program (tile, 0, column block) writes the tile's rows, which are at one stage position
    # (or at none: slot -1, the base value). First round trip: the tile (its rows, position,
    # slot, scaling); second: the rows' base values (up, residual), their y and the
    # position's B.
    # BY_ROWS: program (row block, 0, column block) writes every row of its block: the base
    # values of all of them leave with the rows' positions, then, for each position its rows
    # hold (one or two in a prompt step, whose rows come grouped by adapter; one bitwise-or
    # reduction finds them, where a reduction per position cost rope_qkv 31 us against 25 at
    # 816 rows over 16 positions on an H100, bench/probes/stacked_width.py), that position's
    # slot, y and B, and its term goes to its rows only (tl.where). The grid has no position
    # axis, so a long step launches no program per (block, position) pair that holds no row.
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_cols
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank_max
    if BY_ROWS:
        offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        s_mask = offs_s < n_rows
        rows = offs_s.to(tl.int64)
        row_pos = tl.load(row_pos_ptr + offs_s, mask=s_mask, other=-1)
    else:
        rows, s_mask, p, slot, scaling = stage_tile(
            tiles_ptr, tl.program_id(0), BLOCK_S, TILE_WORDS
        )
        if tl.max(s_mask.to(tl.int32), axis=0) == 0:  # a padding tile
            return
    row_full = full_ptr + rows[:, None] * full_stride  # [BLOCK_S, 1]
    mask = s_mask[:, None] & n_mask[None, :]
    base = tl.load(row_full + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 2:  # gate in columns [0, n_cols), up in [n_cols, 2 n_cols)
        up = tl.load(row_full + n_cols + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        up = base  # (not read)
    if MODE == 1:
        res = tl.load(res_ptr + rows[:, None] * res_stride + offs_n[None, :], mask=mask)
    b_cols = offs_n[None, :].to(tl.int64) * b_stride_row + offs_r[:, None]  # [BLOCK_R, BLOCK_N]
    if BY_ROWS:
        for p in tl.static_range(WIDTH):
            if p % 64 == 0:  # the positions of the block's rows, 64 at a time
                bits = positions_held(row_pos, s_mask, p)
            if block_holds(bits, p):  # a row of the block is at p
                slot, scaling = position_slot(pos_slots_ptr, pos_scal_ptr, p)
                hit = (s_mask & (row_pos == p) & (slot >= 0))[:, None]
                base, up = position_term(
                    base, up, hit, row_full + n_base + p * n_r,
                    b_ptr + slot * b_stride_slot + b_cols, slot, offs_n, n_mask, offs_r,
                    r_mask, scaling, slice_offsets_ptr, n_cols, rank_max, b_stride_row, MODE,
                    NUM_SLICES, DOT_PRECISION,
                )  # fmt: skip
    else:
        hit = (s_mask & (slot >= 0))[:, None]
        base, up = position_term(
            base, up, hit, row_full + n_base + p * n_r,
            b_ptr + tl.maximum(slot, 0) * b_stride_slot + b_cols, slot, offs_n, n_mask,
            offs_r, r_mask, scaling, slice_offsets_ptr, n_cols, rank_max, b_stride_row, MODE,
            NUM_SLICES, DOT_PRECISION,
        )  # fmt: skip
    if MODE == 2:
        val = base / (1.0 + tl.exp(-base)) * up
    else:
        val = base
        if MODE == 1:
            val = res.to(tl.float32) + val
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, val.to(out_ptr.dtype.element_ty), mask=mask)


def check_stacked(
    fn: str,
    full: object,
    n_base: int,
    lora_b: object,
    stage: StageInfo,
    n_r: int,
    slices: int,
    name: str = "full",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes, dtypes and devices only: nothing here reads a device tensor back. ``name``:
    what the caller calls ``full`` (errors name it)."""
    f = check_tensor(fn, name, full, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, name, f)
    b = check_tensor(
        fn, "lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES, device=f.device, unit_last_stride=True
    )
    check_same_dtype(fn, "lora_b", b, name, f.dtype)
    check_dim(fn, "lora_b", b, 1, n_base, "one B row per base output column")
    if not 0 < stage.rank <= b.shape[2]:
        raise ValueError(
            f"{fn}: stage.rank must be in 1..{b.shape[2]} (lora_b's rank), got {stage.rank}"
        )
    if stage.width < 1:
        raise ValueError(f"{fn}: stage.width must be >= 1 (a staged GEMM), got {stage.width}")
    if n_r != slices * stage.rank:
        raise ValueError(
            f"{fn}: n_r must be {slices} slices x stage.rank {stage.rank} = "
            f"{slices * stage.rank} (y columns per stage position), got {n_r}"
        )
    want = n_base + stage.width * n_r
    if f.shape[1] < want:
        raise ValueError(
            f"{fn}: {name} must have at least {want} columns (N {n_base} + width "
            f"{stage.width} x nR {n_r}, the stacked GEMM's output; columns past them are not "
            f"read), got shape {tuple(f.shape)}"
        )
    for field, t, dtype, length, what in (
        ("row_pos", stage.row_pos, torch.int32, f.shape[0], f"one per row of {name}"),
        ("pos_slots", stage.pos_slots, torch.int32, stage.width, "one per stage position"),
        ("pos_scalings", stage.pos_scalings, torch.float32, stage.width, "one per stage position"),
    ):
        t = check_tensor(
            fn, f"stage.{field}", t, ndim=1, dtypes=(dtype,), device=f.device, contiguous=True
        )
        check_dim(fn, f"stage.{field}", t, 0, length, what)
    if stage.tiles is not None:
        tiles = check_tensor(
            fn, "stage.tiles", stage.tiles, ndim=1, dtypes=(torch.int32,), device=f.device,
            contiguous=True,
        )  # fmt: skip
        if tiles.shape[0] % TILE_WORDS:
            raise ValueError(
                f"{fn}: stage.tiles must hold whole tiles of {TILE_WORDS} int32 words "
                f"(stage_tiles), got {tiles.shape[0]}"
            )
    return f, b


def _check_offsets(
    fn: str, offsets: object, n_base: int, device: torch.device | None
) -> torch.Tensor:
    o = check_tensor(
        fn, "slice_offsets", offsets, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    if o.shape[0] < 2:
        raise ValueError(
            f"{fn}: slice_offsets must hold at least 2 bounds ([0, ..., {n_base}]), got {o.shape[0]}"
        )
    return o


def _launch(
    mode: int,
    full: torch.Tensor,
    b: torch.Tensor,
    res: torch.Tensor,
    out: torch.Tensor,
    stage: StageInfo,
    slice_offsets: torch.Tensor | None,
    n_cols: int,
    n_base: int,
    n_r: int,
) -> None:
    rows = full.shape[0]
    if rows == 0 or n_cols == 0:
        return
    # Tile programs take TILE_ROWS x TILE_BLOCK_N. Row-block programs take 16 x 128: at 816
    # rows over 16 positions, H100, bench/probes/stacked_width.py, the residual add 15.2 us
    # against 18.2 at 32 x 64, the SwiGLU 53.2 against 63.1 at 32 x 128 (base ops 8.5 and
    # 26.4 us; the tiles: 11.2 and 44.3).
    tiles = stage.tiles if rows < ROWS_KERNEL_MIN else None
    block_s, block_n = (16, 128) if tiles is None else (0, TILE_BLOCK_N[mode == _SILU_MUL])
    block_n = min(block_n, max(MIN_DOT_BLOCK, next_power_of_2(n_cols)))
    num_warps = 4
    if STACKED_OVERRIDE is not None:
        block_s, block_n, num_warps = STACKED_OVERRIDE
    if tiles is not None:  # (a tile's rows, whatever the override says)
        block_s, programs = TILE_ROWS, tiles.shape[0] // TILE_WORDS
    else:
        programs = cdiv(rows, block_s)
    grid = (programs, 1, cdiv(n_cols, block_n))
    _stacked_lora_kernel[grid](
        full,
        b,
        res,
        out,
        stage.row_pos,
        stage.pos_slots,
        stage.pos_scalings,
        slice_offsets if slice_offsets is not None else stage.pos_slots,
        rows,
        n_cols,
        n_base,
        n_r,
        stage.rank,
        full.stride(0),
        res.stride(0),
        out.stride(0),
        b.stride(0),
        b.stride(1),
        MODE=mode,
        NUM_SLICES=slice_offsets.shape[0] - 1 if slice_offsets is not None else 1,
        WIDTH=stage.width if tiles is None else 0,  # (tiles: one variant for every width)
        DOT_PRECISION=dot_precision(b.dtype),
        BLOCK_S=block_s,
        BLOCK_R=rank_block(stage.rank),
        BLOCK_N=block_n,
        BY_ROWS=tiles is None,
        tiles_ptr=tiles,
        TILE_WORDS=TILE_WORDS,
        num_warps=num_warps,
    )


def stacked_plain(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: StageInfo,
    slice_offsets: torch.Tensor,
) -> torch.Tensor:
    """``full[:, :N] + s * y B`` per row's stage position, as a new contiguous ``[T, N]``.

    ``slice_offsets`` int32 ``[n + 1]``: column bounds of the stacked slices (q | k | v);
    slice ``i`` reads ``y`` columns ``i * r ..`` of its position (``r = stage.rank``)."""
    fn = "stacked_plain"
    device = full.device if isinstance(full, torch.Tensor) else None
    offsets = _check_offsets(fn, slice_offsets, n_base, device)
    f, b = check_stacked(fn, full, n_base, lora_b, stage, n_r, offsets.shape[0] - 1)
    return runtime_stacked("plain", f, n_base, n_r, b, stage, offsets)


def stacked_residual(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: StageInfo,
    residual: torch.Tensor,
) -> torch.Tensor:
    """``residual += full[:, :N] + s * y B`` in place (one slice); returns ``residual``."""
    fn = "stacked_residual"
    f, b = check_stacked(fn, full, n_base, lora_b, stage, n_r, 1)
    res = check_tensor(
        fn, "residual", residual, ndim=2, dtypes=(f.dtype,), device=f.device, unit_last_stride=True
    )
    check_dim(fn, "residual", res, 0, f.shape[0], "one row per row of full")
    check_dim(fn, "residual", res, 1, n_base, "the projection's output width")
    return runtime_stacked("residual", f, n_base, n_r, b, stage, res)


def stacked_silu_mul(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: StageInfo,
) -> torch.Tensor:
    """``silu(g + s y_g B_g) * (u + s y_u B_u)`` as a new ``[T, N / 2]``: gate | up stacked,
    ``y`` of gate in columns ``0 .. r`` of a position, of up in ``r .. 2r`` (``r = stage.rank``)."""
    fn = "stacked_silu_mul"
    f, b = check_stacked(fn, full, n_base, lora_b, stage, n_r, 2)
    if n_base % 2:
        raise ValueError(f"{fn}: n_base must be 2 x intermediate (gate | up), got {n_base}")
    return runtime_stacked("silu_mul", f, n_base, n_r, b, stage)


def runtime_stacked(
    op: str,
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: StageInfo,
    *extra: torch.Tensor,
) -> torch.Tensor:
    """``stacked_<op>(full, n_base, n_r, lora_b, stage, *extra)`` without the operand checks,
    for the runtime (``LoRABackend.stacked``), which built every operand: ``full`` from its own
    stacked GEMM, ``lora_b`` and ``slice_offsets`` its slot buffers, ``stage`` a
    ``StaticLoRABatch``'s, the residual its model's. An eager staged step launches these once
    per projection, so their checks were host time on every step."""
    rows = full.shape[0]
    if op == "plain":
        out = torch.empty((rows, n_base), dtype=full.dtype, device=full.device)
        _launch(_PLAIN, full, lora_b, out, out, stage, extra[0], n_base, n_base, n_r)
        return out
    if op == "residual":
        res = extra[0]
        _launch(_RESIDUAL, full, lora_b, res, res, stage, None, n_base, n_base, n_r)
        return res
    if op == "silu_mul":
        inter = n_base // 2
        out = torch.empty((rows, inter), dtype=full.dtype, device=full.device)
        _launch(_SILU_MUL, full, lora_b, out, out, stage, None, inter, n_base, n_r)
        return out
    raise ValueError(f"runtime_stacked: op must be plain, residual or silu_mul, got {op!r}")
