"""Test-only fault injection: make a chosen DP group fail its next loads or unloads.

Off unless the worker is started with `--enable-fault-injection`.
"""

from __future__ import annotations

import threading


class FaultInjector:
    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self._armed: dict[tuple[str, int], tuple[int, str]] = {}
        self._lock = threading.Lock()

    def arm(self, op: str, dp_group: int, count: int, message: str) -> None:
        if op not in ("load", "unload"):
            raise ValueError(f"op must be 'load' or 'unload', got {op!r}")
        if not 0 <= dp_group < self.dp_size:
            raise ValueError(f"dp_group must be in 0..{self.dp_size - 1}, got {dp_group}")
        with self._lock:
            if count == 0:
                self._armed.pop((op, dp_group), None)
            else:
                self._armed[(op, dp_group)] = (count, message)

    def take(self, op: str, dp_group: int) -> str | None:
        """The failure message for this op on this group, consuming one armed failure; None: no fault."""
        with self._lock:
            armed = self._armed.get((op, dp_group))
            if armed is None:
                return None
            count, message = armed
            if count <= 1:
                del self._armed[(op, dp_group)]
            else:
                self._armed[(op, dp_group)] = (count - 1, message)
            return message

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {
                f"{op}/{g}": {"count": c, "message": m} for (op, g), (c, m) in self._armed.items()
            }
