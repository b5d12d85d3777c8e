"""Per-forward LoRA metadata: which rows use which adapter slot.

Tokens are grouped into segments of rows that share a slot. Rows with no adapter belong
to no segment, so they cost no LoRA work and their outputs are never touched. `row_order`
lists the segments' rows (tokens sorted by slot, stably, so the order inside a slot is the
batch order), and the kernels gather them through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from loraplane.worker.kernels._triton_utils import (
    ROWS_KERNEL_MIN,
    TILE_WORDS,
    StageInfo,
    cdiv,
    segment_block,
    stage_tile_capacity,
    stage_tiles,
)
from loraplane.worker.models.batch import upload

NO_ADAPTER = -1
# Segments longer than this run in row blocks of 64 (``segment_block``): a grid of every
# segment times the longest one's blocks is then mostly empty programs when short segments
# (decodes) sit beside long ones (prompt chunks), so the kernels run over ``segment_tiles``.
TILED_SEG_LEN = 32
# The block of a padding tile: past any segment's rows, so its programs have none.
PAD_BLOCK = 1 << 20
# int32 entries of 16 bytes: where each part of ``StaticLoRABatch``'s packed buffer starts
_ALIGN = 4


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


Segments = tuple[list[int], list[int], list[int]]  # segments_of's (order, indptr, slots)


def segments_of(token_slots: Sequence[int]) -> Segments:
    """Rows with an adapter sorted by slot (stable), segment bounds into them, segment slots."""
    order = sorted(
        (i for i, s in enumerate(token_slots) if s != NO_ADAPTER), key=lambda i: token_slots[i]
    )
    indptr = [0]
    slots: list[int] = []
    for j, i in enumerate(order):
        if not slots or token_slots[i] != slots[-1]:
            if slots:
                indptr.append(j)
            slots.append(token_slots[i])
    if order:
        indptr.append(len(order))
    return order, indptr, slots


def segment_tiles(indptr: Sequence[int], block: int, capacity: int | None = None) -> list[int]:
    """The (segment, row block) pairs that hold rows, segments first then blocks (the int32
    ``[2, n]`` layout the kernels read), for segments ``indptr`` in blocks of ``block`` rows;
    padded to ``capacity`` pairs with (0, ``PAD_BLOCK``)."""
    segs: list[int] = []
    blocks: list[int] = []
    for seg, (start, end) in enumerate(pairwise(indptr)):
        for blk in range(cdiv(end - start, block)):
            segs.append(seg)
            blocks.append(blk)
    if capacity is not None:
        if len(segs) > capacity:
            raise ValueError(f"{len(segs)} segment tiles do not fit a capacity of {capacity}")
        pad = capacity - len(segs)
        segs += [0] * pad
        blocks += [PAD_BLOCK] * pad
    return segs + blocks


def tile_capacity(rows: int, segments: int, block: int) -> int:
    """The most (segment, block) pairs ``segments`` segments of ``rows`` rows in all need."""
    return cdiv(rows, block) + segments


@dataclass(slots=True)
class LoRABatchInfo:
    token_slots: torch.Tensor  # int32 [T]: slot per row, -1 = no adapter
    seg_indptr: torch.Tensor  # int32 [S+1]
    seg_slots: torch.Tensor  # int32 [S]
    row_order: torch.Tensor | None  # int64 [rows in segments]; None = rows are 0..n-1 in order
    # (``build`` always gives it)
    slot_ranks: torch.Tensor  # int32 [K]
    slot_scalings: torch.Tensor  # float32 [K]
    seg_ranks: torch.Tensor  # int32 [S]: slot_ranks[seg_slots], gathered once per forward
    seg_scalings: torch.Tensor  # float32 [S]: slot_scalings[seg_slots]
    max_seg_len: int  # a bound on the rows of any segment (the launch grids use it)
    num_rows: int
    num_lora_rows: int
    # Staged batches (lora/stage.py): every row's stage position, for the stacked GEMMs.
    stage: StageInfo | None = None
    # A staged batch's GEMM runs as the base GEMM and the stage rows' GEMM apart, so rows
    # without an adapter get the LoRA-off step's bits (eager steps; graphs run one GEMM).
    exact_base: bool = False
    # int32 [2, n]: the shrink's and expand's programs as (segment, row block) pairs
    # (``segment_tiles``), when segments past TILED_SEG_LEN rows sit beside others
    seg_tiles: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int],
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        device: torch.device | str,
        segments: Segments | None = None,
    ) -> LoRABatchInfo | None:
        """Segments for `token_slots`, or None when no row has an adapter (base path).
        ``segments``: ``segments_of(token_slots)`` when the caller has it already."""
        order, indptr, slots = segments or segments_of(token_slots)
        if not order:
            return None
        lens = [b - a for a, b in pairwise(indptr)]
        seg_slots = upload(torch.tensor(slots, dtype=torch.int32), device)
        longest = max(lens)
        seg_tiles = None
        if longest > TILED_SEG_LEN and len(slots) > 1:
            tiles = segment_tiles(indptr, segment_block(longest))
            seg_tiles = upload(torch.tensor(tiles, dtype=torch.int32).view(2, -1), device)
        return cls(
            token_slots=upload(torch.tensor(list(token_slots), dtype=torch.int32), device),
            seg_indptr=upload(torch.tensor(indptr, dtype=torch.int32), device),
            seg_slots=seg_slots,
            # (given even when it is 0..n-1: the kernels then compile one variant, the one
            # the decode graphs' static batches use, whether a step has rows without an
            # adapter or not; the gather costs one index load per row)
            row_order=upload(torch.tensor(order, dtype=torch.int64), device),
            slot_ranks=slot_ranks,
            slot_scalings=slot_scalings,
            seg_ranks=slot_ranks.index_select(0, seg_slots),
            seg_scalings=slot_scalings.index_select(0, seg_slots),
            max_seg_len=longest,
            num_rows=len(token_slots),
            num_lora_rows=len(order),
            seg_tiles=seg_tiles,
        )

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.numel())


def static_shape(segments: Segments, rows: int) -> tuple[int, int]:
    """(segment count, max segment length) bounds of a graph that can run ``segments``.

    Powers of two of the distinct adapters (1, 2, 4, ...), and the kernels' row-block classes
    of the longest segment (16, 32, else ``rows``): few graphs per batch size, and grids close
    to what the eager step would launch for the same batch.
    """
    _, indptr, slots = segments
    count = 1 << max(0, len(slots) - 1).bit_length()
    longest = max((b - a for a, b in pairwise(indptr)), default=1)
    seg_len = 16 if longest <= 16 else 32 if longest <= 32 else rows
    return min(count, rows), min(seg_len, rows)


class StaticLoRABatch:
    """LoRA batch info in fixed device buffers, refilled in place: what a CUDA graph captures.

    A captured decode step cannot take new tensors or new launch grids, so every shape here is
    fixed: ``rows`` token slots, ``segments`` segments (unused ones are empty: their
    ``seg_indptr`` bounds are equal, so the kernels' programs for them return at once), a
    ``row_order`` of ``rows`` positions (always given, so the kernels gather rows whatever the
    batch order) and ``max_seg_len``, the bound on any segment's rows that sizes the shrink's
    and expand's grids. A staged graph (``stage_width > 0``) also gets each row's stage
    position and each position's slot and scaling (``StageInfo``), and below
    ``ROWS_KERNEL_MIN`` rows the rows grouped by position in tiles
    (``stage_tiles``, every row of the graph among them): the epilogues' grids are the
    tile capacity (or the row blocks) only. ``fill`` writes one step's values with two host-to-device
    copies (pinned memory on CUDA), each segment's rank and scaling among them: the captured step gathers nothing (an
    ``index_select`` per value was three launches, ~6 us of a Llama-3-8B-shaped 8-layer step
    on an H200 at 32 rows), so a LoRA graph launches no more kernels than
    the LoRA-off graph besides the ones that do LoRA math.
    """

    def __init__(
        self,
        rows: int,
        segments: int,
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        device: torch.device,
        max_seg_len: int | None = None,
        stage_width: int = 0,
        stage_rank: int = 0,
        pinned: bool = True,
        exact_base: bool = False,
    ) -> None:
        self.rows = rows
        self.segments = max(1, segments)
        self.max_seg_len = max_seg_len or rows
        self.slot_ranks = slot_ranks
        self.slot_scalings = slot_scalings
        self.stage_width = stage_width  # > 0: the batch is staged (StageInfo in `info`)
        self.stage_rank = stage_rank  # y columns per slice of a stage position
        self.exact_base = exact_base  # LoRABatchInfo.exact_base
        # Pinned host buffers make fill's copies asynchronous: the caller must not refill
        # before the last copies ran (graphs.py waits on an event); pageable ones copy
        # before fill returns.
        pin = pinned and device.type == "cuda"
        s, w = self.segments, stage_width
        # token_slots [rows] | seg_indptr [S + 1] | seg_slots [S] | seg_ranks [S] |
        # seg_scalings [S] (float32 bits), and when staged row_pos [rows] | pos_slots [W] |
        # pos_scalings [W] (float32 bits): one buffer and one host-to-device copy (row_order is
        # the other); the scalings are float32 views.
        # Each part starts 16 bytes in (``_ALIGN`` entries): Triton compiles a kernel apart
        # for a pointer that is not 16-byte aligned, and an eager staged batch's ``rows`` is
        # its own row count, so packed back to back the parts' alignment would follow it.
        staged_rows = rows if w else 0
        # segments past TILED_SEG_LEN rows beside others: the kernels run over segment tiles
        # (``segment_tiles``), as many as the most this batch's rows can need
        tiled = self.max_seg_len > TILED_SEG_LEN and s > 1
        self.tile_block = segment_block(self.max_seg_len)
        self.tile_cap = tile_capacity(rows, s, self.tile_block) if tiled else 0
        # a staged batch below ``ROWS_KERNEL_MIN`` rows: its rows by stage position,
        # in tiles (``stage_tiles``), which the epilogues' programs take one each
        self.stage_tile_cap = stage_tile_capacity(rows, w) if w and rows < ROWS_KERNEL_MIN else 0
        sizes = [
            *(rows, s + 1, s, s, s, staged_rows, w, w, 2 * self.tile_cap),
            self.stage_tile_cap * TILE_WORDS,
        ]
        spans = [_aligned(n) for n in sizes]
        self._ints = torch.zeros(sum(spans), dtype=torch.int32, device=device)
        self._ints_host = torch.zeros(sum(spans), dtype=torch.int32, pin_memory=pin)
        # the adapter rows by segment, then zeros (the shrink and expand read only the prefix)
        self.row_order = torch.zeros(rows, dtype=torch.int64, device=device)
        self._order_host = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        views = [v[:n] for v, n in zip(self._ints.split(spans), sizes, strict=True)]
        self.token_slots, self.seg_indptr, self.seg_slots, self.seg_ranks = views[:4]
        self.seg_scalings = views[4].view(torch.float32)
        self.row_pos, self.pos_slots = views[5], views[6]
        self.pos_scalings = views[7].view(torch.float32)
        self.seg_tiles = views[8].view(2, self.tile_cap) if tiled else None
        self.stage_tiles = views[9] if self.stage_tile_cap else None

    def fill(
        self,
        token_slots: Sequence[int],
        segments: Segments | None = None,
        positions: dict[int, int] | None = None,
        slot_values: tuple[Sequence[int], Sequence[float]] | None = None,
    ) -> None:
        """This step's slots (``len <= rows``; rows past the batch get no adapter).

        ``segments``: ``segments_of(token_slots)`` when the caller has it already.
        ``positions``: each slot's stage position (``Stage.assign``), for a staged graph.
        ``slot_values``: every slot's rank and scaling on the host, as ``slot_ranks`` and
        ``slot_scalings`` hold them (the runtime passes ``LoRAManager.slot_values()``); left
        out, they are read back from those tensors."""
        n = len(token_slots)
        if n > self.rows:
            raise ValueError(f"a batch of {n} rows does not fit a graph of {self.rows} rows")
        order, indptr, slots = segments or segments_of(token_slots)
        if len(slots) > self.segments:
            raise ValueError(
                f"{len(slots)} adapters in a batch of {n} rows; the graph has {self.segments} segments"
            )
        longest = max(b - a for a, b in pairwise(indptr)) if slots else 0
        if longest > self.max_seg_len:
            raise ValueError(
                f"a segment of {longest} rows; the graph's segments hold at most {self.max_seg_len}"
            )
        if self.stage_width:
            if positions is None or any(s not in positions for s in slots):
                raise ValueError(
                    f"positions must give a stage position for every slot of a staged batch "
                    f"(slots {slots}, positions {positions})"
                )
            if any(not 0 <= positions[s] < self.stage_width for s in slots):
                raise ValueError(
                    f"positions must lie in 0..{self.stage_width - 1} (the graph's stage "
                    f"width), got {positions}"
                )
        pad = self.segments - len(slots)
        if slot_values is None:
            slot_values = (self.slot_ranks.tolist(), self.slot_scalings.tolist())
        ranks, scalings = slot_values
        padded = [*slots, *[0] * pad]  # padding segments are empty (and read slot 0)
        floats = [scalings[s] for s in padded]
        parts: list[list[int]] = [
            [*token_slots, *[NO_ADAPTER] * (self.rows - n)],
            [*indptr, *[len(order)] * pad],
            padded,
            [ranks[s] for s in padded],
            _bits(floats),
        ]
        if self.stage_width:
            assert positions is not None
            at = {positions[s]: s for s in slots}  # the positions this batch reads
            if len(at) != len(slots):
                raise ValueError(
                    f"positions must give each slot of the batch its own stage position, got "
                    f"{ {s: positions[s] for s in slots} }"
                )
            row_pos = [positions[s] if s != NO_ADAPTER else -1 for s in token_slots]
            row_pos += [-1] * (self.rows - n)
            # the epilogues read position p's B at p of the stage's (``staged_b``)
            pos_slots = [p if p in at else -1 for p in range(self.stage_width)]
            pos_bits = _bits([scalings[at[p]] if p in at else 0.0 for p in range(self.stage_width)])
            parts += [row_pos, pos_slots, pos_bits]
        else:
            parts += [[], [], []]
        parts.append(segment_tiles(indptr, self.tile_block, self.tile_cap) if self.tile_cap else [])
        if self.stage_tile_cap:  # (every row of the graph, the padding rows with the base's)
            parts.append(stage_tiles(row_pos, pos_slots, pos_bits, self.stage_tile_cap))
        ints = [v for part in parts for v in (*part, *[0] * (_aligned(len(part)) - len(part)))]
        self._ints_host.copy_(torch.tensor(ints, dtype=torch.int32))
        self._order_host.copy_(torch.tensor(order + [0] * (self.rows - len(order))))
        self._ints.copy_(self._ints_host, non_blocking=True)
        self.row_order.copy_(self._order_host, non_blocking=True)

    def info(self) -> LoRABatchInfo:
        """The batch info over these buffers (views: nothing is computed on the device)."""
        return LoRABatchInfo(
            token_slots=self.token_slots,
            seg_indptr=self.seg_indptr,
            seg_slots=self.seg_slots,
            row_order=self.row_order,
            slot_ranks=self.slot_ranks,
            slot_scalings=self.slot_scalings,
            seg_ranks=self.seg_ranks,
            seg_scalings=self.seg_scalings,
            max_seg_len=self.max_seg_len,
            num_rows=self.rows,
            num_lora_rows=self.rows,  # an upper bound: the count lives on the device
            stage=self._stage_info() if self.stage_width else None,
            exact_base=self.exact_base,
            seg_tiles=self.seg_tiles,
        )

    def _stage_info(self) -> StageInfo:
        return StageInfo(
            row_pos=self.row_pos,
            pos_slots=self.pos_slots,
            pos_scalings=self.pos_scalings,
            width=self.stage_width,
            rank=self.stage_rank,
            tiles=self.stage_tiles,
        )


def _bits(values: Sequence[float]) -> list[int]:
    """float32 values as the int32 words that hold their bits."""
    bits: list[int] = torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()
    return bits
