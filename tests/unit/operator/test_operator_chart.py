"""The Helm chart: values checked by values.schema.json, CRDs in sync, and (when the pinned
helm is built) `helm lint` clean and the rendered manifests what the operator expects."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "loraplane"


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
            "helm is not built yet: `loraplane cluster up` (deploy/cluster/build.sh) puts the "
            "pinned helm in ~/.cache/loraplane/cluster/<version>/bin/, and none is on PATH"
        )
    return found


def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_values_yaml_satisfies_its_schema_and_the_schema_rejects_bad_values() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values(), schema)
    for path, bad in (
        (("operator", "replicas"), -1),
        (("controlplane", "service", "type"), "Ingress"),
        (("controlplane", "image", "pullPolicy"), "Sometimes"),
        (("operator", "maxAttempts"), 0),
        (("localRun",), "yes"),
        (("controlplane", "sources", "allowedRoots"), ["relative/dir"]),
        (("controlplane", "typoKey"), 1),
    ):
        changed = copy.deepcopy(values())
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(changed, schema)


def test_keys_reserved_for_dashboards_and_service_monitor_default_off() -> None:
    assert values()["metrics"]["serviceMonitor"]["enabled"] is False
    assert values()["grafana"]["dashboard"]["enabled"] is False


def test_chart_crds_are_in_sync_with_crds_dir() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sync-crds.sh"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_lint_is_clean() -> None:
    result = subprocess.run(
        [helm(), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def render(*sets: str) -> list[dict[str, Any]]:
    args = [helm(), "template", "rel", str(CHART), "--namespace", "lp", "--kube-version", "1.36.0"]
    for item in sets:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_name(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_rendered_chart_runs_the_same_loraplane_commands_as_the_tests() -> None:
    docs = render()
    op = by_name(docs, "Deployment", "rel-loraplane-operator")["spec"]["template"]["spec"]
    command = op["containers"][0]["command"]
    assert command[:3] == ["loraplane", "operator", "run"]
    assert command[command.index("--peering") + 1] == "loraplane"
    assert "http://rel-loraplane-controlplane.lp.svc:8080" in command
    cp = by_name(docs, "Deployment", "rel-loraplane-controlplane")["spec"]["template"]["spec"]
    assert cp["containers"][0]["command"][:3] == ["loraplane", "controlplane", "serve"]
    assert by_name(docs, "ClusterKopfPeering", "loraplane")
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # no Redis/PostgreSQL by default


def test_local_run_labels_pods_and_finds_the_control_plane_by_selector() -> None:
    docs = render("localRun=true")
    for name in ("rel-loraplane-operator", "rel-loraplane-controlplane"):
        labels = by_name(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert labels["loraplane.io/local-run"] == "true"
    command = by_name(docs, "Deployment", "rel-loraplane-operator")["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert "--controlplane-selector" in command
    assert "loraplane.io/local-run=true" in command
    # A process has no /data volume: the embedded SQLite and the cache go under /tmp.
    env = {
        e["name"]: e
        for e in by_name(docs, "Deployment", "rel-loraplane-controlplane")["spec"]["template"][
            "spec"
        ]["containers"][0]["env"]
    }
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["LORAPLANE_DB_URL"]["value"] == "sqlite:////tmp/loraplane-$(POD_UID).db"
    assert env["LORAPLANE_SOURCES__CACHE_DIR"]["value"] == "/tmp/loraplane-$(POD_UID)/adapters"


def test_local_run_auto_is_off_without_a_local_runner_node() -> None:
    # `helm template` has no cluster to look nodes up in: auto (the default) is off.
    docs = render()
    cp = by_name(docs, "Deployment", "rel-loraplane-controlplane")["spec"]["template"]
    assert "loraplane.io/local-run" not in cp["metadata"]["labels"]
    env = {e["name"]: e for e in cp["spec"]["containers"][0]["env"]}
    assert env["LORAPLANE_DB_URL"]["value"] == "sqlite:////data/loraplane.db"
    assert env["LORAPLANE_SOURCES__CACHE_DIR"]["value"] == "/data/adapters"


def test_optional_redis_and_postgresql() -> None:
    docs = render("redis.enabled=true", "postgresql.enabled=true")
    assert by_name(docs, "StatefulSet", "rel-loraplane-redis")
    assert by_name(docs, "StatefulSet", "rel-loraplane-postgresql")
    env = {
        e["name"]: e
        for e in by_name(docs, "Deployment", "rel-loraplane-controlplane")["spec"]["template"][
            "spec"
        ]["containers"][0]["env"]
    }
    assert env["LORAPLANE_REDIS_URL"]["value"] == "redis://rel-loraplane-redis:6379/0"
    assert env["LORAPLANE_DB_URL"]["value"].startswith(
        "postgresql+psycopg://loraplane:$(POSTGRES_PASSWORD)@"
    )


def render_error(*sets: str) -> str:
    args = [helm(), "template", "rel", str(CHART), "--namespace", "lp", "--kube-version", "1.36.0"]
    for item in sets:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, f"rendered with {sets}"
    return result.stderr


def test_several_controlplane_replicas_need_a_shared_database_and_redis() -> None:
    # Each replica would otherwise keep its own registry (SQLite in its emptyDir) and bus.
    error = render_error("controlplane.replicas=2")
    assert "controlplane.replicas=2 needs" in error
    assert "postgresql.enabled=true" in error and "redis.enabled=true" in error
    error = render_error("controlplane.replicas=2", "redis.enabled=true")
    assert "SQLite" in error and "controlplane.database.url" in error and "Redis" not in error
    error = render_error("controlplane.replicas=3", "postgresql.enabled=true")
    assert "controlplane.redis.url" in error and "SQLite" not in error
    error = render_error(
        "controlplane.replicas=2",
        "controlplane.database.url=sqlite:////shared/loraplane.db",
        "redis.enabled=true",
    )
    assert "not SQLite" in error
    for sets in (
        ("controlplane.replicas=2", "postgresql.enabled=true", "redis.enabled=true"),
        (
            "controlplane.replicas=2",
            "controlplane.database.existingSecret=db",
            "controlplane.redis.url=redis://redis:6379/0",
        ),
    ):
        cp = by_name(render(*sets), "Deployment", "rel-loraplane-controlplane")
        assert cp["spec"]["replicas"] == 2


def test_operator_rbac_has_no_wildcards_secrets_or_deletes() -> None:
    role = by_name(render(), "ClusterRole", "rel-loraplane-operator")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "delete" not in rule["verbs"], rule
        assert "secrets" not in rule["resources"]


def secret_rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["rules"] if "secrets" in r["resources"]]


SECRET_VERBS = ["get", "create", "patch"]


def test_operator_reaches_secrets_by_name_only_and_only_where_it_watches() -> None:
    # spec.source.credentialsSecretRef: `get`; each pool's `<pool>-worker-token`: `create` and
    # `patch` (server-side apply); no list/watch/delete. Bound to the operator.
    docs = render()
    role = by_name(docs, "ClusterRole", "rel-loraplane-operator-secrets")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": SECRET_VERBS}]
    binding = by_name(docs, "ClusterRoleBinding", "rel-loraplane-operator-secrets")
    assert binding["roleRef"]["name"] == "rel-loraplane-operator-secrets"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-loraplane-operator", "namespace": "lp"}
    ]
    # Watching some namespaces: a Role in each of them, and no cluster-wide grant.
    docs = render("operator.watchNamespaces={ml,team-b}")
    assert not [
        d for d in docs if d["kind"].startswith("Cluster") and "secrets" in repr(d.get("rules"))
    ]
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "team-b"]
    for role in roles:
        assert secret_rules(role) == role["rules"]
        assert role["rules"][0]["verbs"] == SECRET_VERBS
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "team-b"]
    assert all(b["subjects"][0]["name"] == "rel-loraplane-operator" for b in bindings)


def env_of(docs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec = by_name(docs, "Deployment", deployment)["spec"]["template"]["spec"]
    return {e["name"]: e for e in spec["containers"][0]["env"]}


def test_the_workers_token_reaches_the_control_plane_and_the_operator() -> None:
    docs = render()
    secret = by_name(docs, "Secret", "rel-loraplane-admin")
    assert set(secret["data"]) == {"admin-token", "worker-token"}
    assert secret["data"]["worker-token"] != secret["data"]["admin-token"]
    ref = {"name": "rel-loraplane-admin", "key": "worker-token", "optional": True}
    cp = env_of(docs, "rel-loraplane-controlplane")
    assert cp["LORAPLANE_WORKERS__ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    op = env_of(docs, "rel-loraplane-operator")
    assert op["LORAPLANE_WORKER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == ref


def test_network_policies_let_only_the_control_plane_and_prometheus_reach_workers() -> None:
    policies = [d for d in render() if d["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["namespace"] for p in policies] == ["lp"]
    spec = policies[0]["spec"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "lp"}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controlplane"
    docs = render(
        "operator.watchNamespaces={ml,team-b}",
        "networkPolicy.prometheus.namespaceSelector.matchLabels.name=monitoring",
    )
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["lp", "ml", "team-b"]
    for policy in policies:
        peers = policy["spec"]["ingress"][0]["from"]
        assert peers[1]["namespaceSelector"] == {"matchLabels": {"name": "monitoring"}}
    assert not [d for d in render("networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]
