"""LoRA for routed experts: the weight is chosen per ``(token, k)`` pair by ``(slot, expert)``.

Reference: ``reference.moe_lora_shrink`` / ``reference.moe_lora_expand``.

``moe_lora_routing`` groups the pairs on the device (a one-program counting sort) by the key
``slot * E + expert``; pairs without an adapter (slot ``-1``) go last and belong to no segment. Each key is a
segment whose "weight slot" is the key itself, indexing the weight buffer viewed as
``[num_slots * E, ...]``; rank and scaling are read at ``key // E``. Because the number of
non-empty groups is only known on the device, the kernels run over a tile map: tile ``t`` is
block ``tile_blk[t]`` of segment ``tile_seg[t]`` (``-1`` for padding tiles), with a host-known
bound ``ceil(P / BLOCK_S) + min(G, P)`` on the number of tiles. No host syncs.

Each tile also carries what its program needs, at the tile's own index: its pairs
(``tile_rows[t * BLOCK_S + i]``, the first ``tile_len[t]`` valid) and, when the routing was
given the slot ranks, its rank (``tile_rank[t]``). So a program's first round trip to memory
brings its key, rows and rank, and its second the weights and activations: no load waits on a
segment's bounds or on a sorted position's row (ADR 0007's rule for the staged epilogues).

``y`` is indexed by pair ``p`` (original order), so shrink and expand need no shared state
beyond an optional precomputed ``routing`` (build it once per MoE layer and pass it to both).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (the routing kernel is an untyped Triton JIT function; the wrappers are typed.)
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MIN_DOT_BLOCK,
    ExpandConfig,
    TileMap,
    cdiv,
    check_dim,
    check_interpretable,
    check_same_dtype,
    check_tensor,
    expand_config,
    rank_block,
    shrink_config,
)
from loraplane.worker.kernels.expand import check_expand_operands, launch_expand
from loraplane.worker.kernels.shrink import launch_shrink

__all__ = [
    "MoeLoraRouting",
    "moe_lora_expand",
    "moe_lora_routing",
    "moe_lora_shrink",
    "runtime_moe_expand",
    "runtime_moe_shrink",
]

# Routed groups are small (a few pairs per (slot, expert) at decode): the smallest dot block.
MOE_BLOCK_S = MIN_DOT_BLOCK


@dataclass(frozen=True, slots=True)
class MoeLoraRouting:
    """Pairs grouped by ``(slot, expert)`` on the device; see the module docstring."""

    num_slots: int
    num_experts: int
    block_s: int
    seg_indptr: torch.Tensor  # int32 [G + 1], G = num_slots * num_experts
    row_order: torch.Tensor  # int64 [P]: pair index at each sorted position
    tile_seg: torch.Tensor  # int32 [tiles]: segment of each tile, -1 = padding
    tile_blk: torch.Tensor  # int32 [tiles]: block of the segment
    tile_len: torch.Tensor  # int32 [tiles]: pairs in the tile (padding tiles: unset)
    tile_rows: torch.Tensor  # int64 [tiles * block_s]: the tile's pairs, first tile_len valid
    # int32 [tiles]: slot_ranks at the tile's slot, read when the routing was built. A
    # routing serves one step: a slot loaded or cleared since then (its rank written into
    # the same slot_ranks tensor in place) is not seen by these copies.
    tile_rank: torch.Tensor | None = None
    ranks_of: torch.Tensor | None = None  # the slot_ranks tile_rank was read from

    @property
    def seg_slots(self) -> torch.Tensor:
        """int32 [G]: the weight slot of each segment, its key ``slot * E + expert`` (made on
        each access: the kernels run over the tile map and never read it)."""
        groups = self.num_slots * self.num_experts
        return torch.arange(groups, dtype=torch.int32, device=self.seg_indptr.device)

    def tile_map(self, slot_ranks: torch.Tensor) -> TileMap:
        """The kernels' view; the tiles' ranks only if they were read from ``slot_ranks``."""
        ranks = self.tile_rank if self.ranks_of is slot_ranks else None
        return TileMap(self.tile_seg, self.tile_len, self.tile_rows, ranks)

    def __post_init__(self) -> None:
        groups = self.num_slots * self.num_experts
        if self.seg_indptr.shape != (groups + 1,):
            raise ValueError(
                f"MoeLoraRouting: seg_indptr must have shape ({groups + 1},) for "
                f"{self.num_slots} slots x {self.num_experts} experts, got {tuple(self.seg_indptr.shape)}"
            )
        tiles = tuple(self.tile_seg.shape)
        # (the kernels load a tile's rows unmasked: tile_rows must hold block_s per tile)
        for name, tensor, shape in (
            ("tile_blk", self.tile_blk, tiles),
            ("tile_len", self.tile_len, tiles),
            ("tile_rank", self.tile_rank, tiles),
            ("tile_rows", self.tile_rows, (tiles[0] * self.block_s,) if tiles else None),
        ):
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"MoeLoraRouting: {name} must have shape {shape} ({tiles[0] if tiles else '?'} "
                    f"tiles of {self.block_s} pairs), got {tuple(tensor.shape)}"
                )


@triton.jit
def _pair_key(
    pair_slot_ptr, pairs, p_mask, expert, slot_div, num_experts, groups, HAS_SLOTS: tl.constexpr
):
    """Each pair's key ``slot * E + expert``, or ``groups`` for a pair with no adapter."""
    if HAS_SLOTS:
        slot = tl.load(pair_slot_ptr + pairs // slot_div, mask=p_mask, other=-1)
        key = tl.where(slot >= 0, slot * num_experts + expert, groups)
    else:
        key = expert
    return key


@triton.jit
def _moe_lora_routing_kernel(
    pair_expert_ptr,  # int32 [P]
    pair_slot_ptr,  # int32 [P // slot_div] (read only when HAS_SLOTS; else every slot is 0)
    counts_ptr,  # int32 [G + 1] scratch (key G = no adapter)
    pair_rank_ptr,  # int32 [P] scratch: rank of the pair within its key
    tile_start_ptr,  # int32 [G] scratch: first tile of each key
    seg_indptr_ptr,  # int32 [G + 1] out
    row_order_ptr,  # int64 [P] out
    tile_seg_ptr,  # int32 [max_tiles] out, -1 = padding
    tile_blk_ptr,  # int32 [max_tiles] out
    tile_len_ptr,  # int32 [max_tiles] out (real tiles only)
    tile_rows_ptr,  # int64 [max_tiles * BLOCK_S] out (the first tile_len of each real tile)
    slot_ranks_ptr,  # int32 [num_slots] (read only when HAS_RANKS)
    tile_rank_ptr,  # int32 [max_tiles] out (real tiles, when HAS_RANKS)
    num_pairs,
    num_experts,
    groups,
    max_tiles,
    slot_div,  # pair p has the slot at p // slot_div (top-k: the slot of the pair's token)
    BLOCK_S: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    """One program: counting sort of the pairs by key = slot * E + expert (G for no adapter).

    Phases are separated by CTA barriers; every access stays on one multiprocessor. Loops are
    ``while`` loops: a runtime ``range`` bound breaks the Triton 3.6 interpreter (numpy >= 2.4)."""
    offs = tl.arange(0, BLOCK)
    g0 = 0
    while g0 < groups + 1:
        tl.store(counts_ptr + g0 + offs, 0, mask=g0 + offs <= groups)
        g0 += BLOCK
    t0 = 0
    while t0 < max_tiles:
        t_mask = t0 + offs < max_tiles
        tl.store(tile_seg_ptr + t0 + offs, -1, mask=t_mask)
        tl.store(tile_blk_ptr + t0 + offs, 0, mask=t_mask)
        t0 += BLOCK
    tl.debug_barrier()

    # Rank of each pair within its key (order within a key is unspecified: results per pair
    # do not depend on it).
    p0 = 0
    while p0 < num_pairs:
        pairs = p0 + offs
        p_mask = pairs < num_pairs
        expert = tl.load(pair_expert_ptr + pairs, mask=p_mask, other=0)
        key = _pair_key(
            pair_slot_ptr, pairs, p_mask, expert, slot_div, num_experts, groups, HAS_SLOTS
        )
        rank = tl.atomic_add(counts_ptr + key, 1, mask=p_mask)
        tl.store(pair_rank_ptr + pairs, rank, mask=p_mask)
        p0 += BLOCK
    tl.debug_barrier()

    # Exclusive prefix sums: segment starts and first tiles per key.
    seg_carry = 0
    tile_carry = 0
    g0 = 0
    while g0 < groups + 1:
        keys = g0 + offs
        g_mask = keys <= groups
        count = tl.load(counts_ptr + keys, mask=g_mask, other=0)
        tiles = tl.where(keys < groups, (count + BLOCK_S - 1) // BLOCK_S, 0)
        tl.store(seg_indptr_ptr + keys, seg_carry + tl.cumsum(count, 0) - count, mask=g_mask)
        tl.store(
            tile_start_ptr + keys, tile_carry + tl.cumsum(tiles, 0) - tiles, mask=keys < groups
        )
        seg_carry += tl.sum(count, 0)
        tile_carry += tl.sum(tiles, 0)
        g0 += BLOCK
    tl.debug_barrier()

    # Scatter: row_order[start(key) + rank] = pair, and the pair's place in its tile's rows
    # (a key's tiles are consecutive: tile_start * BLOCK_S + rank); the first pair of each
    # tile names it, counts it and gives its rank.
    p0 = 0
    while p0 < num_pairs:
        pairs = p0 + offs
        p_mask = pairs < num_pairs
        expert = tl.load(pair_expert_ptr + pairs, mask=p_mask, other=0)
        key = _pair_key(
            pair_slot_ptr, pairs, p_mask, expert, slot_div, num_experts, groups, HAS_SLOTS
        )
        rank = tl.load(pair_rank_ptr + pairs, mask=p_mask, other=0)
        start = tl.load(seg_indptr_ptr + key, mask=p_mask, other=0)
        tl.store(row_order_ptr + start + rank, pairs.to(tl.int64), mask=p_mask)
        routed = p_mask & (key < groups)
        first_tile = tl.load(tile_start_ptr + key, mask=routed, other=0)
        tl.store(tile_rows_ptr + first_tile * BLOCK_S + rank, pairs.to(tl.int64), mask=routed)
        heads = routed & (rank % BLOCK_S == 0)
        tile = first_tile + rank // BLOCK_S
        count = tl.load(counts_ptr + key, mask=heads, other=0)
        tl.store(tile_seg_ptr + tile, key, mask=heads)
        tl.store(tile_blk_ptr + tile, rank // BLOCK_S, mask=heads)
        tl.store(tile_len_ptr + tile, tl.minimum(count - rank, BLOCK_S), mask=heads)
        if HAS_RANKS:
            tile_rank = tl.load(slot_ranks_ptr + key // num_experts, mask=heads, other=0)
            tl.store(tile_rank_ptr + tile, tile_rank, mask=heads)
        p0 += BLOCK


def moe_lora_routing(
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor | None,
    num_slots: int,
    num_experts: int,
    block_s: int = MOE_BLOCK_S,
    slot_ranks: torch.Tensor | None = None,
    *,
    slot_div: int = 1,
) -> MoeLoraRouting:
    """Group the ``P`` pairs by ``(slot, expert)`` on the device: one launch, no host sync.

    Pair ``p``'s slot is ``pair_slot[p // slot_div]``: ``slot_div=1`` takes one slot per pair,
    ``slot_div=topk`` the slot of each token (pair ``p`` is token ``p // topk``), with no
    per-pair copy made first. ``pair_slot=None``: every pair is in slot 0 (the base experts'
    grouping, ``num_slots`` 1). Pairs with no adapter take the positions after
    ``seg_indptr[G]``. The order of pairs within a group is unspecified (it does not change
    any result). With ``slot_ranks`` (int32 ``[num_slots]``) each tile records its slot's rank,
    and ``moe_lora_shrink`` / ``moe_lora_expand`` given that same tensor read the rank with the
    tile instead of after it (the weights' loads then leave one round trip sooner).
    """
    fn = "moe_lora_routing"
    check_tensor(fn, "pair_expert", pair_expert, ndim=1, dtypes=(torch.int32,), contiguous=True)
    num_pairs = pair_expert.shape[0]
    if isinstance(slot_div, bool) or not isinstance(slot_div, int) or slot_div < 1:
        raise ValueError(f"{fn}: slot_div must be an int >= 1, got {slot_div!r}")
    if pair_slot is not None:
        check_tensor(
            fn,
            "pair_slot",
            pair_slot,
            ndim=1,
            dtypes=(torch.int32,),
            device=pair_expert.device,
            contiguous=True,
        )
        if pair_slot.shape[0] * slot_div != num_pairs:
            raise ValueError(
                f"{fn}: pair_slot.shape[0] * slot_div must equal the pairs in pair_expert "
                f"(one slot per {slot_div} pair(s)), got {pair_slot.shape[0]} * {slot_div} != "
                f"{num_pairs}"
            )
    elif num_slots != 1:
        raise ValueError(
            f"{fn}: pair_slot=None puts every pair in slot 0, so num_slots must be 1, "
            f"got {num_slots}"
        )
    if block_s < MIN_DOT_BLOCK or block_s & (block_s - 1):
        raise ValueError(f"{fn}: block_s must be a power of 2 >= {MIN_DOT_BLOCK}, got {block_s}")
    device = pair_expert.device
    if slot_ranks is not None:
        ranks = check_tensor(
            fn,
            "slot_ranks",
            slot_ranks,
            ndim=1,
            dtypes=(torch.int32,),
            device=device,
            contiguous=True,
        )
        check_dim(fn, "slot_ranks", ranks, 0, num_slots, "one rank per slot: num_slots")
    groups = num_slots * num_experts
    max_tiles = cdiv(num_pairs, block_s) + min(groups, num_pairs)

    counts = torch.empty(groups + 1, dtype=torch.int32, device=device)
    pair_rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    tile_start = torch.empty(max(groups, 1), dtype=torch.int32, device=device)
    seg_indptr = torch.empty(groups + 1, dtype=torch.int32, device=device)
    row_order = torch.empty(num_pairs, dtype=torch.int64, device=device)
    tile_seg = torch.empty(max_tiles, dtype=torch.int32, device=device)
    tile_blk = torch.empty(max_tiles, dtype=torch.int32, device=device)
    tile_len = torch.empty(max_tiles, dtype=torch.int32, device=device)
    tile_rows = torch.empty(max_tiles * block_s, dtype=torch.int64, device=device)
    tile_rank = (
        torch.empty(max_tiles, dtype=torch.int32, device=device) if slot_ranks is not None else None
    )
    _moe_lora_routing_kernel[(1,)](
        pair_expert,
        pair_slot if pair_slot is not None else pair_expert,
        counts,
        pair_rank,
        tile_start,
        seg_indptr,
        row_order,
        tile_seg,
        tile_blk,
        tile_len,
        tile_rows,
        slot_ranks if slot_ranks is not None else counts,
        tile_rank if tile_rank is not None else tile_len,
        num_pairs,
        num_experts,
        groups,
        max_tiles,
        slot_div,
        BLOCK_S=block_s,
        BLOCK=1024,
        HAS_RANKS=slot_ranks is not None,
        HAS_SLOTS=pair_slot is not None,
        num_warps=8,
    )
    return MoeLoraRouting(
        num_slots=num_slots,
        num_experts=num_experts,
        block_s=block_s,
        seg_indptr=seg_indptr,
        row_order=row_order,
        tile_seg=tile_seg,
        tile_blk=tile_blk,
        tile_len=tile_len,
        tile_rows=tile_rows,
        tile_rank=tile_rank,
        ranks_of=slot_ranks,
    )


def _routing_for(
    fn: str,
    routing: MoeLoraRouting | None,
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slots: int,
    num_experts: int,
) -> MoeLoraRouting:
    if routing is None:
        return moe_lora_routing(
            pair_expert, pair_slot, num_slots, num_experts, slot_ranks=slot_ranks
        )
    if not isinstance(routing, MoeLoraRouting):
        raise ValueError(
            f"{fn}: routing must be a MoeLoraRouting or None, got {type(routing).__name__}"
        )
    if (routing.num_slots, routing.num_experts) != (num_slots, num_experts):
        raise ValueError(
            f"{fn}: routing was built for {routing.num_slots} slots x {routing.num_experts} experts, "
            f"the weights have {num_slots} x {num_experts}"
        )
    if routing.row_order.shape[0] != pair_expert.shape[0]:
        raise ValueError(
            f"{fn}: routing was built for {routing.row_order.shape[0]} pairs, pair_expert has {pair_expert.shape[0]}"
        )
    return routing


def _check_pairs(
    fn: str,
    device: torch.device,
    pair_expert: object,
    pair_slot: object,
    slot_ranks: object,
    num_slots: int,
) -> None:
    pe = check_tensor(
        fn,
        "pair_expert",
        pair_expert,
        ndim=1,
        dtypes=(torch.int32,),
        device=device,
        contiguous=True,
    )
    ps = check_tensor(
        fn, "pair_slot", pair_slot, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    check_dim(fn, "pair_slot", ps, 0, pe.shape[0], "one slot per pair, like pair_expert")
    ranks = check_tensor(
        fn, "slot_ranks", slot_ranks, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    check_dim(fn, "slot_ranks", ranks, 0, num_slots, "one rank per slot of the weight buffer")


def moe_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    topk: int = 1,
    routing: MoeLoraRouting | None = None,
) -> torch.Tensor:
    """Triton ``reference.moe_lora_shrink``: ``y [P, num_slices * R]`` in pair order.

    ``lora_a [num_slots, E, num_slices * R, K]``; ``x`` has ``P // topk`` rows and pair ``p``
    reads row ``p // topk``. Pairs with slot ``-1`` get zero rows.
    """
    fn = "moe_lora_shrink"
    check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    check_interpretable(fn, "x", x)
    check_tensor(
        fn, "lora_a", lora_a, ndim=4, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True
    )
    check_same_dtype(fn, "lora_a", lora_a, "x", x.dtype)
    check_dim(fn, "lora_a", lora_a, 3, x.shape[1], "the hidden size of x")
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"{fn}: num_slices must be an int >= 1, got {num_slices!r}")
    if lora_a.shape[2] % num_slices != 0:
        raise ValueError(
            f"{fn}: lora_a.shape[2] must be num_slices * max_rank, got {lora_a.shape[2]} "
            f"which is not a multiple of num_slices={num_slices}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"{fn}: topk must be an int >= 1, got {topk!r}")
    num_slots, num_experts = lora_a.shape[0], lora_a.shape[1]
    _check_pairs(fn, x.device, pair_expert, pair_slot, slot_ranks, num_slots)
    num_pairs = pair_expert.shape[0]
    if x.shape[0] * topk != num_pairs:
        raise ValueError(
            f"{fn}: x.shape[0] * topk must equal the number of pairs, got {x.shape[0]} * {topk} != {num_pairs}"
        )
    routing = _routing_for(fn, routing, pair_expert, pair_slot, slot_ranks, num_slots, num_experts)
    return runtime_moe_shrink(x, lora_a, slot_ranks, num_slices, topk, routing, zeroed=True)


def runtime_moe_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    topk: int,
    routing: MoeLoraRouting,
    *,
    zeroed: bool = False,
) -> torch.Tensor:
    """``moe_lora_shrink`` over a ``routing`` built for these pairs, without operand checks
    (the runtime's own buffers). With ``zeroed=False`` the rows of pairs with no adapter
    (or rank 0) are left unwritten: ``runtime_moe_expand`` never reads them, and no fill
    kernel runs."""
    num_slots, num_experts = lora_a.shape[0], lora_a.shape[1]
    rank_max = lora_a.shape[2] // num_slices
    config = dataclasses.replace(
        shrink_config(routing.block_s, rank_max, x.shape[1], x.element_size()),
        block_s=routing.block_s,
        block_r=rank_block(rank_max),
    )
    weights = lora_a.view(num_slots * num_experts, lora_a.shape[2], lora_a.shape[3])
    return launch_shrink(
        x,
        weights,
        routing.row_order.shape[0],
        routing.seg_indptr,
        routing.seg_indptr,  # segment slots: not read over a tile map
        slot_ranks,
        routing.row_order,
        num_slices,
        config,
        grid_blocks=routing.tile_seg.shape[0],
        grid_segments=1,
        tile_map=routing.tile_map(slot_ranks),
        weights_per_slot=num_experts,
        x_row_div=topk,
        y_by_row=True,
        zeroed=zeroed,
    )


def moe_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    routing: MoeLoraRouting | None = None,
) -> None:
    """Triton ``reference.moe_lora_expand``: in place into ``out [P, N_total]``.

    ``lora_b [num_slots, E, N_total, R]``; pairs with slot ``-1`` are untouched.
    """
    fn = "moe_lora_expand"
    y, b, out, offsets = check_expand_operands(
        fn, y, lora_b, slot_scalings, slice_offsets, out, weight_ndim=4
    )
    num_slots, num_experts = b.shape[0], b.shape[1]
    _check_pairs(fn, y.device, pair_expert, pair_slot, slot_ranks, num_slots)
    num_pairs = pair_expert.shape[0]
    check_dim(fn, "y", y, 0, num_pairs, "one row per pair")
    check_dim(fn, "out", out, 0, num_pairs, "one row per pair")
    routing = _routing_for(fn, routing, pair_expert, pair_slot, slot_ranks, num_slots, num_experts)
    runtime_moe_expand(y, b, slot_ranks, slot_scalings, offsets, out, routing)


def runtime_moe_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    routing: MoeLoraRouting,
) -> None:
    """``moe_lora_expand`` over a ``routing`` built for these pairs, without operand checks."""
    num_slots, num_experts = lora_b.shape[0], lora_b.shape[1]
    heuristic = expand_config(routing.block_s, lora_b.shape[3], lora_b.shape[2])
    config = ExpandConfig(
        block_s=routing.block_s,
        block_r=heuristic.block_r,
        block_n=heuristic.block_n,
        num_warps=heuristic.num_warps,
    )
    weights = lora_b.view(num_slots * num_experts, lora_b.shape[2], lora_b.shape[3])
    launch_expand(
        y,
        weights,
        out,
        routing.seg_indptr,
        routing.seg_indptr,  # segment slots: not read over a tile map
        slot_ranks,
        slot_scalings,
        routing.row_order,
        slice_offsets,
        config,
        grid_blocks=routing.tile_seg.shape[0],
        grid_segments=1,
        tile_map=routing.tile_map(slot_ranks),
        weights_per_slot=num_experts,
        y_by_row=True,
    )
