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

Each program takes a block of consecutive rows in place and reads every row's stage position
(``StageInfo.row_pos``); for each position ``p`` of the stacked GEMM that a row of the block
uses, it loads that position's ``y`` columns (zero for the block's other rows) and its
adapter's B, and adds ``s_p * y B`` to those rows only (``tl.where``: a NaN in one adapter's
B cannot reach another's rows, nor rows with no adapter). No load waits on a segment's
bounds or a gathered row index: the base value, the residual and the rows' positions leave
together, then ``y`` and B, so an epilogue costs two round trips to memory where the
segment-by-segment version (session 7 to 14) cost three or four. Every sum is in fp32 and
rounded once. Measured on an H200 (``bench/probes/concurrency.py``, mode ``fused``, session
7): an 8-layer Llama-3-8B-shaped decode stack keeps 0.97-1.00 of its base step with 1 or 4
adapters at 16-128 rows, against 0.90-0.95 for shrink + expand kernels. References:
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

__all__ = ["StageInfo", "stacked_plain", "stacked_residual", "stacked_silu_mul"]

_PLAIN, _RESIDUAL, _SILU_MUL = 0, 1, 2


# (block_s, block_n, num_warps) for every launch instead of the rule in ``_launch`` when set
# (bench/probes/stacked_tune.py).
STACKED_OVERRIDE: tuple[int, int, int] | None = None


@triton.jit
def _y_at(y_ptrs, s_mask, r_mask, p, n_r):
    """Stage position ``p``'s y ``[BLOCK_S, BLOCK_R]`` for every row of the block."""
    return tl.load(y_ptrs + p * n_r, mask=s_mask[:, None] & r_mask[None, :], other=0.0)


@triton.jit
def _b_at(b_ptrs, slot, used, r_mask, n_valid, b_stride_slot):
    """``slot``'s B tile ``[BLOCK_R, BLOCK_N]``; nothing is read when no row uses it."""
    mask = (r_mask & (slot >= 0) & used)[:, None] & n_valid[None, :]
    return tl.load(b_ptrs + slot.to(tl.int64) * b_stride_slot, mask=mask, other=0.0)


@triton.jit
def _add_at(acc, hit, scaling, y, b, DOT_PRECISION: tl.constexpr):
    """``acc + s y B`` on the rows ``hit`` (the others keep ``acc``, whatever B holds)."""
    term = scaling * tl.dot(y, b, input_precision=DOT_PRECISION)
    return acc + tl.where(hit[:, None], term, 0.0)


@triton.jit
def stage_terms(
    acc,  # [BLOCK_S, BLOCK_N] fp32
    acc2,  # the second tile's (TWO), else anything: returned as given
    y_ptrs,  # [BLOCK_S, BLOCK_R]: each row's y of stage position 0 (this slice's columns)
    y2_ptrs,  # the second tile's y (TWO)
    b_ptrs,  # [BLOCK_R, BLOCK_N]: B of slot 0 over the tile's columns
    b2_ptrs,  # the second tile's B (TWO)
    row_pos,  # [BLOCK_S] int32: each row's stage position, -1 for none
    s_mask,
    r_mask,
    n_valid,  # [BLOCK_N]: the B rows (output columns) to read
    pos_slots_ptr,
    pos_scal_ptr,
    n_r,
    b_stride_slot,
    P0: tl.constexpr,
    WIDTH: tl.constexpr,
    TWO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``acc`` (and ``acc2``) plus each row's ``s y B`` over stage positions ``P0 .. P0 + 3``
    (those below ``WIDTH``); a row takes only its own position's term.

    No load here waits on a dot, and only B waits on the rows' positions: every position's y,
    slot and scaling leave first, then the B tiles of the positions some row of the block
    reads, then the dots. (Branching per position, ``if any row reads p``, held each
    position's loads behind the previous position's dot: 4 adapters in 16 rows ran 1.3-1.6x
    slower on an H200.) Written out for four positions, as Triton keeps no list of tiles."""
    ya0 = _y_at(y_ptrs, s_mask, r_mask, P0, n_r)
    slot0 = tl.load(pos_slots_ptr + P0)
    sc0 = tl.load(pos_scal_ptr + P0)
    if TWO:
        yb0 = _y_at(y2_ptrs, s_mask, r_mask, P0, n_r)
    if P0 + 1 < WIDTH:
        ya1 = _y_at(y_ptrs, s_mask, r_mask, P0 + 1, n_r)
        slot1 = tl.load(pos_slots_ptr + P0 + 1)
        sc1 = tl.load(pos_scal_ptr + P0 + 1)
        if TWO:
            yb1 = _y_at(y2_ptrs, s_mask, r_mask, P0 + 1, n_r)
    if P0 + 2 < WIDTH:
        ya2 = _y_at(y_ptrs, s_mask, r_mask, P0 + 2, n_r)
        slot2 = tl.load(pos_slots_ptr + P0 + 2)
        sc2 = tl.load(pos_scal_ptr + P0 + 2)
        if TWO:
            yb2 = _y_at(y2_ptrs, s_mask, r_mask, P0 + 2, n_r)
    if P0 + 3 < WIDTH:
        ya3 = _y_at(y_ptrs, s_mask, r_mask, P0 + 3, n_r)
        slot3 = tl.load(pos_slots_ptr + P0 + 3)
        sc3 = tl.load(pos_scal_ptr + P0 + 3)
        if TWO:
            yb3 = _y_at(y2_ptrs, s_mask, r_mask, P0 + 3, n_r)

    hit0 = s_mask & (row_pos == P0)
    used0 = tl.max(hit0.to(tl.int32), axis=0) > 0
    ba0 = _b_at(b_ptrs, slot0, used0, r_mask, n_valid, b_stride_slot)
    if TWO:
        bb0 = _b_at(b2_ptrs, slot0, used0, r_mask, n_valid, b_stride_slot)
    if P0 + 1 < WIDTH:
        hit1 = s_mask & (row_pos == P0 + 1)
        used1 = tl.max(hit1.to(tl.int32), axis=0) > 0
        ba1 = _b_at(b_ptrs, slot1, used1, r_mask, n_valid, b_stride_slot)
        if TWO:
            bb1 = _b_at(b2_ptrs, slot1, used1, r_mask, n_valid, b_stride_slot)
    if P0 + 2 < WIDTH:
        hit2 = s_mask & (row_pos == P0 + 2)
        used2 = tl.max(hit2.to(tl.int32), axis=0) > 0
        ba2 = _b_at(b_ptrs, slot2, used2, r_mask, n_valid, b_stride_slot)
        if TWO:
            bb2 = _b_at(b2_ptrs, slot2, used2, r_mask, n_valid, b_stride_slot)
    if P0 + 3 < WIDTH:
        hit3 = s_mask & (row_pos == P0 + 3)
        used3 = tl.max(hit3.to(tl.int32), axis=0) > 0
        ba3 = _b_at(b_ptrs, slot3, used3, r_mask, n_valid, b_stride_slot)
        if TWO:
            bb3 = _b_at(b2_ptrs, slot3, used3, r_mask, n_valid, b_stride_slot)

    acc = _add_at(acc, hit0, sc0, ya0, ba0, DOT_PRECISION)
    if TWO:
        acc2 = _add_at(acc2, hit0, sc0, yb0, bb0, DOT_PRECISION)
    if P0 + 1 < WIDTH:
        acc = _add_at(acc, hit1, sc1, ya1, ba1, DOT_PRECISION)
        if TWO:
            acc2 = _add_at(acc2, hit1, sc1, yb1, bb1, DOT_PRECISION)
    if P0 + 2 < WIDTH:
        acc = _add_at(acc, hit2, sc2, ya2, ba2, DOT_PRECISION)
        if TWO:
            acc2 = _add_at(acc2, hit2, sc2, yb2, bb2, DOT_PRECISION)
    if P0 + 3 < WIDTH:
        acc = _add_at(acc, hit3, sc3, ya3, ba3, DOT_PRECISION)
        if TWO:
            acc2 = _add_at(acc2, hit3, sc3, yb3, bb3, DOT_PRECISION)
    return acc, acc2


@triton.jit
def _stacked_lora_kernel(
    full_ptr,  # [T, N + width * nR]: the stacked GEMM's output (base | y of each position)
    b_ptr,  # [slots, N, R]
    res_ptr,  # [T, N]: residual (MODE _RESIDUAL; may be out)
    out_ptr,  # [T, N] (PLAIN, RESIDUAL) or [T, N / 2] (SILU_MUL)
    row_pos_ptr,  # int32 [T]: each row's stage position, -1 for none
    pos_slots_ptr,  # int32 [WIDTH]: the slot whose B a position reads, -1 for none
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
):
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = offs_s < n_rows
    rows = offs_s.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < n_cols
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank_max
    mask = s_mask[:, None] & n_mask[None, :]
    row_full = full_ptr + rows[:, None] * full_stride  # [BLOCK_S, 1]
    b_cols = offs_n[None, :].to(tl.int64) * b_stride_row + offs_r[:, None]  # [BLOCK_R, BLOCK_N]

    # Everything that needs no loaded value leaves first: the rows' positions, the base
    # (and up, and the residual), then y; B once the positions are in (``stage_terms``).
    row_pos = tl.load(row_pos_ptr + offs_s, mask=s_mask, other=-1)
    base = tl.load(row_full + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    y_ptrs = row_full + n_base + offs_r[None, :]  # [BLOCK_S, BLOCK_R]: position 0's y
    b_ptrs = b_ptr + b_cols
    if MODE == 2:  # gate | up: gate in columns [0, n_cols), up in [n_cols, 2 n_cols)
        up = tl.load(row_full + n_cols + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        for p0 in tl.static_range(0, WIDTH, 4):
            base, up = stage_terms(
                base,
                up,
                y_ptrs,
                y_ptrs + rank_max,
                b_ptrs,
                b_ptrs + n_cols * b_stride_row,
                row_pos,
                s_mask,
                r_mask,
                n_mask,
                pos_slots_ptr,
                pos_scal_ptr,
                n_r,
                b_stride_slot,
                p0,
                WIDTH,
                True,
                DOT_PRECISION,
            )
        val = base / (1.0 + tl.exp(-base)) * up
    else:
        if MODE == 1:
            res = tl.load(res_ptr + rows[:, None] * res_stride + offs_n[None, :], mask=mask)
        for i in tl.static_range(NUM_SLICES):
            col_lo, col_hi = slice_bounds(slice_offsets_ptr, i, n_cols, NUM_SLICES)
            in_slice = n_mask & (offs_n >= col_lo) & (offs_n < col_hi)
            for p0 in tl.static_range(0, WIDTH, 4):
                base, _ = stage_terms(
                    base,
                    base,
                    y_ptrs + i * rank_max,
                    y_ptrs,
                    b_ptrs,
                    b_ptrs,
                    row_pos,
                    s_mask,
                    r_mask,
                    in_slice,
                    pos_slots_ptr,
                    pos_scal_ptr,
                    n_r,
                    b_stride_slot,
                    p0,
                    WIDTH,
                    False,
                    DOT_PRECISION,
                )
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
    # 16 x 64 tiles: many programs for a decode batch (a [T, 4096] output at 16-128 rows is
    # 64-512 of them, not 32 of 64 x 128). The SwiGLU epilogue reads two tiles per output
    # tile and does better with fewer, larger ones from 128 rows on. Measured on an H200
    # (bench/probes/stacked_tune.py, session 9): against session 7's segment-sized rows and
    # 128 columns, 0.4-3.1 us less per launch at 32-128 rows, within 0.2 us at 16.
    block_s, block_n = (32, 128) if mode == _SILU_MUL and rows >= 128 else (16, 64)
    block_n = min(block_n, max(MIN_DOT_BLOCK, next_power_of_2(n_cols)))
    num_warps = 4
    if STACKED_OVERRIDE is not None:
        block_s, block_n, num_warps = STACKED_OVERRIDE
    grid = (cdiv(rows, block_s), cdiv(n_cols, block_n))
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
        WIDTH=stage.width,
        DOT_PRECISION=dot_precision(b.dtype),
        BLOCK_S=block_s,
        BLOCK_R=rank_block(stage.rank),
        BLOCK_N=block_n,
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
    out = torch.empty((f.shape[0], n_base), dtype=f.dtype, device=f.device)
    _launch(_PLAIN, f, b, out, out, stage, offsets, n_base, n_base, n_r)
    return out


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
    _launch(_RESIDUAL, f, b, res, res, stage, None, n_base, n_base, n_r)
    return res


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
    inter = n_base // 2
    out = torch.empty((f.shape[0], inter), dtype=f.dtype, device=f.device)
    _launch(_SILU_MUL, f, b, out, out, stage, None, inter, n_base, n_r)
    return out
