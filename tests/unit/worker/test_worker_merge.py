"""Fail-first merge of per-DP-group results, mirroring seed 002's test list."""

import pytest

from loraplane.worker.engine.merge import LoRAUpdateResult, merge_lora_update_results

pytestmark = pytest.mark.unit


def test_all_success_returns_first_groups_own_object() -> None:
    first = LoRAUpdateResult(True, "", {"a": "/a"})
    second = LoRAUpdateResult(True, "", {"a": "/a"})
    merged = merge_lora_update_results([first, second])
    assert merged is first
    merged.loaded_adapters.pop("a")  # callers mutate it in place
    assert first.loaded_adapters == {}


def test_any_group_failure_wins() -> None:
    ok = LoRAUpdateResult(True, "", {"a": "/a", "b": "/b"})
    bad = LoRAUpdateResult(False, "group 1: disk on fire", {"a": "/a"})
    merged = merge_lora_update_results([ok, bad])
    assert merged.success is False
    assert merged.error_message == "group 1: disk on fire"
    assert merged.loaded_adapters == {"a": "/a"}


def test_duplicate_messages_deduplicated_in_first_seen_order() -> None:
    results = [
        LoRAUpdateResult(False, "rank too big", {"x": "/x"}),
        LoRAUpdateResult(True, "", {}),
        LoRAUpdateResult(False, "shape mismatch", {"y": "/y"}),
        LoRAUpdateResult(False, "rank too big", {"z": "/z"}),
    ]
    merged = merge_lora_update_results(results)
    assert merged.error_message == "rank too big | shape mismatch"
    assert merged.loaded_adapters == {"x": "/x"}  # the first failed group's


def test_failure_without_message_is_still_a_failure() -> None:
    merged = merge_lora_update_results([LoRAUpdateResult(True, ""), LoRAUpdateResult(False, "")])
    assert merged.success is False
    assert merged.error_message == ""


def test_empty_messages_are_skipped_when_others_exist() -> None:
    merged = merge_lora_update_results(
        [LoRAUpdateResult(False, ""), LoRAUpdateResult(False, "boom")]
    )
    assert merged.error_message == "boom"


def test_no_results_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_lora_update_results([])
