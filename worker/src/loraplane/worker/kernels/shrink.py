"""Segmented LoRA shrink ``y = x A`` in Triton; reference: ``reference.lora_shrink``.

Grid ``(segment blocks, segments, slices)``: program ``(b, s, i)`` computes rows
``b*BLOCK_S ...`` of segment ``s`` for slice ``i`` of that segment's own slot, looping over the
hidden dimension in ``BLOCK_K`` steps. With segment tiles (``seg_tiles``, built on the host by
``lora.batch_info.segment_tiles``) the first axis lists the ``(s, b)`` pairs that hold rows,
so a step of many short segments beside a few long ones (decodes beside prompt chunks) does
not launch every segment as many blocks as the longest one. A program without rows loads
nothing. The MoE form (``moe.py``) reuses the same kernel with a tile map instead of the
``(b, s)`` grid axes.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    ShrinkConfig,
    TileMap,
    cdiv,
    check_dim,
    check_interpretable,
    check_max_seg_len,
    check_same_dtype,
    check_tensor,
    dot_precision,
    launch_options,
    shrink_config,
    split_k_for,
)

__all__ = ["lora_shrink"]


@triton.jit
def tile_rows(
    tile_seg_ptr,
    tile_len_ptr,
    tile_rows_ptr,
    tile_rank_ptr,
    slot_ranks_ptr,
    rank_max,
    weights_per_slot,
    BLOCK_S: tl.constexpr,
    TILE_RANK: tl.constexpr,
):
    """The tile of this program (``TileMap``): ``(seg, weight slot, rank, rows, row mask)``.

    The tile's slot, length, rows and (with ``TILE_RANK``) rank are all loaded at the
    program's own index, in one round trip; without ``TILE_RANK`` the rank comes one later,
    from ``slot_ranks`` at ``seg // weights_per_slot``. ``seg`` is -1 on a padding tile (the
    caller returns). Rows past the tile's length are 0 and masked off."""
    tile = tl.program_id(0)
    seg = tl.load(tile_seg_ptr + tile)
    n_rows = tl.load(tile_len_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile * BLOCK_S + tl.arange(0, BLOCK_S))
    if TILE_RANK:
        rank = tl.load(tile_rank_ptr + tile)
    else:
        rank = tl.load(slot_ranks_ptr + tl.maximum(seg, 0) // weights_per_slot)
    rank = tl.minimum(rank, rank_max)
    s_mask = (tl.arange(0, BLOCK_S) < n_rows) & (rank > 0) & (seg >= 0)
    return seg, tl.maximum(seg, 0).to(tl.int64), rank, tl.where(s_mask, rows, 0), s_mask


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [weight_slots, num_slices * R, K]
    y_ptr,  # [positions, num_slices * R]
    part_ptr,  # fp32 [SPLIT_K, positions, num_slices * R] (when SPLIT_K > 1)
    count_ptr,  # int32 [tiles], zero between launches (when SPLIT_K > 1)
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]: index into the weight buffer's first axis
    slot_ranks_ptr,  # int32 [num_slots], or [S] when RANK_BY_SEG
    row_order_ptr,  # int64 [positions] (read only when HAS_ROW_ORDER)
    tile_seg_ptr,  # int32 [tiles] (read only when USE_TILE_MAP; so are the next three)
    tile_len_ptr,  # int32 [tiles]
    tile_rows_ptr,  # int64 [tiles * BLOCK_S]
    tile_rank_ptr,  # int32 [tiles] (read only when TILE_RANK)
    seg_tiles_ptr,  # int32 [2, programs]: each program's segment, then block (SEG_TILES)
    rank_max,
    x_stride_row,
    y_stride_row,
    a_stride_slot,
    a_stride_row,
    weights_per_slot,  # rank/scaling index = seg_slot // weights_per_slot (MoE: experts)
    x_row_div,  # x row = row // x_row_div (MoE: topk)
    part_stride_split,  # between the SPLIT_K partials
    HAS_ROW_ORDER: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,  # programs over a TileMap (y indexed by row then)
    Y_BY_ROW: tl.constexpr,  # y indexed by row (MoE: pair) instead of segment position
    DOT_PRECISION: tl.constexpr,
    HIDDEN: tl.constexpr,  # K; constexpr: fixed per model layer, and a runtime loop bound
    # breaks the Triton 3.6 interpreter under numpy >= 2.4
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: each program sums K_PER_SPLIT columns into an fp32 partial;
    # the last of a tile's SPLIT_K programs to finish sums the partials into y
    K_PER_SPLIT: tl.constexpr,
    RANK_BY_SEG: tl.constexpr = False,  # ranks given per segment: no load waits on the slot
    TILE_RANK: tl.constexpr = False,  # the tile map gives each tile's rank
    SEG_TILES: tl.constexpr = False,  # programs over listed (segment, block) pairs
):
    # As in the expand: the segment's loads first and no early return after them, so the
    # first x and A tiles leave one memory round trip after the program starts (two with
    # segment tiles: the pair, then the segment).
    slice_id = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K
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
        y_rows = rows
    else:
        if SEG_TILES:
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
        else:
            rank = tl.minimum(tl.load(slot_ranks_ptr + weight_slot // weights_per_slot), rank_max)
        # a program past its segment's rows reads no A: rank 0 masks every load
        rank = tl.where(seg_start + blk * BLOCK_S < seg_end, rank, 0)

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
    x_rows = rows // x_row_div

    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_mask = offs_r < rank  # rows of A at or beyond the rank are never read
    k_first = split * K_PER_SPLIT
    offs_k = k_first + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_ptrs = x_ptr + x_rows[:, None] * x_stride_row + offs_k[None, :]  # [BLOCK_S, BLOCK_K]
    a_base = a_ptr + weight_slot * a_stride_slot + (slice_id * rank_max).to(tl.int64) * a_stride_row
    a_ptrs = a_base + offs_r[None, :] * a_stride_row + offs_k[:, None]  # [BLOCK_K, BLOCK_R]

    acc = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)  # [BLOCK_S, BLOCK_R]
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = (k0 + offs_k) < HIDDEN
        x_tile = tl.load(x_ptrs, mask=s_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K

    y_offs = y_rows[:, None] * y_stride_row + slice_id * rank_max + offs_r[None, :]
    y_mask = s_mask[:, None] & (offs_r < rank_max)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.store(part_ptr + split * part_stride_split + y_offs, acc, mask=y_mask)
        # Serial fix-up: every program of the tile counts itself in once its partial is
        # stored (release); the last one (acquire) sums all SPLIT_K partials in split order,
        # which makes y the same bits whichever program arrives last, then zeroes the count
        # for the next launch on this buffer.
        tile = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (
            tl.num_programs(2) // SPLIT_K
        ) + slice_id
        tl.debug_barrier()  # every thread's partial stores are issued before the release
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()  # every thread's loads are ordered after the acquire
            total = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + sp * part_stride_split + y_offs,
                    mask=y_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


# Tiles (program groups that split K) a fix-up count buffer covers. K is split only for grids
# under TARGET_PROGRAMS // 4 programs, so a split launch never has more tiles than that. The
# split decode attention (kernels/attention.py) counts its (token, KV head) pairs in the same
# buffer, launches on one stream running one after another.
COUNT_SLOTS = 4096
# Zeroed buffers made outside any CUDA graph capture, kept ready for streams first met inside
# one (a capture can allocate, but its fill would only run when that graph is replayed).
_SPARES = 4
_counts: dict[tuple[torch.device, int], torch.Tensor] = {}
_spares: dict[torch.device, list[torch.Tensor]] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and bool(torch.cuda.is_current_stream_capturing())


def split_counts(device: torch.device) -> torch.Tensor:
    """The zeroed int32 fix-up counts of the current stream on ``device``.

    One buffer per stream: launches on one stream run one after another, and each launch
    leaves its counts zero again, so the next one finds them so. A CUDA graph keeps the buffer
    of the stream it was captured on, so graphs captured on one stream must not be replayed
    concurrently (the runtime replays one step at a time).

    A buffer is zeroed when it is made, outside any capture: a stream first met while a graph
    is being captured takes one of the spares made when an earlier stream was first met
    outside one (every caller runs its kernels eagerly before capturing them: warm-ups
    compile them). With none left, this raises rather than hand a capture memory that only
    its own replay would zero. Known streams cost one dictionary lookup per launch.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counts = _counts.get(key)
    if counts is not None:  # the launch path: one lookup
        return counts
    spares = _spares.setdefault(device, [])
    if _capturing(device):
        if not spares:
            raise RuntimeError(
                "split-K shrink / split decode attention: no zeroed fix-up counts for a "
                "stream first used inside a CUDA graph capture; run the kernel once on this "
                "device outside the capture first (a warm-up), which makes spare buffers"
            )
        counts = _counts[key] = spares.pop()
        return counts
    counts = _counts[key] = torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=device)
    while len(spares) < _SPARES:
        spares.append(torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=device))
    return counts


def launch_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    positions: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    row_order: torch.Tensor | None,
    num_slices: int,
    config: ShrinkConfig,
    grid_blocks: int,
    grid_segments: int,
    *,
    tile_map: TileMap | None = None,
    weights_per_slot: int = 1,
    x_row_div: int = 1,
    y_by_row: bool = False,
    zeroed: bool = True,
    rank_by_seg: bool = False,
    split_cap: int | None = None,
    seg_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch without checks (callers validated); returns ``y [positions, slices*R]``.

    ``seg_tiles`` (int32 ``[2, n]``, ``segment_tiles``'s): the programs' (segment, block)
    pairs, in place of the ``grid_blocks x grid_segments`` grid, which still picks the K
    splits (so a step compiles the variants it did without tiles).

    ``weights [weight_slots, slices*R, K]``. When the grid is too small to fill the GPU
    (decode), K is split over ``split_k`` programs per tile writing fp32 partials; the last
    program of each tile sums them in a fixed order (deterministic) and writes ``y``, so it is
    still one launch.

    With ``zeroed=False`` ``y`` is not zeroed first: it is written only at the positions of
    segments whose slot has a rank > 0, which are all that ``launch_expand`` reads. That saves
    a fill kernel at decode.
    """
    rank_max = weights.shape[1] // num_slices
    hidden = x.shape[1]
    width = weights.shape[1]
    tiles = grid_blocks * grid_segments * num_slices
    split_k = split_k_for(tiles, hidden, config.block_k, split_cap)
    k_per_split = cdiv(cdiv(hidden, split_k), config.block_k) * config.block_k
    split_k = cdiv(hidden, k_per_split) if hidden > 0 else 1
    y = (torch.zeros if zeroed else torch.empty)((positions, width), dtype=x.dtype, device=x.device)
    if tiles == 0 or positions == 0:
        return y
    if split_k > 1:
        if tiles > COUNT_SLOTS:  # split_k_for never splits this many; a guard, not a path
            raise RuntimeError(f"split-K over {tiles} tiles, fix-up counts for {COUNT_SLOTS}")
        parts = torch.empty((split_k, positions, width), dtype=torch.float32, device=x.device)
        counts = split_counts(x.device)
    else:
        parts = counts = y  # never read
    tiles_args = tile_map_args(tile_map, seg_indptr)
    grid = (grid_blocks, grid_segments) if seg_tiles is None else (seg_tiles.shape[1], 1)
    _lora_shrink_kernel[(*grid, num_slices * split_k)](
        x,
        weights,
        y,
        parts,
        counts,
        seg_indptr,
        seg_slots,
        slot_ranks,
        row_order if row_order is not None else seg_indptr,
        *tiles_args,
        seg_tiles if seg_tiles is not None else seg_indptr,
        rank_max,
        x.stride(0),
        width,
        weights.stride(0),
        weights.stride(1),
        weights_per_slot,
        x_row_div,
        positions * width,
        HAS_ROW_ORDER=row_order is not None,
        USE_TILE_MAP=tile_map is not None,
        Y_BY_ROW=y_by_row,
        DOT_PRECISION=dot_precision(x.dtype),
        HIDDEN=hidden,
        BLOCK_S=config.block_s,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        RANK_BY_SEG=rank_by_seg,
        TILE_RANK=tile_map is not None and tile_map.ranks is not None,
        SEG_TILES=seg_tiles is not None,
        **launch_options(config.num_warps, config.num_stages),
    )
    return y


def tile_map_args(tile_map: TileMap | None, unused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four tile-map pointers of a launch (``unused`` in place of those not read)."""
    if tile_map is None:
        return (unused, unused, unused, unused)
    ranks = tile_map.ranks if tile_map.ranks is not None else unused
    return (tile_map.segs, tile_map.lens, tile_map.rows, ranks)


def check_segments(
    fn: str,
    device: torch.device,
    seg_indptr: object,
    seg_slots: object,
    slot_ranks: object,
    row_order: object,
    num_slots: int,
) -> None:
    """Shapes/dtypes of the segment description (values are trusted: no host sync)."""
    indptr = check_tensor(
        fn, "seg_indptr", seg_indptr, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    if indptr.shape[0] < 1:
        raise ValueError(
            f"{fn}: seg_indptr must have S + 1 >= 1 entries, got shape {tuple(indptr.shape)}"
        )
    slots = check_tensor(
        fn, "seg_slots", seg_slots, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    check_dim(
        fn, "seg_slots", slots, 0, indptr.shape[0] - 1, "one slot per segment: len(seg_indptr) - 1"
    )
    ranks = check_tensor(
        fn, "slot_ranks", slot_ranks, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    check_dim(fn, "slot_ranks", ranks, 0, num_slots, "one rank per slot of the weight buffer")
    if row_order is not None:
        check_tensor(
            fn,
            "row_order",
            row_order,
            ndim=1,
            dtypes=(torch.int64,),
            device=device,
            contiguous=True,
        )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    row_order: torch.Tensor | None,
    num_slices: int,
    max_seg_len: int,
) -> torch.Tensor:
    """Triton ``reference.lora_shrink``: ``y [positions, num_slices * R]`` in ``x.dtype``.

    ``positions`` is ``row_order.shape[0]`` if ``row_order`` is given, else ``x.shape[0]``.
    Positions in no segment, and columns at or beyond a slot's rank, are zero.
    """
    fn = "lora_shrink"
    positions, config = check_shrink_operands(
        fn, x, lora_a, seg_indptr, seg_slots, slot_ranks, row_order, num_slices, max_seg_len
    )
    return shrink_segments(
        x,
        lora_a,
        positions,
        seg_indptr,
        seg_slots,
        slot_ranks,
        row_order,
        num_slices,
        config,
        max_seg_len,
    )


def shrink_segments(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    positions: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    row_order: torch.Tensor | None,
    num_slices: int,
    config: ShrinkConfig,
    max_seg_len: int,
    *,
    zeroed: bool = True,
    rank_by_seg: bool = False,
    split_cap: int | None = None,
    seg_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """``launch_shrink`` over the ``(segment blocks, segments, slices)`` grid, or over
    ``seg_tiles``' pairs (checked args)."""
    return launch_shrink(
        x,
        lora_a,
        positions,
        seg_indptr,
        seg_slots,
        slot_ranks,
        row_order,
        num_slices,
        config,
        grid_blocks=cdiv(max_seg_len, config.block_s),
        grid_segments=seg_slots.shape[0],
        zeroed=zeroed,
        rank_by_seg=rank_by_seg,
        split_cap=split_cap,
        seg_tiles=seg_tiles,
    )


def check_shrink_operands(
    fn: str,
    x_arg: object,
    lora_a_arg: object,
    seg_indptr: object,
    seg_slots: object,
    slot_ranks: object,
    row_order: object,
    num_slices: object,
    max_seg_len: object,
) -> tuple[int, ShrinkConfig]:
    """Checks of ``lora_shrink``'s operands; returns (positions, the launch config)."""
    x = check_tensor(fn, "x", x_arg, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "x", x)
    lora_a = check_tensor(
        fn, "lora_a", lora_a_arg, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True
    )
    check_same_dtype(fn, "lora_a", lora_a, "x", x.dtype)
    check_dim(fn, "lora_a", lora_a, 2, x.shape[1], "the hidden size of x")
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"{fn}: num_slices must be an int >= 1, got {num_slices!r}")
    if lora_a.shape[1] % num_slices != 0:
        raise ValueError(
            f"{fn}: lora_a.shape[1] must be num_slices * max_rank, got {lora_a.shape[1]} "
            f"which is not a multiple of num_slices={num_slices}"
        )
    check_segments(fn, x.device, seg_indptr, seg_slots, slot_ranks, row_order, lora_a.shape[0])
    seg_len = check_max_seg_len(fn, max_seg_len)
    positions = row_order.shape[0] if isinstance(row_order, torch.Tensor) else x.shape[0]
    return positions, shrink_config(
        seg_len, lora_a.shape[1] // num_slices, x.shape[1], x.element_size()
    )
