"""Rotary embedding and the KV-cache write after qkv_proj, in one launch; with a staged
batch's qkv LoRA added first. Reference: ``reference.rope_qkv``.

``qkv [T, (H + 2 KV) d]`` is q | k | v, head by head. One program takes ``BLOCK_S`` rows of one
head as two halves (``rotate_half`` pairs column ``j`` with ``j + d/2``): q heads are
(optionally RMS-normed, Qwen3's ``q_norm``), rotated and stored into a new ``q [T, H, d]``;
k heads are normed and rotated and v heads copied into the paged KV cache ``[pages,
page_size, KV, d]`` at slot ``slots[t]`` (position ``slots[t] % page_size`` of page
``slots[t] // page_size``, ``models/kv_cache.py``). ``cos_sin [max_pos, d]`` holds ``cos`` then ``sin`` of
``position * inv_freq`` in the model dtype, as the torch module rounds them; the products are
fp32, rounded once.

On the torch path this is about ten kernels per layer (the angles, ``cos``, ``sin``, two
``cat``, the rotations, two index writes), about 9% of a Llama-3-8B-shaped decode step on an
H200 (``bench decode --profile-graphs``).

**With LoRA** (``lora_b`` and ``stage`` given): ``qkv`` is the stacked GEMM's output ``full``
(``kernels/stacked.py``): ``[T, N + width * nR]``, row ``t``'s ``y`` for stage position ``p``
in columns ``N + p * nR ..`` (q, k, v slices of ``stage.rank`` columns each). Each head adds
``s * y_slice B[head columns]`` to its base value before the norm and rotation, so a staged
batch's qkv LoRA costs no launch of its own (``stacked_plain`` did it in one). Rows are read in
place, as without LoRA, and each row's stage position (``StageInfo.row_pos``) picks its own
``y`` columns. Below ``stacked.ROWS_KERNEL_MIN`` rows a program per (tile, head) takes one of
the batch's tiles (``StageInfo.tiles``: a position's rows with its slot and scaling, see
``kernels/stacked.py``): the tile first, then its rows' positions, KV slots, values, ``y`` and
B, then ``cos | sin``. That is three round trips against the two of a program per (row block,
position, head), which it replaced, but no program is launched without rows: 6.0 us against
6.8 at 48 rows over 16 positions, 6.2 against 9.0 at 128, and 16.0 against 25.8 for the row
blocks at 816 rows (a mixed step's; H100, ``bench/probes/stacked_width.py``). From
``stacked.ROWS_KERNEL_MIN`` rows, and for a ``StageInfo`` without tiles, a program per (row
block, head) takes every row of its block and visits the positions they hold, found by one
bitwise reduction, as the stacked epilogues' ``BY_ROWS`` variant does.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels import stacked
from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MIN_DOT_BLOCK,
    TILE_ROWS,
    TILE_WORDS,
    StageInfo,
    cdiv,
    check_dim,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
    rank_block,
)
from loraplane.worker.kernels.stacked import (
    block_holds,
    check_stacked,
    position_slot,
    positions_held,
    stage_tile,
)

__all__ = ["rope_qkv"]

BLOCK_S = 16  # rows per program (tl.dot needs 16)


@triton.jit
def _rope_qkv_kernel(
    src_ptr,  # [T, >= (H + 2 KV) d]: qkv, or the stacked GEMM's full output
    q_ptr,  # [T, H, d]
    k_cache_ptr,  # [pages, page_size, KV, d]
    v_cache_ptr,
    slots_ptr,  # int64 [T]
    positions_ptr,  # int64 [T]
    cos_sin_ptr,  # [max_pos, d]: cos | sin
    q_norm_ptr,  # [d] (QK_NORM)
    k_norm_ptr,
    b_ptr,  # [B, N, R] (HAS_LORA): the Bs that pos_slots / the tiles name
    row_pos_ptr,  # int32 [T]: each row's stage position, -1 for none (HAS_LORA)
    pos_slots_ptr,  # int32 [WIDTH]: which B (b_ptr's first index) a position reads, -1: none
    pos_scal_ptr,  # float32 [WIDTH]
    n_tokens,
    num_heads,
    num_kv_heads,
    half,  # d / 2
    eps,
    n_base,
    n_r,
    rank_max,
    src_stride,
    q_stride_t,
    q_stride_h,
    page_size,
    c_stride_page,
    c_stride_pos,
    c_stride_head,
    cs_stride,
    b_stride_slot,
    b_stride_row,
    HAS_LORA: tl.constexpr,
    WIDTH: tl.constexpr,
    QK_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BY_ROWS: tl.constexpr = False,  # (HAS_LORA) program (block, 0, head) visits its rows' positions
    tiles_ptr=None,  # int32 [tiles * TILE_WORDS] (HAS_LORA, not BY_ROWS: ``stage_tiles``)
    TILE_WORDS: tl.constexpr = 0,
):
    head = tl.program_id(2)
    TILES: tl.constexpr = HAS_LORA and not BY_ROWS  # program (tile, 0, head)
    if TILES:  # the tile's rows, position, slot and scaling: a round trip first
        rows, s_mask, p, slot, scaling = stage_tile(
            tiles_ptr, tl.program_id(0), BLOCK_S, TILE_WORDS
        )
        if tl.max(s_mask.to(tl.int32), axis=0) == 0:  # a padding tile
            return
    else:
        offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        s_mask = offs_s < n_tokens
        rows = offs_s.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half
    col = head * 2 * half  # the head's first column in q | k | v
    v_start = num_heads + num_kv_heads
    src_row = src_ptr + rows[:, None] * src_stride  # [BLOCK_S, 1]
    # First round trip: the rows' positions and KV slots (with LoRA, also their stage
    # positions and y, and this program's slot and scaling); then the values, cos | sin (and
    # B). With one stage position, or none, the values leave in the first round trip too.
    positions = tl.load(positions_ptr + rows, mask=s_mask, other=0)
    kv_slots = tl.load(slots_ptr + rows, mask=s_mask & (head >= num_heads), other=0)
    if HAS_LORA and BY_ROWS:  # (see the stacked epilogues' BY_ROWS)
        qkv_slice = (head >= num_heads).to(tl.int32) + (head >= v_start).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank_max
        row_pos = tl.load(row_pos_ptr + offs_s, mask=s_mask, other=-1)
    if TILES:
        qkv_slice = (head >= num_heads).to(tl.int32) + (head >= v_start).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank_max
        hit = (s_mask & (slot >= 0))[:, None]
        y_cols = n_base + p * n_r + qkv_slice * rank_max + offs_r[None, :]
        y = tl.load(src_row + y_cols, mask=hit & r_mask[None, :], other=0.0)
    mask = s_mask[:, None] & d_mask[None, :]
    lo = tl.load(src_row + col + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src_row + col + half + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    rotate = mask & (head < v_start)  # q and k heads
    cs = cos_sin_ptr + positions[:, None] * cs_stride + offs_d[None, :]
    cos = tl.load(cs, mask=rotate, other=0.0).to(tl.float32)
    sin = tl.load(cs + half, mask=rotate, other=0.0).to(tl.float32)
    if HAS_LORA and BY_ROWS:
        b_cols = (col + offs_d[None, :]).to(tl.int64) * b_stride_row + offs_r[:, None]
        for p in tl.static_range(WIDTH):
            if p % 64 == 0:  # the positions of the block's rows, 64 at a time
                bits = positions_held(row_pos, s_mask, p)
            if block_holds(bits, p):  # a row of the block is at p
                slot, scaling = position_slot(pos_slots_ptr, pos_scal_ptr, p)
                hit = (s_mask & (row_pos == p) & (slot >= 0))[:, None]
                y_cols = n_base + p * n_r + qkv_slice * rank_max + offs_r[None, :]
                y = tl.load(src_row + y_cols, mask=hit & r_mask[None, :], other=0.0)
                b_tile = b_ptr + slot * b_stride_slot + b_cols  # [BLOCK_R, BLOCK_D]
                b_mask = (r_mask & (slot >= 0))[:, None] & d_mask[None, :]
                b_lo = tl.load(b_tile, mask=b_mask, other=0.0)
                b_hi = tl.load(b_tile + half * b_stride_row, mask=b_mask, other=0.0)
                t_lo = scaling * tl.dot(y, b_lo, input_precision=DOT_PRECISION)
                t_hi = scaling * tl.dot(y, b_hi, input_precision=DOT_PRECISION)
                lo = tl.where(hit, lo + t_lo, lo)
                hi = tl.where(hit, hi + t_hi, hi)
    if TILES:
        b_tile = b_ptr + tl.maximum(slot, 0) * b_stride_slot + offs_r[:, None]
        b_tile += (col + offs_d[None, :]).to(tl.int64) * b_stride_row  # [BLOCK_R, BLOCK_D]
        b_mask = (r_mask & (slot >= 0))[:, None] & d_mask[None, :]
        b_lo = tl.load(b_tile, mask=b_mask, other=0.0)
        b_hi = tl.load(b_tile + half * b_stride_row, mask=b_mask, other=0.0)
        lo = tl.where(hit, lo + scaling * tl.dot(y, b_lo, input_precision=DOT_PRECISION), lo)
        hi = tl.where(hit, hi + scaling * tl.dot(y, b_hi, input_precision=DOT_PRECISION), hi)
    dtype = q_ptr.dtype.element_ty
    if head < v_start:  # q or k: norm (Qwen3), then rotate
        if QK_NORM:
            if head < num_heads:
                w_lo = tl.load(q_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                w_hi = tl.load(q_norm_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            else:
                w_lo = tl.load(k_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                w_hi = tl.load(k_norm_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            ss = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)  # [BLOCK_S]
            rstd = (1.0 / tl.sqrt_rn(ss / (2 * half) + eps))[:, None]
            # rounded as the torch RMSNorm rounds: the normed value, then the weighted one
            lo = (w_lo[None, :] * (lo * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            hi = (w_hi[None, :] * (hi * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    if head < num_heads:
        q_row = q_ptr + rows[:, None] * q_stride_t + head * q_stride_h
        tl.store(q_row + offs_d[None, :], lo.to(dtype), mask=mask)
        tl.store(q_row + half + offs_d[None, :], hi.to(dtype), mask=mask)
    else:
        page, offset = kv_slots // page_size, kv_slots % page_size  # [BLOCK_S]
        slot_off = page * c_stride_page + offset * c_stride_pos
        if head < v_start:
            c_row = k_cache_ptr + slot_off[:, None] + (head - num_heads) * c_stride_head
        else:
            c_row = v_cache_ptr + slot_off[:, None] + (head - v_start) * c_stride_head
        tl.store(c_row + offs_d[None, :], lo.to(dtype), mask=mask)
        tl.store(c_row + half + offs_d[None, :], hi.to(dtype), mask=mask)


def _check_cache(fn: str, name: str, cache: object, like: torch.Tensor) -> torch.Tensor:
    c = check_tensor(fn, name, cache, ndim=4, dtypes=FLOAT_DTYPES, device=like.device)
    check_same_dtype(fn, name, c, "qkv", like.dtype)
    if c.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have unit stride in its last dimension")
    return c


def rope_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    lora_b: torch.Tensor | None = None,
    stage: StageInfo | None = None,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` (and add a staged LoRA first), write k and v into the cache
    at slot ``slots[t]`` of its flat ``[pages * page_size, KV, d]`` view; returns
    ``q [T, num_heads, d]``. Positions are trusted to be rows of ``cos_sin`` and slots
    slots of the cache (no host sync).

    ``k_cache``/``v_cache`` ``[pages, page_size, KV, d]`` give KV and d; ``qkv`` has
    ``(num_heads + 2 KV) d`` columns, or with ``lora_b [slots, N, R]`` and ``stage`` it is
    the stacked GEMM's ``[T, N + stage.width * 3 * stage.rank]``. ``q_norm``/``k_norm``
    ``[d]`` (both or neither) normalize each head first, with ``eps``."""
    fn = "rope_qkv"
    x = check_tensor(fn, "qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    kc = _check_cache(fn, "k_cache", k_cache, x)
    vc = _check_cache(fn, "v_cache", v_cache, x)
    if vc.shape != kc.shape or vc.stride() != kc.stride():
        raise ValueError(
            f"{fn}: v_cache must have k_cache's shape and strides {tuple(kc.shape)}, "
            f"got {tuple(vc.shape)}"
        )
    kv_heads, d = kc.shape[2], kc.shape[3]
    if d % 2 or d < 2:
        raise ValueError(f"{fn}: the head size (k_cache.shape[3]) must be even, got {d}")
    if num_heads < 1:
        raise ValueError(f"{fn}: num_heads must be >= 1, got {num_heads}")
    n_base = (num_heads + 2 * kv_heads) * d
    t = x.shape[0]
    for name, idx in (("positions", positions), ("slots", slots)):
        i = check_tensor(
            fn, name, idx, ndim=1, dtypes=(torch.int64,), device=x.device, contiguous=True
        )
        check_dim(fn, name, i, 0, t, "one per row of qkv")
    cs = check_tensor(fn, "cos_sin", cos_sin, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_dim(fn, "cos_sin", cs, 1, d, "cos | sin of the head size")
    if cs.stride(1) != 1:
        raise ValueError(f"{fn}: cos_sin must have unit stride in its last dimension")
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{fn}: q_norm and k_norm go together (Qwen3's per-head norms)")
    norms = []
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            w = check_tensor(fn, name, w, ndim=1, dtypes=(x.dtype,), device=x.device)
            check_dim(fn, name, w, 0, d, "one weight per head column")
            if not w.is_contiguous():
                raise ValueError(f"{fn}: {name} must be contiguous")
            norms.append(w)
    if (lora_b is None) != (stage is None):
        raise ValueError(f"{fn}: lora_b and stage go together (a staged batch's qkv LoRA)")
    n_r = 0
    if lora_b is not None and stage is not None:
        n_r = 3 * stage.rank
        x, b = check_stacked(fn, x, n_base, lora_b, stage, n_r, 3, name="qkv")
    else:
        b = None
        if x.shape[1] != n_base:
            raise ValueError(
                f"{fn}: qkv must have (num_heads {num_heads} + 2 x KV {kv_heads}) x d {d} = "
                f"{n_base} columns, got shape {tuple(x.shape)}"
            )
    q = torch.empty((t, num_heads, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return q
    heads = num_heads + 2 * kv_heads
    half = d // 2
    tiles = stage.tiles if stage is not None and t < stacked.ROWS_KERNEL_MIN else None
    by_rows = stage is not None and tiles is None
    block_s = TILE_ROWS if tiles is not None else BLOCK_S
    if tiles is not None:
        grid = (tiles.shape[0] // TILE_WORDS, 1, heads)
    else:
        grid = (cdiv(t, BLOCK_S), 1, heads)
    if b is not None and stage is not None:
        lora_args = (b, stage.row_pos, stage.pos_slots, stage.pos_scalings)
        rank, block_r, b_strides = stage.rank, rank_block(stage.rank), (b.stride(0), b.stride(1))
        width = stage.width
    else:
        lora_args = (x, positions, positions, positions)  # not read
        rank, block_r, b_strides, width = 0, MIN_DOT_BLOCK, (0, 0), 0
    _rope_qkv_kernel[grid](
        x,
        q,
        kc,
        vc,
        slots,
        positions,
        cs,
        norms[0] if norms else cs,
        norms[1] if norms else cs,
        *lora_args,
        t,
        num_heads,
        kv_heads,
        half,
        eps,
        n_base,
        n_r,
        rank,
        x.stride(0),
        q.stride(0),
        q.stride(1),
        kc.shape[1],
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        cs.stride(0),
        *b_strides,
        HAS_LORA=b is not None,
        WIDTH=width if tiles is None else 0,  # (tiles: one variant for every width)
        QK_NORM=bool(norms),
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_S=block_s,
        BLOCK_D=max(MIN_DOT_BLOCK, next_power_of_2(half)),
        BLOCK_R=block_r,
        BY_ROWS=by_rows,
        tiles_ptr=tiles,
        TILE_WORDS=TILE_WORDS,
        # No fused multiply-adds but tl.dot's: the rotation is then rounded product by
        # product as the torch path rounds it, and the same instructions with LoRA and
        # without, so a row with no adapter gets the LoRA-off bits. Contracted, the two
        # variants compiled ``lo * cos - hi * sin`` differently for fp32 on an H100.
        enable_fp_fusion=False,
    )
    return q
