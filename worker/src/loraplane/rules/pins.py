"""The pin limit: at most ``max_loras_per_batch - 1`` adapters pinned per worker (or DP group),
so one GPU slot always remains for unpinned traffic."""

from __future__ import annotations

RULE = "at most max_loras_per_batch - 1"


def max_pinned(max_loras_per_batch: int) -> int:
    """How many adapters may be pinned at once where ``max_loras_per_batch`` slots exist."""
    return max(max_loras_per_batch - 1, 0)


def room_to_pin(already_pinned: int, max_loras_per_batch: int) -> bool:
    """Whether one more adapter may be pinned beside ``already_pinned`` others."""
    return already_pinned + 1 <= max_pinned(max_loras_per_batch)
