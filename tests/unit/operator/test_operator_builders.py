"""The pure builders: what the operator asks Kubernetes and the control plane for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loraplane.operator import builders
from loraplane.operator.builders import Owner, PoolSpec, WorkerDefaults

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
OWNER = Owner(name="qwen-small", namespace="team-a", uid="0f0e-uid")
SPEC = PoolSpec.from_spec(
    {
        "model": "/models/qwen3-0.6b",
        "replicas": 2,
        "tp": 2,
        "dp": 2,
        "enableDPAttention": True,
        "maxLorasPerBatch": 4,
        "maxLoadedLoras": 8,
        "maxLoraRank": 32,
        "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}},
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "podLabels": {"team": "a"},
        "engineArgs": ["--kv-cache-tokens", "4096"],
    }
)


def _by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {m["kind"]: m for m in manifests}


def test_children_are_a_statefulset_headless_service_and_pdb_with_owner_references() -> None:
    children = _by_kind(builders.build_pool_children(OWNER, SPEC, WorkerDefaults()))
    assert set(children) == {"StatefulSet", "Service", "PodDisruptionBudget"}
    for child in children.values():
        assert child["metadata"]["namespace"] == "team-a"
        assert child["metadata"]["labels"]["loraplane.io/pool"] == "qwen-small"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "loraplane.io/v1alpha1",
                "kind": "LoRAPool",
                "name": "qwen-small",
                "uid": "0f0e-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert children["StatefulSet"]["metadata"]["name"] == "qwen-small"
    assert children["Service"]["metadata"]["name"] == "qwen-small-workers"
    assert children["Service"]["spec"]["clusterIP"] == "None"
    assert children["StatefulSet"]["spec"]["serviceName"] == "qwen-small-workers"
    assert children["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


def test_with_a_workers_token_each_pool_gets_a_secret_its_workers_read() -> None:
    children = _by_kind(
        builders.build_pool_children(OWNER, SPEC, WorkerDefaults(admin_token="lpw_token"))
    )
    secret = children["Secret"]
    assert secret["metadata"]["name"] == "qwen-small-worker-token"
    assert secret["metadata"]["namespace"] == "team-a"
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "LoRAPool"
    assert secret["stringData"] == {"token": "lpw_token"}
    container = children["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLANE_WORKER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "qwen-small-worker-token",
        "key": "token",
    }
    assert "lpw_token" not in repr(children["StatefulSet"])  # by reference, never inline
    bare = builders.build_statefulset(OWNER, SPEC, WorkerDefaults())
    names = {e["name"] for e in bare["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "LORAPLANE_WORKER_ADMIN_TOKEN" not in names


def test_selectors_match_the_pod_template_labels() -> None:
    children = _by_kind(builders.build_pool_children(OWNER, SPEC, WorkerDefaults()))
    pod_labels = children["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    for selector in (
        children["StatefulSet"]["spec"]["selector"]["matchLabels"],
        children["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        children["Service"]["spec"]["selector"],
    ):
        assert selector.items() <= pod_labels.items()


def test_building_twice_gives_identical_manifests() -> None:
    assert builders.build_pool_children(OWNER, SPEC, WorkerDefaults()) == (
        builders.build_pool_children(OWNER, SPEC, WorkerDefaults())
    )


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 2), (4, 2), (8, 1)])
def test_each_replica_requests_tp_gpus(tp: int, dp: int) -> None:
    spec = PoolSpec(model="/m", tp=tp, dp=dp, enable_dp_attention=dp > 1)
    sts = builders.build_statefulset(OWNER, spec, WorkerDefaults())
    resources = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == tp
    assert resources["limits"]["nvidia.com/gpu"] == tp


def test_user_resources_are_kept_and_gpu_count_cannot_be_overridden() -> None:
    spec = PoolSpec.from_spec(
        {
            "model": "/m",
            "tp": 2,
            "dp": 1,
            "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "1Gi"}},
        }
    )
    container = builders.build_statefulset(OWNER, spec, WorkerDefaults())["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2, "memory": "1Gi"}


def test_worker_command_is_loraplane_worker_serve_with_pool_settings() -> None:
    sts = builders.build_statefulset(OWNER, SPEC, WorkerDefaults())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "loraplane", "worker", "serve",
        "--model", "/models/qwen3-0.6b",
        "--tp", "2", "--dp", "2",
        "--host", "$(POD_IP)", "--port", "8000",
        "--max-loras-per-batch", "4", "--max-loaded-loras", "8", "--max-lora-rank", "32",
        "--dp-attention",
        "--kv-cache-tokens", "4096",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"][0]["containerPort"] == 8000


def test_stage_slots_reach_the_worker_command_only_when_set() -> None:
    # Unset keeps the command (and so the pod template) of pools made before the field.
    assert "--stage-slots" not in builders.worker_command(PoolSpec(model="/m"))
    for value in (0, 16):
        command = builders.worker_command(PoolSpec.from_spec({"model": "/m", "stageSlots": value}))
        assert command[command.index("--stage-slots") + 1] == str(value)
    command = builders.worker_command(
        PoolSpec.from_spec({"model": "/m", "stageSlots": 16, "engineArgs": ["--max-running", "8"]})
    )
    assert command[-4:] == ["--stage-slots", "16", "--max-running", "8"]


def test_pod_labels_merge_operator_defaults_pool_labels_and_fixed_selector_labels() -> None:
    defaults = WorkerDefaults(pod_labels={"loraplane.io/local-run": "true", "team": "default"})
    spec = PoolSpec.from_spec(
        {"model": "/m", "podLabels": {"team": "a", "loraplane.io/pool": "evil"}}
    )
    labels = builders.build_pod_template("qwen-small", spec, defaults)["metadata"]["labels"]
    assert labels["loraplane.io/local-run"] == "true"
    assert labels["team"] == "a"
    # A pool cannot break its own selector.
    assert labels["loraplane.io/pool"] == "qwen-small"


def test_local_run_label_is_absent_unless_configured() -> None:
    labels = builders.build_pod_template("p", PoolSpec(model="/m"), WorkerDefaults())["metadata"][
        "labels"
    ]
    assert "loraplane.io/local-run" not in labels


def test_scheduling_fields_and_image_defaults() -> None:
    pod = builders.build_pod_template("p", SPEC, WorkerDefaults(image="reg/worker:1"))
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["containers"][0]["image"] == "reg/worker:1"
    own = PoolSpec(model="/m", image="mine:2")
    assert (
        builders.build_pod_template("p", own, WorkerDefaults())["spec"]["containers"][0]["image"]
        == "mine:2"
    )


def _statefulset(spec: dict) -> dict:
    children = builders.build_pool_children(OWNER, PoolSpec.from_spec(spec), WorkerDefaults())
    return _by_kind(children)["StatefulSet"]


def test_without_a_compile_cache_claim_the_kernels_live_in_an_empty_dir() -> None:
    sts = _statefulset({"model": "/m"})
    pod = sts["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "compile-cache", "emptyDir": {}}]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "compile-cache", "mountPath": "/var/cache/loraplane"}
    ]
    assert "volumeClaimTemplates" not in sts["spec"] and "securityContext" not in pod


def test_a_compile_cache_is_one_claim_per_replica_gone_with_the_pool() -> None:
    sts = _statefulset(
        {"model": "/m", "compileCache": {"size": "4Gi", "storageClassName": "fast-ssd"}}
    )
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "compile-cache"
    assert claim["metadata"]["labels"]["loraplane.io/pool"] == "qwen-small"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "4Gi"}},
        "storageClassName": "fast-ssd",
    }
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Retain",
    }
    pod = sts["spec"]["template"]["spec"]
    assert pod["volumes"] == []  # the claim template provides compile-cache
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "compile-cache", "mountPath": "/var/cache/loraplane"}
    ]
    assert pod["securityContext"]["fsGroup"] == 10001  # the worker image's group may write
    no_class = _statefulset({"model": "/m", "compileCache": {"size": "500Mi"}})
    assert "storageClassName" not in no_class["spec"]["volumeClaimTemplates"][0]["spec"]


def test_the_image_writes_its_triton_cache_inside_the_mounted_compile_cache() -> None:
    dockerfile = (ROOT / "docker" / "worker.Dockerfile").read_text()
    (line,) = [ln for ln in dockerfile.splitlines() if ln.startswith("ENV TRITON_HOME=")]
    env = dict(pair.split("=", 1) for pair in line.removeprefix("ENV ").split())
    for variable in ("TRITON_HOME", "TRITON_CACHE_DIR"):
        assert (env[variable] + "/").startswith(builders.COMPILE_CACHE_PATH + "/"), variable


def test_user_volumes_are_mounted_in_the_worker_before_the_compile_cache() -> None:
    volumes = [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "adapter-cache", "nfs": {"server": "nfs.local", "path": "/adapters"}},
    ]
    mounts = [
        {"name": "models", "mountPath": "/models", "readOnly": True},
        {"name": "adapter-cache", "mountPath": "/data/adapters"},
    ]
    pod = _statefulset({"model": "/models/qwen", "volumes": volumes, "volumeMounts": mounts})[
        "spec"
    ]["template"]["spec"]
    assert pod["volumes"] == [*volumes, {"name": "compile-cache", "emptyDir": {}}]
    assert pod["containers"][0]["volumeMounts"] == [
        *mounts,
        {"name": "compile-cache", "mountPath": "/var/cache/loraplane"},
    ]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": "/m", "tp": 3, "dp": 2, "enableDPAttention": True}, "spec.tp"),
        ({"model": "/m", "tp": 2, "dp": 2}, "spec.enableDPAttention"),
        ({"model": "/m", "tp": 0}, "spec.tp"),
        ({"model": ""}, "spec.model"),
        ({"model": "/m", "maxLorasPerBatch": 0}, "spec.maxLorasPerBatch"),
        ({"model": "/m", "maxLorasPerBatch": 8, "maxLoadedLoras": 4}, "spec.maxLoadedLoras"),
        ({"model": "/m", "stageSlots": -1}, "spec.stageSlots: -1 must be >= 0"),
        (
            {"model": "/m", "stageSlots": 8, "engineArgs": ["--stage-slots", "4"]},
            "spec.stageSlots: --stage-slots is also in spec.engineArgs",
        ),
        (
            {"model": "/m", "stageSlots": 8, "engineArgs": ["--stage-slots=4"]},
            "spec.stageSlots: --stage-slots is also in spec.engineArgs",
        ),
        (
            {"model": "/m", "compileCache": {"size": "lots"}},
            "spec.compileCache.size: 'lots' is not a storage quantity",
        ),
        (
            {"model": "/m", "volumes": [{"name": "compile-cache", "emptyDir": {}}]},
            r"spec.volumes\[0\].name: 'compile-cache' is the operator's",
        ),
        (
            {"model": "/m", "volumes": [{"name": "a", "emptyDir": {}}, {"name": "a"}]},
            r"spec.volumes\[1\].name: 'a' is given twice",
        ),
        (
            {"model": "/m", "volumes": [{"name": "Models"}]},
            r"spec.volumes\[0\].name: 'Models' is not a DNS label",
        ),
        (
            {"model": "/m", "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
            r"spec.volumeMounts\[0\].name: no volume named 'models' in spec.volumes",
        ),
        (
            {
                "model": "/m",
                "volumes": [{"name": "a", "emptyDir": {}}],
                "volumeMounts": [{"name": "a", "mountPath": "models"}],
            },
            r"spec.volumeMounts\[0\].mountPath: 'models' is not an absolute path",
        ),
        (
            {
                "model": "/m",
                "volumes": [{"name": "a", "emptyDir": {}}],
                "volumeMounts": [{"name": "a", "mountPath": "/var/cache/loraplane/"}],
            },
            r"spec.volumeMounts\[0\].mountPath: '/var/cache/loraplane/' is the compile cache's",
        ),
        (
            {
                "model": "/m",
                "volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}],
                "volumeMounts": [
                    {"name": "a", "mountPath": "/x"},
                    {"name": "b", "mountPath": "/x/"},
                ],
            },
            r"spec.volumeMounts\[1\].mountPath: '/x/' is mounted twice",
        ),
    ],
)
def test_bad_pool_specs_name_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PoolSpec.from_spec(spec)


def test_pool_names_keep_every_derived_name_legal() -> None:
    longest = "p" * builders.MAX_POOL_NAME
    builders.check_pool_name(longest)
    # The StatefulSet controller's label `controller-revision-hash: <sts>-<hash>` (hash up
    # to 10 characters) and the headless Service's name must stay within 63 characters.
    assert len(f"{builders.statefulset_name(longest)}-{'h' * 10}") <= 63
    assert len(builders.service_name(longest)) <= 63
    with pytest.raises(ValueError, match=r"metadata.name: 'p{53}' has 53 characters.*at most 52"):
        builders.check_pool_name("p" * 53)
    for bad in ("9pool", "Pool", "pool-", "po.ol"):
        with pytest.raises(
            ValueError, match=rf"metadata.name: '{re.escape(bad)}' is not a DNS-1035"
        ):
            builders.check_pool_name(bad)


def test_worker_names_are_unique_per_namespace_and_dns_labels() -> None:
    assert builders.worker_name("default", "pool-0") == "pool-0"
    assert builders.worker_name("team-a", "pool-0") == "team-a-pool-0"
    long_a = builders.worker_name("n" * 40, "p" * 40 + "-0")
    long_b = builders.worker_name("n" * 40, "p" * 40 + "-1")
    assert len(long_a) <= 63 and long_a != long_b


def test_control_plane_bodies() -> None:
    assert builders.build_controlplane_pool(SPEC) == {
        "model": "/models/qwen3-0.6b",
        "tp": 2,
        "dp": 2,
        "max_loras_per_batch": 4,
        "max_loaded_loras": 8,
        "max_lora_rank": 32,
    }
    assert builders.build_worker_registration(
        "team-a", "qwen-small", "qwen-small-1", "10.1.2.3", 2
    ) == {
        "name": "team-a-qwen-small-1",
        "namespace": "team-a",
        "pool": "qwen-small",
        "endpoint": "http://10.1.2.3:8000",
        "dp_size": 2,
    }
    body = builders.build_adapter_registration(
        "team-a",
        "sql",
        {
            "pool": "qwen-small",
            "source": {"uri": "s3://b/sql"},
            "placement": {"mode": "count", "count": 2},
        },
    )
    assert body == {
        "namespace": "team-a",
        "name": "sql",
        "pool": "qwen-small",
        "source": {"uri": "s3://b/sql"},
        "pinned": False,
        "placement": {"count": 2},
        "priority": 0,
        "load": True,
        "load_policy": "OnDemand",
    }
    explicit = {"pool": "p", "source": {"uri": "s3://b/x"}, "loadPolicy": "Explicit"}
    assert builders.build_adapter_registration("ns", "x", explicit)["load_policy"] == "Explicit"
    assert builders.placement_of({}) == "all"
