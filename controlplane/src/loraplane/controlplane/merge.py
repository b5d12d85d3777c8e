"""Fail-first merge of load/unload results, one level above the worker: the rule is shared
with the worker and lives in ``loraplane.rules.merge``."""

from __future__ import annotations

from loraplane.rules.merge import SEPARATOR, UpdateResult, merge_results

__all__ = ["SEPARATOR", "UpdateResult", "merge_results"]
