"""Helpers for the observability integration test: a real Prometheus (Debian binary) and real
`loraplane controlplane serve` / `loraplane worker serve` processes on 127.0.0.1, plus the
PromQL expressions of deploy/grafana/loraplane.json and deploy/prometheus/rules.yaml."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.procs import stop_process, worker_serve_command

from loraplane.devcluster.processes import free_port

REPO = Path(__file__).resolve().parents[3]
LORAPLANE = REPO / ".venv" / "bin" / "loraplane"
DASHBOARD = REPO / "deploy" / "grafana" / "loraplane.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
ADMIN_TOKEN = "observability-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Metrics the dashboard and rules use whose component does not run here: the operator needs a
# Kubernetes API (its metrics are tested in tests/unit/operator/test_operator_metrics.py, the
# chart's PodMonitor for it in tests/unit/observability). Queries of them must parse and be empty.
OPERATOR_METRICS = ("loraplane_operator_",)
# Emitted by the control plane and workers this test runs (formerly "proposed" in
# docs/metrics.md): each must have series after the workload.
NEW_METRICS = (
    'loraplane_adapters{namespace="default", pool="tiny"}',
    'loraplane_workers{namespace="default", pool="tiny"}',
    'loraplane_evictions_total{namespace="default", pool="tiny", worker=~"w0|w1"} > 0',
    'loraplane_on_demand_loads_total{namespace="default", pool="tiny", outcome="succeeded"} > 0',
    'loraplane_on_demand_loads_total{namespace="default", pool="tiny", outcome="no_capacity"}',
    'loraplane_router_rejected_total{code="not_found"} > 0',
    'loraplane_operations_total{namespace="default", pool="tiny", outcome="rolled_back"} > 0',
    'loraplane_operations_total{kind="pin", outcome="failed"} == 0',
    'loraplane_drift_repaired_total{kind="placed"}',
    'loraplane_placements{namespace="default", pool="tiny", worker="w0", state="loaded"} > 0',
    "time() - loraplane_reconcile_last_success_timestamp_seconds < 30",
    'loraplane_reconcile_passes_total{outcome="ok"} > 0',
    "loraplane_event_bus_up == 1",
    "loraplane_worker_slot_loads_total > 0",
    'loraplane_worker_info{model="tiny-llama", tp="1", dp="1"} == 1',
)


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, path: str, timeout: float) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                return self.client.get(path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, f"{self.name} {path}")

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc)


def spawn(
    name: str, cmd: Sequence[str], tmp: Path, port: int, env: dict[str, str] | None = None
) -> Proc:
    log_path = tmp / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    return Proc(name, proc, f"http://127.0.0.1:{port}", log_path)


def start_worker(name: str, model: Path, tmp: Path, adapter_root: Path, *, k: int, m: int) -> Proc:
    port = free_port()
    return spawn(
        name,
        worker_serve_command(
            LORAPLANE,
            model,
            port,
            "--lora-backend",
            "torch",
            "--max-loras-per-batch",
            str(k),
            "--max-loaded-loras",
            str(m),
            "--max-lora-rank",
            "16",
            "--allowed-lora-root",
            str(adapter_root),
            "--enable-fault-injection",
            "--log-level",
            "warning",
        ),
        tmp,
        port,
    )


def start_controlplane(tmp: Path, db_url: str, redis_url: str, adapter_root: Path) -> Proc:
    port = free_port()
    env = {
        "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
        "LORAPLANE_SOURCES__CACHE_DIR": str(tmp / "cache"),
        "LORAPLANE_WORKERS__PROBE_TIMEOUT_S": "1",
        "LORAPLANE_REDIS_URL": redis_url,
    }
    return spawn(
        "controlplane",
        [
            str(LORAPLANE),
            "controlplane",
            "serve",
            "--db",
            db_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--allowed-root",
            str(adapter_root),
            "--reconcile-interval",
            "1",
            "--log-level",
            "warning",
        ],
        tmp,
        port,
        env,
    )


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail(
            "prometheus is not on PATH: `bash scripts/prometheus.sh install` (Debian package "
            "`prometheus`) or `make test-integration`",
            pytrace=False,
        )
    return path


def start_prometheus(
    tmp: Path, controlplane: str, workers: dict[str, str], dead_operator: str
) -> Proc:
    """Scrape every second: the control plane, each worker (with the target labels the chart's
    PodMonitor sets), and an operator target that answers nothing (no operator runs here)."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "loraplane-controlplane",
                "static_configs": [{"targets": [controlplane]}],
                "honor_labels": True,
            },
            {
                "job_name": "loraplane-worker",
                "static_configs": [
                    {
                        "targets": [target],
                        "labels": {"namespace": "default", "pool": "tiny", "worker": name},
                    }
                    for name, target in workers.items()
                ],
            },
            {"job_name": "loraplane-operator", "static_configs": [{"targets": [dead_operator]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = spawn(
        "prometheus",
        [
            prometheus_binary(),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        tmp,
        port,
    )
    proc.wait_healthy("/-/ready", 60)
    return proc


# ---------------------------------------------------------------- PromQL of the dashboard and rules


@dataclass(frozen=True)
class Expression:
    where: str  # "dashboard: <panel> [A]" or "rule: <alert>"
    expr: str


def dashboard_expressions(rate_interval: str) -> list[Expression]:
    """Every panel query, with the template variables set as Grafana sends them for "All"."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$__rate_interval", rate_interval)
                .replace("$namespace", ".*")
                .replace("$pool", ".*")
                .replace("$adapter", ".*")
            )
            assert "$" not in expr, f"unknown variable in {panel['title']}: {expr}"
            out.append(Expression(f"dashboard: {panel['title']} [{target['refId']}]", expr))
    return out


def variable_queries() -> dict[str, str]:
    return {
        v["name"]: v["query"]["query"]
        for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
        if v["type"] == "query"
    }


def rule_expressions() -> list[Expression]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [
        Expression(f"rule: {r.get('alert') or r.get('record')}", r["expr"])
        for g in groups
        for r in g["rules"]
    ]


_THRESHOLD = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+(?![0-9.a-z])")


def signal(expr: str) -> str:
    """An alert expression without its thresholds: the series it compares, present when healthy."""
    return _THRESHOLD.sub("", expr)


def uses_operator_metrics(expr: str) -> bool:
    return any(name in expr for name in OPERATOR_METRICS)


class PromAPI:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get("/api/v1/query", params={"query": expr}).json()
        return body

    def vector(self, expr: str) -> list[dict[str, Any]]:
        body = self.query(expr)
        assert body["status"] == "success", (
            f"{expr}\n-> {body.get('errorType')}: {body.get('error')}"
        )
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def has_data(self, expr: str) -> bool:
        return bool(self.vector(expr))

    def alert_states(self) -> dict[str, set[str]]:
        states: dict[str, set[str]] = {}
        for sample in self.vector("ALERTS"):
            states.setdefault(sample["metric"]["alertname"], set()).add(
                sample["metric"]["alertstate"]
            )
        return states

    def rules(self) -> list[dict[str, Any]]:
        body = self.http.get("/api/v1/rules").json()
        assert body["status"] == "success", body
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def targets_up(self) -> dict[str, str]:
        body = self.http.get("/api/v1/targets").json()
        return {t["scrapeUrl"]: t["health"] for t in body["data"]["activeTargets"]}


def values(samples: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in samples]


def some_positive(samples: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(v) and v > 0 for v in values(samples))
