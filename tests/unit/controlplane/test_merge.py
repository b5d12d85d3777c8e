"""Fail-first merge (seed 002), one level above the worker."""

from __future__ import annotations

import pytest

from loraplane.controlplane.merge import UpdateResult, merge_results

pytestmark = pytest.mark.unit


def test_all_success_returns_the_first_targets_own_object() -> None:
    first = UpdateResult(True, "", {"a": "/a"})
    second = UpdateResult(True, "", {"a": "/a", "b": "/b"})
    merged = merge_results([first, second])
    assert merged is first
    merged.loaded_adapters.pop("a")  # callers mutate it in place (LRU eviction)
    assert first.loaded_adapters == {}


def test_any_failure_wins_and_takes_the_first_failed_targets_adapters() -> None:
    ok = UpdateResult(True, "", {"a": "/a", "x": "/x"})
    bad1 = UpdateResult(False, "group 1: out of memory", {"x": "/x"})
    bad2 = UpdateResult(False, "group 3: shape mismatch", {})
    merged = merge_results([ok, bad1, bad2])
    assert merged.success is False
    assert merged.error_message == "group 1: out of memory | group 3: shape mismatch"
    assert merged.loaded_adapters == {"x": "/x"}


def test_failure_on_the_last_target_is_not_reported_as_success() -> None:
    merged = merge_results(
        [UpdateResult(True), UpdateResult(True), UpdateResult(False, "rank 7 died")]
    )
    assert merged.success is False
    assert merged.error_message == "rank 7 died"


def test_messages_are_deduplicated_in_first_seen_order() -> None:
    merged = merge_results(
        [
            UpdateResult(False, "b"),
            UpdateResult(False, "a"),
            UpdateResult(False, "b"),
            UpdateResult(False, "a"),
        ]
    )
    assert merged.error_message == "b | a"


def test_a_failure_without_a_message_is_still_a_failure() -> None:
    merged = merge_results([UpdateResult(True, "", {"a": "/a"}), UpdateResult(False, "", {})])
    assert merged.success is False
    assert merged.error_message == ""
    assert merged.loaded_adapters == {}


def test_empty_messages_are_skipped_among_real_ones() -> None:
    merged = merge_results([UpdateResult(False, ""), UpdateResult(False, "boom")])
    assert merged.error_message == "boom"


def test_merging_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_results([])


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ([], "not a JSON object"),
        ({"error_message": "x"}, "'success' is not a bool"),
        ({"success": "true"}, "'success' is not a bool"),
    ],
)
def test_malformed_worker_answers_are_failures_naming_the_worker(body: object, reason: str) -> None:
    result = UpdateResult.from_json(body, origin="worker w1")
    assert result.success is False
    assert result.error_message == f"worker w1: malformed answer ({reason})"


def test_well_formed_answer_round_trips() -> None:
    body = {"success": True, "error_message": "", "loaded_adapters": {"a": "/p"}}
    assert UpdateResult.from_json(body).to_json() == body
