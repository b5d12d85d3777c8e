"""Fail-first merge of load/unload results: a worker merges its DP groups' answers, the
control plane its workers' answers, with the same rule:

- every target succeeded -> the first target's own result object, unchanged (callers may
  mutate its ``loaded_adapters`` in place, so a copy would silently break them);
- any target failed -> ``success=False``, the failed targets' error messages de-duplicated in
  first-seen order and joined with ``" | "``, and ``loaded_adapters`` from the first failed
  target. A failure without a message is still a failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SEPARATOR = " | "


@dataclass(slots=True)
class UpdateResult:
    """What a target answers to a load or unload (a worker's ``/load_lora_adapter`` body)."""

    success: bool
    error_message: str = ""
    # adapter name -> path, as the target holds them after the operation
    loaded_adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.success, bool):
            raise TypeError(f"success must be a bool, got {type(self.success).__name__}")

    @classmethod
    def from_json(cls, body: Any, *, origin: str = "worker") -> UpdateResult:
        """Parse a worker's JSON answer; anything malformed is a failure naming ``origin``."""
        if not isinstance(body, Mapping):
            return cls(False, f"{origin}: malformed answer (not a JSON object)")
        success = body.get("success")
        if not isinstance(success, bool):
            return cls(False, f"{origin}: malformed answer ('success' is not a bool)")
        message = body.get("error_message") or ""
        adapters = body.get("loaded_adapters") or {}
        if not isinstance(adapters, Mapping):
            adapters = {}
        return cls(success, str(message), {str(k): str(v) for k, v in adapters.items()})

    def to_json(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "error_message": self.error_message,
            "loaded_adapters": dict(self.loaded_adapters),
        }


def merge_results(results: Sequence[UpdateResult]) -> UpdateResult:
    """Merge the results of one fan-out, fail-first. ``results`` must not be empty."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    failed = [result for result in results if not result.success]
    if not failed:
        return results[0]
    messages = list(dict.fromkeys(r.error_message for r in failed if r.error_message))
    return UpdateResult(
        success=False,
        error_message=SEPARATOR.join(messages),
        loaded_adapters=failed[0].loaded_adapters,
    )
