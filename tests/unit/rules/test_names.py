"""Names: the control plane's adapter labels and the name it sends a worker, which the
worker's load request must accept."""

from __future__ import annotations

import re

import pytest

from loraplane.rules.names import LORA_NAME_PATTERN, is_dns_label, lora_name

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", "trail-", "a_b", "a.b", "x" * 64, None])
def test_a_label_is_dns_1123(bad: object) -> None:
    assert not is_dns_label(bad)
    assert is_dns_label("team-a") and is_dns_label("x" * 63)


@pytest.mark.parametrize(("namespace", "version"), [("default", 1), ("team-a", 1), ("t", 12)])
def test_every_name_the_control_plane_sends_is_one_a_worker_accepts(
    namespace: str, version: int
) -> None:
    name = lora_name(namespace, "sql-9", version)
    assert re.match(LORA_NAME_PATTERN, name), name
