"""Stage positions (lora/stage.py): which slot's A rows sit under the base weights."""

from __future__ import annotations

import pytest

from loraplane.worker.lora.stage import Stage, stage_width

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int]] = []

    def stage_copy(self, position: int, slot: int) -> None:
        self.copies.append((position, slot))


def test_a_staged_slot_keeps_its_position_and_is_not_copied_again() -> None:
    w = Recorder()
    stage = Stage(4, [w])
    assert stage.assign([3]) == {3: 0}  # the lowest free position
    assert stage.assign([3, 1]) == {3: 0, 1: 1}
    assert stage.assign([1]) == {1: 1}
    assert w.copies == [(0, 3), (1, 1)]  # one copy per slot staged, none for repeats


def test_a_full_stage_replaces_the_least_recently_used_position_the_batch_does_not_need() -> None:
    w = Recorder()
    stage = Stage(2, [w])
    stage.assign([0])
    stage.assign([1])
    stage.assign([0])  # slot 1 is now the least recently used
    assert stage.assign([0, 2]) == {0: 0, 2: 1}
    assert stage.slot_at == [0, 2]
    assert stage.assign([5, 6, 7]) is None  # more adapters than positions: not staged
    assert stage.slot_at == [0, 2]  # and nothing was evicted for it


def test_forgetting_a_reloaded_slot_restages_it() -> None:
    w = Recorder()
    stage = Stage(2, [w])
    stage.assign([4])
    epoch = stage.epoch
    stage.forget(4)  # the slot got another adapter: its old A must not be served
    assert stage.epoch > epoch and stage.slot_at == [None, None]
    assert stage.assign([4]) == {4: 0}
    assert w.copies == [(0, 4), (0, 4)]


def test_no_positions_or_no_stacking_wrapper_disables_staging() -> None:
    assert Stage(0, [Recorder()]).assign([0]) is None
    assert Stage(4, []).assign([0]) is None
    with pytest.raises(ValueError, match="stage positions must be >= 0, got -1"):
        Stage(-1, [])


def test_the_gemm_width_is_a_power_of_two_past_the_highest_position() -> None:
    assert stage_width([0], 4) == 1
    assert stage_width([1], 4) == 2
    assert stage_width([0, 2], 4) == 4
    assert stage_width([4], 6) == 6  # never past the positions there are
    assert stage_width([], 4) == 0
