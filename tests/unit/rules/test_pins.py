"""The pin limit every component applies: at most max_loras_per_batch - 1 pinned."""

from __future__ import annotations

import pytest

from loraplane.rules.pins import max_pinned, room_to_pin

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("slots", "limit"), [(1, 0), (2, 1), (4, 3)])
def test_one_slot_always_stays_for_unpinned_traffic(slots: int, limit: int) -> None:
    assert max_pinned(slots) == limit
    assert room_to_pin(limit - 1, slots) if limit else not room_to_pin(0, slots)
    assert not room_to_pin(limit, slots)
