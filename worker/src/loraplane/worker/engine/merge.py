"""Fail-first merge of per-DP-group load/unload results (DESIGN.md §3, seed 002).

Pure Python: the same rule merges a worker's DP groups here and a pool's workers in the
control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class LoRAUpdateResult:
    """What one target (a DP group) answers to a load or unload."""

    success: bool
    error_message: str = ""
    # adapter name -> path, as the target holds them after the operation
    loaded_adapters: dict[str, str] = field(default_factory=dict)


def merge_lora_update_results(results: Sequence[LoRAUpdateResult]) -> LoRAUpdateResult:
    """Merge the answers of every target; success only if every target succeeded.

    All succeeded: the first target's own result object, unchanged (callers mutate its
    `loaded_adapters` in place). Any failure: `success=False`, the failed targets' messages
    de-duplicated in first-seen order and joined with " | ", and `loaded_adapters` of the first
    failed target. A failure with no message is still a failure.
    """
    if not results:
        raise ValueError("results must hold at least one target's answer")
    failed = [r for r in results if not r.success]
    if not failed:
        return results[0]
    messages = list(dict.fromkeys(r.error_message for r in failed if r.error_message))
    return LoRAUpdateResult(
        success=False,
        error_message=" | ".join(messages),
        loaded_adapters=failed[0].loaded_adapters,
    )
