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

Rows are visited by **full segments** (``StageInfo``): the batch's adapter segments, then
one segment of the rows with no adapter (stage position -1: no LoRA term). Every sum is in
fp32 and rounded once. Measured on an H200 (``bench/probes/concurrency.py``, mode ``fused``,
session 7): an 8-layer Llama-3-8B-shaped decode stack keeps 0.97-1.00 of its base step with
1 or 4 adapters at 16-128 rows, against 0.90-0.95 for shrink + expand kernels. References:
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
    segment_block,
)
from loraplane.worker.kernels.expand import slice_bounds, slice_term

__all__ = ["StageInfo", "stacked_plain", "stacked_residual", "stacked_silu_mul"]

_PLAIN, _RESIDUAL, _SILU_MUL = 0, 1, 2


# (block_s, block_n, num_warps) for every launch instead of the rule in ``_launch`` when set
# (bench/probes/stacked_tune.py).
STACKED_OVERRIDE: tuple[int, int, int] | None = None


@triton.jit
def _stacked_lora_kernel(
    full_ptr,  # [T, N + width * nR]: the stacked GEMM's output (base | y of each position)
    b_ptr,  # [slots, N, R]
    res_ptr,  # [T, N]: residual (MODE _RESIDUAL; may be out)
    out_ptr,  # [T, N] (PLAIN, RESIDUAL) or [T, N / 2] (SILU_MUL)
    indptr_ptr,  # int32 [F + 1]
    order_ptr,  # int64 [T]
    slots_ptr,  # int32 [F]
    pos_ptr,  # int32 [F]
    scal_ptr,  # float32 [F]
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1] (MODE _PLAIN with NUM_SLICES > 1)
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
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(1)
    seg_start = tl.load(indptr_ptr + seg)
    seg_end = tl.load(indptr_ptr + seg + 1)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    pos = tl.load(pos_ptr + seg)
    scaling = tl.load(scal_ptr + seg)
    offs_s = seg_start + tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    if seg_start + tl.program_id(0) * BLOCK_S >= seg_end:
        return
    s_mask = offs_s < seg_end
    rows = tl.load(order_ptr + offs_s, mask=s_mask, other=0)  # [BLOCK_S] int64
    has_lora = pos >= 0  # the no-adapter segment reads no y and no B (a NaN in some
    # slot's B must not reach rows that use no adapter)
    lora = s_mask & has_lora

    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < n_cols
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = (offs_r < rank_max) & has_lora
    mask = s_mask[:, None] & n_mask[None, :]
    row_full = full_ptr + rows[:, None] * full_stride  # [BLOCK_S, 1]
    y_row = row_full + n_base + pos.to(tl.int64) * n_r  # [BLOCK_S, 1]: this position's y
    y_mask = lora[:, None] & r_mask[None, :]
    b_base = b_ptr + slot * b_stride_slot
    b_cols = offs_n[None, :].to(tl.int64) * b_stride_row + offs_r[:, None]  # [BLOCK_R, BLOCK_N]

    # The base, y and slice-bound loads are issued first (see kernels/expand.py); B's wait
    # only for the branch past the no-adapter segment and the slices a block misses.
    base = tl.load(row_full + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 2:  # gate | up: gate in columns [0, n_cols), up in [n_cols, 2 n_cols)
        up = tl.load(row_full + n_cols + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        y_g = tl.load(y_row + offs_r[None, :], mask=y_mask, other=0.0)
        y_u = tl.load(y_row + rank_max + offs_r[None, :], mask=y_mask, other=0.0)
        b_mask = r_mask[:, None] & n_mask[None, :]
        gate = base
        if has_lora:  # the no-adapter segment loads no B and runs no dot
            b_g = tl.load(b_base + b_cols, mask=b_mask, other=0.0)
            b_u = tl.load(b_base + n_cols * b_stride_row + b_cols, mask=b_mask, other=0.0)
            gate += scaling * tl.dot(y_g, b_g, input_precision=DOT_PRECISION)
            up += scaling * tl.dot(y_u, b_u, input_precision=DOT_PRECISION)
        val = gate / (1.0 + tl.exp(-gate)) * up
    else:
        if MODE == 1:
            res = tl.load(res_ptr + rows[:, None] * res_stride + offs_n[None, :], mask=mask)
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        n0 = tl.program_id(2) * BLOCK_N
        for i in tl.static_range(NUM_SLICES):
            col_lo, col_hi = slice_bounds(slice_offsets_ptr, i, n_cols, NUM_SLICES)
            # no loads or dot for the no-adapter segment or a slice the block misses
            if has_lora & (col_lo < n0 + BLOCK_N) & (col_hi > n0):
                y_i = y_row + i * rank_max
                acc += slice_term(
                    y_i,
                    b_base + b_cols,
                    offs_n,
                    offs_r,
                    y_mask,
                    r_mask,
                    y_mask,
                    r_mask,
                    col_lo,
                    col_hi,
                    DOT_PRECISION,
                    False,  # the stage rank is a launch argument: its mask is not split
                )
        val = base + scaling * acc
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
    segments = stage.full_slots.shape[0] if stage.full_slots.dim() == 1 else -1
    for name, t, dtype, length in (
        ("full_indptr", stage.full_indptr, torch.int32, segments + 1),
        ("full_slots", stage.full_slots, torch.int32, segments),
        ("full_pos", stage.full_pos, torch.int32, segments),
        ("full_scalings", stage.full_scalings, torch.float32, segments),
        ("full_order", stage.full_order, torch.int64, f.shape[0]),
    ):
        t = check_tensor(fn, f"stage.{name}", t, ndim=1, dtypes=(dtype,), device=f.device)
        check_dim(fn, f"stage.{name}", t, 0, length, "one per full segment (+1), or per row")
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
    segments = stage.full_slots.shape[0]
    if full.shape[0] == 0 or n_cols == 0 or segments == 0:
        return
    # 16 x 64 tiles: many programs for a decode batch (a [T, 4096] output at 16-128 rows is
    # 64-512 of them, not 32 of 64 x 128). The SwiGLU epilogue reads two tiles per output
    # tile and does better with fewer, larger ones from 128 rows on. Measured on an H200
    # (bench/probes/stacked_tune.py, session 9): against session 7's segment-sized rows and
    # 128 columns, 0.4-3.1 us less per launch at 32-128 rows, within 0.2 us at 16.
    block_s, block_n = (32, 128) if mode == _SILU_MUL and full.shape[0] >= 128 else (16, 64)
    block_s = min(block_s, segment_block(stage.max_len))
    block_n = min(block_n, max(MIN_DOT_BLOCK, next_power_of_2(n_cols)))
    num_warps = 4
    if STACKED_OVERRIDE is not None:
        block_s, block_n, num_warps = STACKED_OVERRIDE
    grid = (cdiv(max(1, stage.max_len), block_s), segments, cdiv(n_cols, block_n))
    _stacked_lora_kernel[grid](
        full,
        b,
        res,
        out,
        stage.full_indptr,
        stage.full_order,
        stage.full_slots,
        stage.full_pos,
        stage.full_scalings,
        slice_offsets if slice_offsets is not None else stage.full_indptr,
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
