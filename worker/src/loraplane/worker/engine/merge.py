"""Fail-first merge of per-DP-group load/unload results (DESIGN.md §3, seed 002): the rule the
control plane applies to a pool's workers too, so it lives in ``loraplane.rules.merge``; the
worker's names for it are kept here."""

from __future__ import annotations

from loraplane.rules.merge import UpdateResult as LoRAUpdateResult
from loraplane.rules.merge import merge_results as merge_lora_update_results

__all__ = ["LoRAUpdateResult", "merge_lora_update_results"]
