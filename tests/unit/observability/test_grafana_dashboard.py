"""deploy/grafana/loraplane.json against Grafana's dashboard schema, through the maintained
grafana-foundation-sdk (its typed models are generated from Grafana's schema): decoding and
re-encoding the dashboard must give back exactly the committed JSON, so no field is unknown to
the schema, and every panel type and query type is one the SDK knows. The chart's copy must be
in sync, and the chart must ship it (when the pinned helm is built)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "loraplane.json"
CHART = REPO / "charts" / "loraplane"
SDK_HINT = (
    "grafana-foundation-sdk is not installed: `.venv/bin/pip install "
    "'grafana-foundation-sdk==1769699379!11.6.0'` (it is in the dev extras)"
)


def sdk() -> Any:
    try:
        from grafana_foundation_sdk.cog import encoder, plugins, runtime
        from grafana_foundation_sdk.models import dashboard
    except ImportError:
        pytest.fail(SDK_HINT, pytrace=False)
    plugins.register_default_plugins()
    return dashboard, encoder, runtime


def committed() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def leaf_paths(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        return set().union(*(leaf_paths(v, f"{prefix}.{k}") for k, v in value.items())) or {prefix}
    if isinstance(value, list):
        return set().union(*(leaf_paths(v, f"{prefix}[{i}]") for i, v in enumerate(value))) or {
            prefix
        }
    return {prefix}


def panels() -> list[dict[str, Any]]:
    return [p for p in committed()["panels"] if p["type"] != "row"]


def test_dashboard_round_trips_through_grafanas_schema_unchanged() -> None:
    dashboard, encoder, _ = sdk()
    original = committed()
    decoded = dashboard.Dashboard.from_json(original)
    again = json.loads(json.dumps(decoded, cls=encoder.JSONEncoder))
    lost = sorted(leaf_paths(original) - leaf_paths(again))
    assert not lost, (
        f"fields the Grafana dashboard schema does not know (dropped on decode): {lost[:20]}"
    )
    assert again == original, (
        "the dashboard is not in the SDK's canonical form: re-encode it with the SDK"
    )


def test_schema_version_is_the_sdks_current_one() -> None:
    dashboard, _, _ = sdk()
    assert committed()["schemaVersion"] == dashboard.Dashboard().schema_version


def test_every_panel_and_query_type_is_known_to_the_sdk() -> None:
    dashboard, _, runtime = sdk()
    for panel in panels():
        assert runtime.panelcfg_config(panel["type"]) is not None, (
            f"unknown panel type {panel['type']!r}"
        )
        decoded = dashboard.Panel.from_json(panel)
        for target in decoded.targets or []:
            assert not isinstance(target, runtime.UnknownDataquery), (
                panel["title"],
                target.to_json(),
            )


def test_every_query_uses_the_datasource_variable() -> None:
    variables = {v["name"]: v for v in committed()["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "pool", "adapter"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"], name
        assert variables[name]["datasource"]["uid"] == "${datasource}", name
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_panels_have_unique_ids_descriptions_and_do_not_overlap() -> None:
    all_panels = committed()["panels"]
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    for panel in panels():
        assert panel.get("description"), panel["title"]


def test_dashboard_covers_what_a_platform_engineer_looks_for_first() -> None:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for needle in (
        "loraplane_adapters{",  # adapters per pool and phase
        "loraplane_worker_lora_slots_used",  # slot utilisation
        "loraplane_worker_adapters_pinned",  # pinned vs evictable
        "histogram_quantile(0.99, sum by (le, namespace, pool) (rate(loraplane_worker_adapter_load_seconds_bucket",
        "histogram_quantile(0.5, sum by (le, namespace, pool) (rate(loraplane_worker_adapter_unload_seconds_bucket",
        'outcome=~"failed|rolled_back|error"',  # load failures and rollbacks
        "loraplane_worker_adapter_evictions_total",
        "loraplane_on_demand_loads_total",  # cold starts
        "loraplane_drift_repaired_total",
        "loraplane_worker_requests_total",
        "loraplane_worker_generated_tokens_total",
        "loraplane_worker_requests_waiting_for_slot",
    ):
        assert needle in exprs, needle
    # every selector of a worker metric honours the pool filter
    for match in re.finditer(r"loraplane_worker_\w+\{([^}]*)\}", exprs):
        assert 'pool=~"$pool"' in match.group(1), match.group(0)


def test_chart_copy_of_the_dashboards_is_in_sync() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "sync-dashboards.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def helm() -> str:
    try:
        from loraplane.devcluster import layout

        built = layout.bin_dir() / "helm"
        if built.is_file():
            return str(built)
    except ImportError:
        pass
    found = shutil.which("helm")
    if found is None:
        pytest.skip(
            "helm is not built yet: `loraplane cluster up` puts the pinned helm in "
            "~/.cache/loraplane/cluster/<version>/bin/, and none is on PATH"
        )
    return found


def render(*sets: str) -> list[dict[str, Any]]:
    args = [helm(), "template", "lp", str(CHART), "--namespace", "ml", "--kube-version", "1.36.0"]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_chart_ships_the_dashboard_and_monitors_only_when_asked() -> None:
    kinds = {d["kind"] for d in render()}
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    docs = render("grafana.dashboard.enabled=true", "metrics.serviceMonitor.enabled=true")
    config_maps = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")
    ]
    assert len(config_maps) == 1
    assert config_maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_maps[0]["data"]["loraplane.json"]) == committed()
    monitors = {
        d["metadata"]["name"]: d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")
    }
    assert {(m["kind"], name) for name, m in monitors.items()} == {
        ("ServiceMonitor", "lp-loraplane-controlplane"),
        ("PodMonitor", "lp-loraplane-workers"),
        ("PodMonitor", "lp-loraplane-operator"),
    }
    jobs = {
        r["replacement"]
        for m in monitors.values()
        for e in m["spec"].get("endpoints", []) + m["spec"].get("podMetricsEndpoints", [])
        for r in e["relabelings"]
        if r["targetLabel"] == "job"
    }
    assert jobs == {"loraplane-controlplane", "loraplane-worker", "loraplane-operator"}
    # The operator PodMonitor selects the operator pods and scrapes their `metrics` port, which
    # `loraplane operator run --metrics-port` serves.
    operator = next(
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "lp-loraplane-operator"
    )
    pod = operator["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9090
    command = container["command"]
    assert command[command.index("--metrics-port") + 1] == "9090"
    monitor = monitors["lp-loraplane-operator"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
