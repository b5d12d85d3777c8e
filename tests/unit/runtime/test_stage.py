"""Stage positions (lora/stage.py): which slot's A rows sit under the base weights."""

from __future__ import annotations

import pytest

from loraplane.worker.lora import extents
from loraplane.worker.lora.stage import Stage, default_positions, positions_at, stage_width

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int]] = []
        self.ranks: list[int] = []

    def stage_copy(self, position: int, slot: int, rank: int) -> None:
        self.copies.append((position, slot))
        self.ranks.append(rank)


RANKS = {0: 16, 1: 8, 2: 16, 3: 4, 4: 16, 5: 16, 6: 16, 7: 16, 9: 33}


def make(positions: int, *wrappers: Recorder, max_rank: int = 16) -> Stage:
    return Stage(positions, wrappers, RANKS.__getitem__, max_rank=max_rank)


def test_a_staged_slot_keeps_its_position_and_is_not_copied_again() -> None:
    w = Recorder()
    stage = make(4, w)
    assert stage.assign([2]) == {2: 0}  # the lowest free position
    assert stage.assign([2, 0]) == {2: 0, 0: 1}
    assert stage.assign([0]) == {0: 1}
    assert w.copies == [(0, 2), (1, 0)]  # one copy per slot staged, none for repeats


def test_a_full_stage_replaces_the_least_recently_used_position_the_batch_does_not_need() -> None:
    w = Recorder()
    stage = make(2, w)
    stage.assign([0])
    stage.assign([1])
    stage.assign([0])  # slot 1 is now the least recently used
    assert stage.assign([0, 2]) == {0: 0, 2: 1}
    assert stage.slot_at == [0, 2]
    assert stage.assign([5, 6, 7]) is None  # more adapters than positions: not staged
    assert stage.slot_at == [0, 2]  # and nothing was evicted for it


def test_a_touched_slot_is_not_the_one_evicted() -> None:
    """A graph step that reuses its batch's metadata touches its positions (no assign), so an
    eager batch in between evicts a position that neither of them uses."""
    w = Recorder()
    stage = make(2, w)
    stage.assign([0])
    stage.assign([1])
    stage.touch([0])  # slot 0's graph ran again; slot 1 is now the least recently used
    assert stage.assign([2]) == {2: 1}
    assert stage.slot_at == [0, 2]
    stage.touch([7])  # a slot not staged: nothing happens to the positions
    assert stage.slot_at == [0, 2]


def test_forgetting_a_reloaded_slot_restages_it() -> None:
    w = Recorder()
    stage = make(2, w)
    stage.assign([4])
    epoch = stage.epoch
    stage.forget(4)  # the slot got another adapter: its old A must not be served
    assert stage.epoch > epoch and stage.slot_at == [None, None]
    assert stage.assign([4]) == {4: 0}
    assert w.copies == [(0, 4), (0, 4)]


def test_no_positions_or_no_stacking_wrapper_disables_staging() -> None:
    assert make(0, Recorder()).assign([0]) is None
    assert make(4).assign([0]) is None
    with pytest.raises(ValueError, match="stage positions must be >= 0, got -1"):
        make(-1)


def test_positions_are_laid_out_for_the_staged_adapters_rank_not_the_buffers() -> None:
    """Rank-4 and rank-8 adapters in rank-64 slot buffers: positions of 16 rows per slice (the
    floor that keeps the stacked output 16-element aligned); a rank-33 adapter restages
    everything at 64; once the stage empties, the rank can fall."""
    w = Recorder()
    stage = make(4, w, max_rank=64)
    assert stage.assign([3, 1]) == {3: 0, 1: 1} and stage.rank == 16
    assert stage.positions == 16  # memory for 4 positions of rank 64 holds 16 of rank 16
    assert w.ranks == [16, 16]
    assert stage.assign([9]) == {9: 0}  # rank 33: the old copies are laid out for 16
    assert stage.rank == 64 and stage.slot_at == [9, None, None, None]
    assert stage.assign([3]) == {3: 1} and w.ranks[-1] == 64  # the stage rank stays 64
    stage.forget(9)
    stage.forget(3)
    assert stage.assign([0]) == {0: 0} and stage.rank == 16
    # Slot buffers of rank 8 cap the floor: a rank-4 adapter stages at 8.
    small = Stage(4, [Recorder()], RANKS.__getitem__, max_rank=8)
    assert small.assign([3]) == {3: 0} and small.rank == 8


def test_a_lower_stage_rank_lays_out_more_positions_up_to_the_gpu_slots() -> None:
    """Memory for 2 positions of rank 64: 8 of rank 16, 4 of rank 32, never more than the
    slots; a batch that fits only the lower rank's positions is not staged at the higher
    one, and nothing staged is dropped for it."""
    assert positions_at(2, 64, 16) == 8 and positions_at(2, 64, 32) == 4
    assert positions_at(2, 64, 16, limit=6) == 6 and positions_at(2, 64, 64) == 2
    ranks = dict.fromkeys(range(8), 16) | {20: 32}
    stage = Stage(2, [Recorder()], ranks.__getitem__, max_rank=64, limit=6)
    assert stage.positions == 6
    six = stage.assign(list(range(6)))
    assert six is not None and sorted(six.values()) == list(range(6))
    assert stage.assign(list(range(7))) is None  # past the slots' cap
    before = list(stage.slot_at)
    assert stage.assign([20, 0, 1, 2, 3]) is None  # rank 32: 4 positions, 5 adapters
    assert stage.slot_at == before and stage.rank == 16
    assert stage.assign([20, 0]) is not None and stage.rank == 32 and stage.positions == 4


def test_a_batch_of_few_adapters_stays_within_four_positions() -> None:
    """With 16 positions, a batch of up to 4 adapters computes at most 4 (its adapters are
    copied down when staged higher up), and 8 adapters at most 8: the GEMM's width follows
    the batch, not the history of the stage."""
    w = Recorder()
    stage = make(16, w)
    wide = stage.assign(list(range(8)))  # slots 0..7 at positions 0..7
    assert wide is not None and max(wide.values()) == 7
    w.copies.clear()
    late = stage.assign([6, 7])  # staged at 6 and 7: past a 2-adapter batch's window of 4
    assert late is not None and all(p < 4 for p in late.values())
    assert stage_width(late.values(), stage.positions) <= 4
    assert sorted(slot for _, slot in w.copies) == [6, 7]  # copied down, once each
    assert stage.slot_at.count(6) == 1 and stage.slot_at.count(7) == 1
    again = stage.assign([6, 7])
    assert again == late and len(w.copies) == 2  # now in place: no copies
    eight = stage.assign([0, 1, 2, 3, 4, 5, 6, 7])
    assert eight is not None and max(eight.values()) < 8


def test_the_gemm_width_is_a_power_of_two_past_the_highest_position() -> None:
    assert stage_width([0], 4) == 1
    assert stage_width([1], 4) == 2
    assert stage_width([0, 2], 4) == 4
    assert stage_width([4], 6) == 6  # never past the positions there are
    assert stage_width([], 4) == 0


def test_the_gemm_reads_a_wider_extent_only_where_the_gpu_table_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h200 = "NVIDIA H200"
    # o_proj-shaped at 32 rows: the table reads 384 rows past N instead of the 16 needed
    assert extents.extent_for(h200, 4096, 4096, 16, 32, available=512) == 384
    assert extents.extent_for(h200, 4096, 4096, 16, 32, available=300) == 16  # not allocated
    assert extents.extent_for(h200, 4096, 4096, 16, 16, available=512) == 16  # 16 rows: none
    assert extents.extent_for(h200, 4096, 4096, 16, 64, available=512) == 16  # no entry
    assert extents.extent_for(h200, 14336, 4096, 64, 32, available=128) == 128  # down_proj
    assert extents.extent_for(h200, 4096, 6144, 48, 32, available=512) == 48  # qkv: none
    assert extents.extent_for("NVIDIA A100", 4096, 4096, 16, 32, available=512) == 16
    assert extents.extent_for("", 4096, 4096, 16, 32, available=512) == 16  # CPU
    monkeypatch.setattr(extents, "ENABLED", False)
    assert extents.extent_for(h200, 4096, 4096, 16, 32, available=512) == 16


def test_a_stacked_weight_is_padded_for_the_widest_extent_of_its_own_needs() -> None:
    h200 = "NVIDIA H200"
    # 4 positions x rank 16 of o_proj: needs up to 64, whose extent is 384 rows
    assert extents.pad_rows(h200, 4096, 4096, stage_rows=64) == 384 - 64
    # down_proj: 128 rows for needs up to 64; none past a stage of 128 rows
    assert extents.pad_rows(h200, 14336, 4096, stage_rows=64) == 128 - 64
    assert extents.pad_rows(h200, 14336, 4096, stage_rows=256) == 0
    assert extents.pad_rows(h200, 4096, 6144, stage_rows=192) == 0  # qkv: no entry
    assert extents.pad_rows("", 4096, 4096, stage_rows=64) == 0


@pytest.mark.parametrize(
    ("experts", "slots", "rank", "want"),
    [
        (False, 32, 64, 8),  # every slot at rank 16: 32 positions
        (False, 64, 64, 8),  # at most 8 of the buffers' rank
        (False, 16, 64, 4),  # at least 4
        (False, 4, 64, 4),
        (False, 6, 16, 6),  # rank-16 buffers: a position per slot
        (False, 32, 8, 8),  # buffers below rank 16: a position per slot, at most 8
        (True, 32, 64, 16),  # routed experts: only attention stacks
        (True, 4, 16, 16),
    ],
)
def test_a_dense_models_default_stage_covers_its_slots_at_rank_16(
    experts: bool, slots: int, rank: int, want: int
) -> None:
    assert default_positions(experts, slots, rank) == want
