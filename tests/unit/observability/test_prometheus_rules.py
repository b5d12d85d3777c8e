"""deploy/prometheus/rules.yaml: promtool accepts it and its unit tests pass; every alert is tested."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "rules_test.yaml"
INSTALL_HINT = "install it with `bash scripts/prometheus.sh install` (Debian package `prometheus`)"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(f"promtool is not on PATH: {INSTALL_HINT}", pytrace=False)
    return path


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules_accepts_the_rules() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"promtool check rules failed:\n{done.stdout}\n{done.stderr}"
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout, done.stdout


def test_promtool_unit_tests_pass() -> None:
    done = subprocess.run(
        [promtool(), "test", "rules", RULES_TEST.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULES_TEST.parent,
    )
    assert done.returncode == 0, f"promtool test rules failed:\n{done.stdout}\n{done.stderr}"
    assert "SUCCESS" in done.stdout, done.stdout


def test_every_alert_has_a_promtool_case_that_expects_it_to_fire() -> None:
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    firing = {
        check["alertname"]
        for case in cases
        for check in case.get("alert_rule_test", [])
        if check.get("exp_alerts")
    }
    missing = sorted({str(rule["alert"]) for rule in alerts()} - firing)
    assert not missing, f"alerts with no promtool case that makes them fire: {missing}"


def test_every_alert_has_a_severity_summary_and_description() -> None:
    for rule in alerts():
        labels = rule.get("labels") or {}
        annotations = rule.get("annotations") or {}
        assert isinstance(labels, dict) and isinstance(annotations, dict)
        assert labels.get("severity") in {"warning", "critical"}, (rule["alert"], labels)
        assert annotations.get("summary") and annotations.get("description"), rule["alert"]
        assert str(rule["alert"]).startswith("LoRAPlane"), rule["alert"]
