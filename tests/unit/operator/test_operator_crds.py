"""CRD schemas: a real JSON-schema validator accepts good objects and rejects bad ones.

The API server adds structural pruning, defaulting and CEL (x-kubernetes-validations);
the cluster tier checks those against a real kube-apiserver.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed in this venv")

ROOT = Path(__file__).resolve().parents[3]
CRDS = ROOT / "crds"
EXAMPLES = ROOT / "deploy" / "examples"


def crd(name: str) -> dict[str, Any]:
    return yaml.safe_load((CRDS / name).read_text())


def schema_of(name: str) -> dict[str, Any]:
    (version,) = crd(name)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


POOL = schema_of("loraplane.io_lorapools.yaml")
ADAPTER = schema_of("loraplane.io_loraadapters.yaml")

GOOD_POOL = {
    "apiVersion": "loraplane.io/v1alpha1",
    "kind": "LoRAPool",
    "metadata": {"name": "qwen"},
    "spec": {"model": "/models/qwen", "replicas": 2, "tp": 2, "dp": 2, "maxLorasPerBatch": 4},
}
GOOD_ADAPTER = {
    "apiVersion": "loraplane.io/v1alpha1",
    "kind": "LoRAAdapter",
    "metadata": {"name": "sql-expert"},
    "spec": {"pool": "qwen", "source": {"uri": "s3://bucket/adapters/sql"}, "pinned": True},
}


def errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def with_spec(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["spec"].update(spec)
    return changed


def test_good_objects_validate() -> None:
    assert errors(POOL, GOOD_POOL) == []
    assert errors(POOL, with_spec(GOOD_POOL, stageSlots=0)) == []
    assert errors(POOL, with_spec(GOOD_POOL, stageSlots=16)) == []
    assert errors(ADAPTER, GOOD_ADAPTER) == []


def with_name(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return {**obj, "metadata": {"name": name}}


def test_names_are_limited_where_they_are_typed() -> None:
    # The schema part (jsonschema runs it); the API server also runs the CEL rules below,
    # whose messages name the field and the reason.
    assert errors(POOL, with_name(GOOD_POOL, "p" * 52)) == []
    for bad in ("p" * 53, "9pool", "pool.a"):
        assert any(e.startswith("metadata.name") for e in errors(POOL, with_name(GOOD_POOL, bad)))
    assert errors(ADAPTER, with_name(GOOD_ADAPTER, "a" * 63)) == []
    for bad in ("a" * 64, "sql.expert"):
        found = errors(ADAPTER, with_name(GOOD_ADAPTER, bad))
        assert any(e.startswith("metadata.name") for e in found)
    pool_rules = {r["rule"]: r["message"] for r in POOL["x-kubernetes-validations"]}
    assert pool_rules["self.metadata.name.size() <= 52"].startswith("metadata.name:")
    assert "controller-revision-hash" in pool_rules["self.metadata.name.size() <= 52"]
    (adapter_rule,) = ADAPTER["x-kubernetes-validations"]
    assert "self.metadata.name.size() <= 63" in adapter_rule["rule"]
    assert adapter_rule["message"].startswith("metadata.name:")


@pytest.mark.parametrize(
    "uri",
    [
        "file:///models/adapters/a",
        "pvc://adapters/sql/v1",
        "s3://my-bucket/prefix/a",
        "https://example.com/adapters/a",
        "http://10.0.0.1:8080/a",
        "hf://org/repo",
        "hf://org/repo@main",
    ],
)
def test_every_documented_source_scheme_is_accepted(uri: str) -> None:
    assert errors(ADAPTER, with_spec(GOOD_ADAPTER, source={"uri": uri})) == []


@pytest.mark.parametrize(
    "uri",
    [
        "/models/a",
        "file://relative/a",
        "ftp://host/a",
        "s3://",
        "hf://just-org",
        "gs://b/a",
        "https://",
    ],
)
def test_other_uris_are_rejected(uri: str) -> None:
    found = errors(ADAPTER, with_spec(GOOD_ADAPTER, source={"uri": uri}))
    assert found and found[0].startswith("spec.source.uri")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"tp": 0}, "spec.tp"),
        ({"dp": -1}, "spec.dp"),
        ({"replicas": -1}, "spec.replicas"),
        ({"maxLorasPerBatch": 0}, "spec.maxLorasPerBatch"),
        ({"maxLoraRank": -8}, "spec.maxLoraRank"),
        ({"maxLoraRank": 4096}, "spec.maxLoraRank"),
        ({"imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy"),
        ({"tolerations": [{"operator": "Maybe"}]}, "spec.tolerations.0.operator"),
        ({"engineArgs": [3]}, "spec.engineArgs.0"),
        ({"stageSlots": -1}, "spec.stageSlots"),
        ({"stageSlots": 1000}, "spec.stageSlots"),
        ({"compileCache": {"size": "lots"}}, "spec.compileCache.size"),
        ({"compileCache": {"storageClassName": "ssd"}}, "spec.compileCache"),
        ({"volumes": [{"emptyDir": {}}]}, "spec.volumes.0"),
        ({"volumes": [{"name": "Models"}]}, "spec.volumes.0.name"),
        ({"volumeMounts": [{"name": "m"}]}, "spec.volumeMounts.0"),
        ({"volumeMounts": [{"name": "m", "mountPath": "models"}]}, "spec.volumeMounts.0.mountPath"),
    ],
)
def test_bad_pool_fields_are_rejected(spec: dict[str, Any], field: str) -> None:
    assert any(e.startswith(field) for e in errors(POOL, with_spec(GOOD_POOL, **spec)))


def test_pool_needs_a_model() -> None:
    bad = copy.deepcopy(GOOD_POOL)
    del bad["spec"]["model"]
    assert any("'model' is a required property" in e for e in errors(POOL, bad))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"pool": "Not_A_Name"}, "spec.pool"),
        ({"source": {"uri": "s3://b/a", "sha256": "XYZ"}}, "spec.source.sha256"),
        ({"source": {}}, "spec.source"),
        ({"placement": {"mode": "some"}}, "spec.placement.mode"),
        ({"placement": {"mode": "count", "count": 0}}, "spec.placement.count"),
        ({"priority": 5000}, "spec.priority"),
        ({"pinned": "yes"}, "spec.pinned"),
    ],
)
def test_bad_adapter_fields_are_rejected(spec: dict[str, Any], field: str) -> None:
    assert any(e.startswith(field) for e in errors(ADAPTER, with_spec(GOOD_ADAPTER, **spec)))


@pytest.mark.parametrize(
    ("status", "field"),
    [
        ({"phase": "Happy"}, "status.phase"),
        ({"conditions": [{"type": "Ready", "status": "Yes"}]}, "status.conditions.0"),
    ],
)
def test_status_enums(status: dict[str, Any], field: str) -> None:
    assert any(e.startswith(field) for e in errors(ADAPTER, {**GOOD_ADAPTER, "status": status}))


def test_cel_rules_cover_what_a_schema_cannot() -> None:
    rules = {r["rule"] for r in POOL["properties"]["spec"]["x-kubernetes-validations"]}
    assert "self.tp % self.dp == 0" in rules
    assert "self.maxLoadedLoras >= self.maxLorasPerBatch" in rules
    assert "self.dp == 1 || self.enableDPAttention" in rules
    for rule in POOL["properties"]["spec"]["x-kubernetes-validations"]:
        assert rule["message"].startswith("spec.")


def test_pool_volumes_and_compile_cache_rules() -> None:
    # CEL the API server evaluates (the cluster tier checks it there): mounts name volumes,
    # the compile cache's name and path are the operator's, and compileCache is immutable.
    spec = POOL["properties"]["spec"]
    rules = {r["rule"]: r for r in spec["x-kubernetes-validations"]}
    (immutable,) = [r for r in rules if "oldSelf.compileCache" in r]
    assert rules[immutable]["message"].startswith("spec.compileCache is immutable")
    assert "delete this LoRAPool and create it again" in rules[immutable]["message"]
    (mounts,) = [r for r in rules if "self.volumeMounts.all" in r]
    assert rules[mounts]["fieldPath"] == ".volumeMounts"
    (name_rule,) = spec["properties"]["volumes"]["items"]["x-kubernetes-validations"]
    assert "compile-cache" in name_rule["rule"]
    (path_rule,) = spec["properties"]["volumeMounts"]["items"]["x-kubernetes-validations"]
    assert "/var/cache/loraplane" in path_rule["rule"]
    good = {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "compileCache": {"size": "2Gi", "storageClassName": "fast"},
    }
    assert errors(POOL, with_spec(GOOD_POOL, **good)) == []


def test_adapter_pool_is_immutable() -> None:
    # A transition rule: the API server rejects an update that changes spec.pool (the operator
    # never moves an adapter between pools). Evaluated by the API server, not jsonschema.
    (rule,) = ADAPTER["properties"]["spec"]["properties"]["pool"]["x-kubernetes-validations"]
    assert rule["rule"] == "self == oldSelf"
    assert rule["message"].startswith("spec.pool is immutable")
    assert "delete" in rule["message"] and "create" in rule["message"]


def test_adapter_status_keeps_the_action_counter() -> None:
    # Structural pruning drops status fields the schema lacks; the Idempotency-Key needs it.
    assert ADAPTER["properties"]["status"]["properties"]["actions"]["type"] == "integer"
    assert errors(ADAPTER, {**GOOD_ADAPTER, "status": {"actions": 3}}) == []
    assert any(
        e.startswith("status.actions")
        for e in errors(ADAPTER, {**GOOD_ADAPTER, "status": {"actions": -1}})
    )


def test_crd_shape_printer_columns_short_names_and_status_subresource() -> None:
    for name, columns, short in (
        (
            "loraplane.io_loraadapters.yaml",
            ["Pool", "Phase", "Ready", "Pinned", "Rank", "Age"],
            "ladapter",
        ),
        (
            "loraplane.io_lorapools.yaml",
            [
                "Model",
                "Replicas",
                "Ready",
                "Phase",
                "Reason",
                "TP",
                "DP",
                "KV-Used",
                "KV-Total",
                "Age",
            ],
            "lpool",
        ),
    ):
        doc = crd(name)
        assert doc["spec"]["group"] == "loraplane.io" and doc["spec"]["scope"] == "Namespaced"
        (version,) = doc["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
        assert [c["name"] for c in version["additionalPrinterColumns"]] == columns
        assert short in doc["spec"]["names"]["shortNames"]


def test_examples_validate_against_the_crds() -> None:
    schemas = {"LoRAPool": POOL, "LoRAAdapter": ADAPTER}
    seen = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in schemas:
                assert errors(schemas[doc["kind"]], doc) == [], path.name
                seen += 1
    assert seen >= 4


def test_status_phases_are_the_operators() -> None:
    from loraplane.operator import status

    assert ADAPTER["properties"]["status"]["properties"]["phase"]["enum"] == list(status.PHASES)
    assert POOL["properties"]["status"]["properties"]["phase"]["enum"] == list(status.POOL_PHASES)
    (version,) = crd("loraplane.io_lorapools.yaml")["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Reason"] == ".status.reason"
