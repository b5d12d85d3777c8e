"""Stage positions: adapters' A rows stacked under the base weights, so one GEMM shrinks.

A wrapper that stacks (``ColumnLoRA``/``RowLoRA`` with ``stage_slots > 0``) keeps its base
weight as the first ``N`` rows of ``stacked [N + P * n * R_max, K]`` (``n`` slices: 3 for
qkv, 2 for gate_up, else 1); the ``P`` stage positions below hold copies of some slots' A.
Positions are ``n * r`` rows each, where ``r`` (the **stage rank**) is the largest staged
adapter's rank rounded up to a power of two and to at least ``MIN_STAGE_RANK`` (16), not the
slot buffers' ``R_max``: rank-16 adapters in a pool of rank 64 cost 16 rows per slice, not 64.
The floor keeps every row of the stacked GEMM's output, and each position's ``y`` in it, 16
elements apart, which Triton needs to see to load the epilogues' base values, ``y`` and B as
16-byte vectors: at a stage rank of 8 the stacked epilogues and the rotation compiled to
element-by-element loads (PTX for sm_90, ``tests/kernels/test_vector_loads.py``). Rank-8
adapters cost 8 zero rows per slice more (the slot buffers are zero past each rank).

A decode step whose adapters all sit in stage positions runs each projection as one cuBLAS
GEMM over the first ``N + width * n * r`` rows: the base output and every staged adapter's
shrink at once, at the cost of those extra weight rows (0.1-0.8% of a Llama-3-8B projection
per position at rank 16). The expand then runs fused into the work after the projection
(``kernels/stacked.py``), reading each position's B from the stage too
(``LoRALayer.staged_b``: ``[N, r]`` per position, contiguous). A slot buffer holds the same
values in the first ``r`` of each B row's ``R_max`` columns, and read from there a rank-16
adapter's tile in rank-64 buffers spanned 4 x the memory: on an H100 the four epilogues of a
layer took 40.5 us at 48 rows over 16 positions against 27.0 from the stage, 63.2 against
41.0 over 32 (``bench/probes/stacked_width.py --slot-rank``). See ADR 0007.

``Stage`` decides the positions on the host: a slot already staged keeps its position; a new
one takes a free position, else the least recently used one that this batch does not need,
and its A rows and B are copied into every stacking wrapper (on the current stream, before
the step: never inside a graph capture). A batch with more adapters than positions is not staged
(``assign`` returns None) and runs the shrink + expand kernels instead. An adapter above the
stage rank empties the stage and restages at the larger rank (the rank never shrinks while
anything is staged). Loading or clearing a slot unstages it (``forget``), so a position never
serves another adapter's old A.

The memory is sized in positions of the slot buffers' rank (``P * n * R_max`` rows of A and
``P * R_max * N`` elements of B per projection), and a stage of a lower rank lays out more
positions in it: ``P * R_max / r``, at most the GPU
slots (``Stage.positions_at``). Rank-16 adapters in a rank-64 pool with ``P = 4`` get 16
positions, so a batch of 16 distinct adapters still shrinks in one GEMM, at no more memory.

A batch of few adapters keeps a narrow GEMM however many positions there are: its adapters
take positions below ``stage_window(count)`` (the batch's count rounded up to a power of two,
at least ``MIN_STAGE_WIDTH``), and one staged higher up is copied down into that window. So a
batch of 4 or fewer adapters computes at most 4 positions, as when the stage had 4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol


class Stacking(Protocol):
    def stage_copy(self, position: int, slot: int, rank: int) -> None:
        """Copy ``slot``'s first ``rank`` A rows of each slice into stage ``position``
        (positions ``n * rank`` rows apart), and its B's first ``rank`` columns beside them."""


# The smallest stage rank (capped at the slot buffers' rank); see the module docstring.
MIN_STAGE_RANK = 16

# The widest stage a batch of 1 to 4 adapters may compute (``stage_window``).
MIN_STAGE_WIDTH = 4

# Stage positions of the slot buffers' rank when the worker is not told (``--stage-slots``),
# capped at the GPU slots; a lower stage rank lays out more (``Stage.positions_at``). A dense
# model stacks every projection, and its stage rows cost 0.1-0.8% of a projection's bytes per
# position at rank 16 (and P * R_max * (n * K + N) elements of memory per projection, A and
# B), so it stages enough positions for every GPU slot's adapter at rank 16, at least 4 and at
# most 8: a pool of 32 slots in rank-64 buffers gets 8 (32 positions at rank 16, 2.7 GB over a
# 32-layer Llama-3-8B, 1.28 of them A), one of 16 or fewer gets 4. At 8 against 4, 32
# rank-16 adapters on 32 slots served 0.83 of the base's tokens per second against 0.72 (16
# of 32 layers, 48 clients, H100, bench/results/2026-12-06-h100-wide-stage/), and the
# worker's warm-up took 76 s against 47 (compiled kernels cached). A model with routed
# experts stacks only its attention projections: 16 positions at rank 16 are 428 MB (252 of
# them A) over Qwen3-30B-A3B's 48 layers, about a quarter of one expert LoRA slot, and took
# its 16-adapter decode steps from 0.915 / 0.912 / 0.892 / 0.853 of LoRA-off to 0.950 / 0.940
# / 0.914 / 0.872 at bs 16-128 with one adapter's unchanged (A staged, B read from the slots).
DENSE_STAGE_POSITIONS = 4
DENSE_STAGE_POSITIONS_MAX = 8
MOE_STAGE_POSITIONS = 16


def default_positions(has_experts: bool, slots: int, max_rank: int) -> int:
    """Stage positions (of rank ``max_rank``, the slot buffers') for a model when
    ``--stage-slots`` is not given, with ``slots`` GPU slots."""
    if has_experts:
        return MOE_STAGE_POSITIONS
    every_slot = -(-slots * min(max_rank, MIN_STAGE_RANK) // max_rank)
    return max(DENSE_STAGE_POSITIONS, min(DENSE_STAGE_POSITIONS_MAX, every_slot))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def stage_window(count: int, positions: int) -> int:
    """The positions a staged batch of ``count`` distinct adapters may use, out of
    ``positions``: ``count`` rounded up to a power of two, at least ``MIN_STAGE_WIDTH``."""
    return min(positions, max(MIN_STAGE_WIDTH, _pow2(count)))


def positions_at(positions: int, max_rank: int, rank: int, limit: int | None = None) -> int:
    """Stage positions of ``rank`` in memory sized for ``positions`` of ``max_rank`` (the slot
    buffers' rank), at most ``limit`` (the GPU slots)."""
    room = positions * max_rank // rank if rank else positions
    return room if limit is None else min(room, limit)


class Stage:
    """The stage shared by every stacking wrapper of one model: memory for ``positions``
    positions of ``max_rank`` (the slot buffers' rank), laid out for the current stage rank
    (``positions_at``), at most ``limit`` positions (the GPU slots; None: no cap).

    ``rank_of(slot)`` is the rank of the adapter in ``slot``."""

    def __init__(
        self,
        positions: int,
        wrappers: Iterable[Stacking],
        rank_of: Callable[[int], int],
        max_rank: int,
        limit: int | None = None,
    ) -> None:
        if positions < 0:
            raise ValueError(f"stage positions must be >= 0, got {positions}")
        self.wrappers = list(wrappers)
        self.rank_of = rank_of
        self.max_rank = max_rank
        self.full_positions = positions
        self.limit = limit
        self.rank = 0  # rows per slice of a position (0: nothing staged yet)
        first = positions_at(positions, max_rank, min(max_rank, MIN_STAGE_RANK), limit)
        self.slot_at: list[int | None] = [None] * first  # position -> staged slot
        self._last_use = [0] * first
        self._clock = 0
        self.epoch = 0  # bumped whenever a position changes what it holds
        self.copies = 0  # stage copies made (one per position filled)

    @property
    def positions(self) -> int:
        return len(self.slot_at)

    @property
    def enabled(self) -> bool:
        return self.positions > 0 and bool(self.wrappers)

    def positions_at(self, rank: int) -> int:
        """The positions a stage of ``rank`` lays out in this stage's memory."""
        return positions_at(self.full_positions, self.max_rank, rank, self.limit)

    def assign(self, slots: Sequence[int]) -> dict[int, int] | None:
        """Stage positions for the distinct ``slots`` of a batch (copying A where needed),
        or None when they do not all fit."""
        wanted = list(dict.fromkeys(slots))
        if not self.enabled or not wanted:
            return None
        need = min(self.max_rank, max(MIN_STAGE_RANK, _pow2(max(self.rank_of(s) for s in wanted))))
        empty = all(s is None for s in self.slot_at)
        restart = need > self.rank or (empty and need != self.rank)
        if len(wanted) > (self.positions_at(need) if restart else self.positions):
            return None  # (and nothing staged is dropped for it)
        if restart:
            # every staged copy is laid out for the old rank: start over at the new one
            room = self.positions_at(need)
            self.slot_at, self._last_use = [None] * room, [0] * room
            self.rank = need
            self.epoch += 1
        self._clock += 1
        window = stage_window(len(wanted), self.positions)
        where = {s: p for p, s in enumerate(self.slot_at) if s in wanted and p < window}
        for slot in wanted:
            if slot not in where:
                where[slot] = self._fill(slot, set(where.values()), window)
        for p in where.values():
            self._last_use[p] = self._clock
        return where

    def touch(self, slots: Iterable[int]) -> None:
        """``slots`` were used again without a new ``assign`` (a graph step that found its
        batch unchanged): their positions become the most recently used, so an eager step
        in between evicts another position first."""
        self._clock += 1
        for p, s in enumerate(self.slot_at):
            if s is not None and s in slots:
                self._last_use[p] = self._clock

    def _fill(self, slot: int, busy: set[int], window: int) -> int:
        """Stage ``slot`` at a position below ``window`` that the batch does not use (a free
        one, the lowest, else the least recently used), leaving any position above."""
        for p, s in enumerate(self.slot_at):
            if s == slot:  # staged past the batch's window: copied down
                self.slot_at[p] = None
        candidates = [p for p in range(window) if p not in busy]
        free = [p for p in candidates if self.slot_at[p] is None]
        if free:
            position = free[0]  # the lowest: a batch of few adapters keeps a narrow GEMM
        else:
            position = min(candidates, key=self._last_use.__getitem__)
        for w in self.wrappers:
            w.stage_copy(position, slot, self.rank)
        self.slot_at[position] = slot
        self.epoch += 1
        self.copies += 1
        return position

    def forget(self, slot: int) -> None:
        """``slot`` is being loaded or cleared: no position may keep serving its old A or B."""
        for p, s in enumerate(self.slot_at):
            if s == slot:
                self.slot_at[p] = None
                self.epoch += 1


def stage_width(positions: Iterable[int], limit: int) -> int:
    """Stage positions the stacked GEMM computes: past the highest used, a power of two (at
    most ``limit``, the positions there are), so few graph shapes cover every batch."""
    top = max(positions, default=-1) + 1
    return min(limit, _pow2(top)) if top > 0 else 0
