"""What the control plane records for an eviction's victim after a load told a worker to
evict it (``operations._victim_outcome``): what the worker answered, or reports when asked."""

from __future__ import annotations

import pytest

from loraplane.controlplane.operations import _victim_outcome
from loraplane.controlplane.workers import Observation
from loraplane.rules.merge import UpdateResult

pytestmark = pytest.mark.unit


def seen(*groups: set[str], inconsistent: frozenset[str] = frozenset()) -> Observation:
    held = frozenset().union(*groups)
    return Observation("base", held, tuple(frozenset(g) for g in groups), inconsistent)


def test_a_load_that_succeeded_evicted_what_its_answer_no_longer_lists() -> None:
    loaded = UpdateResult(True, "", {"new": "/a/new", "keep": "/a/keep"})
    assert _victim_outcome("old", loaded, None, 2) == "evicted"
    # the worker held the new adapter already (the registry had drifted): nothing evicted
    assert _victim_outcome("keep", loaded, None, 2) == "kept"


def test_after_a_failed_load_the_worker_is_asked() -> None:
    failed = UpdateResult(False, "lora_path: cannot be read", {"old": "/a/old"})
    assert _victim_outcome("old", failed, seen({"old"}, {"old"}), 2) == "kept"
    assert _victim_outcome("old", failed, seen(set(), set()), 2) == "evicted"
    # on one DP group only, or half unloaded: the reconciler looks
    assert _victim_outcome("old", failed, seen({"old"}, set()), 2) == "unknown"
    gone_but_flagged = seen(set(), set(), inconsistent=frozenset({"old"}))
    assert _victim_outcome("old", failed, gone_but_flagged, 2) == "unknown"
    # the worker did not answer
    assert _victim_outcome("old", failed, None, 2) == "unknown"
