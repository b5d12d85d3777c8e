"""Acceptance of issue 5: a real control plane, GPU nodes, scheduling, CRDs, GC, helm."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from clusterkit import Cluster, wait_for

from loraplane.devcluster.layout import read_versions

pytestmark = pytest.mark.cluster

CHART = Path(__file__).parent / "charts" / "trivial"


def test_server_reports_the_pinned_version(local_cluster: Cluster) -> None:
    versions = json.loads(local_cluster.kubectl("version", "-o", "json").stdout)
    pinned = read_versions()["KUBERNETES_VERSION"]
    assert versions["serverVersion"]["gitVersion"] == pinned
    assert versions["clientVersion"]["gitVersion"] == pinned


def test_two_ready_nodes_with_eight_gpus(local_cluster: Cluster) -> None:
    nodes = local_cluster.get("nodes")["items"]
    assert len(nodes) == 2
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]
        # No not-ready taint left once kwok reports the node Ready.
        assert not [t for t in node["spec"].get("taints", []) if "not-ready" in t["key"]]


def _gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "worker",
                            "image": "example.invalid/worker:never-pulled",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ]
                },
            },
        },
    }


def test_gpu_pods_are_scheduled_by_gpu_capacity(local_cluster: Cluster, namespace: str) -> None:
    local_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=json.dumps(_gpu_deployment("gpu", 3, 4))
    )

    def running() -> list[dict[str, Any]] | None:
        pods = local_cluster.get("pods", "-n", namespace, "-l", "app=gpu")["items"]
        live = [p for p in pods if p["status"].get("phase") == "Running"]
        return live if len(live) == 3 else None

    pods = wait_for(running, what="3 Running GPU pods")
    per_node = Counter(p["spec"]["nodeName"] for p in pods)
    # 3 x 4 GPUs do not fit on one 8-GPU node: the scheduler must have used both.
    assert sorted(per_node.values()) == [1, 2], per_node
    assert all(p["status"]["podIP"].startswith("127.1.") for p in pods)

    # Two more replicas need 8 more GPUs but only 4 are free: exactly one stays Pending,
    # and the scheduler says why.
    local_cluster.kubectl("scale", "-n", namespace, "deployment/gpu", "--replicas=5")

    def settled() -> tuple[int, list[dict[str, Any]]] | None:
        pods = local_cluster.get("pods", "-n", namespace, "-l", "app=gpu")["items"]
        phases = Counter(p["status"].get("phase") for p in pods)
        pending = [p for p in pods if p["status"].get("phase") == "Pending"]
        unschedulable = [
            p
            for p in pending
            if any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in p["status"].get("conditions", [])
            )
        ]
        return (
            (phases["Running"], unschedulable)
            if phases["Running"] == 4 and len(unschedulable) == 1
            else None
        )

    _, unschedulable = wait_for(settled, what="4 Running and 1 unschedulable GPU pod")
    message = next(
        c["message"]
        for c in unschedulable[0]["status"]["conditions"]
        if c["type"] == "PodScheduled"
    )
    assert "nvidia.com/gpu" in message


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.loraplane.io"},
    "spec": {
        "group": "test.loraplane.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                                    "color": {"type": "string", "enum": ["red", "blue"]},
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def _widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "test.loraplane.io/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_crd_is_served_validates_and_prunes(local_cluster: Cluster, namespace: str) -> None:
    local_cluster.apply(CRD)
    local_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.test.loraplane.io", "--timeout=60s"
    )
    # Discovery may lag the Established condition by a moment.
    wait_for(
        lambda: (
            local_cluster.kubectl("get", "widgets", "-n", namespace, check=False).returncode == 0
        ),
        what="widgets to be served",
    )

    with_unknown = json.dumps(
        _widget("good", {"size": 3, "color": "red", "unknownField": "dropped"})
    )
    # kubectl asks for strict field validation by default: the unknown field is refused...
    strict = local_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", check=False, stdin=with_unknown
    )
    assert strict.returncode != 0 and 'unknown field "spec.unknownField"' in strict.stderr
    # ...and without it the object is accepted and the field pruned by the schema.
    local_cluster.kubectl(
        "apply", "-n", namespace, "--validate=false", "-f", "-", stdin=with_unknown
    )
    stored = local_cluster.get("widget", "good", "-n", namespace)
    assert stored["spec"] == {"size": 3, "color": "red"}  # unknownField pruned

    rejected = local_cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        check=False,
        stdin=json.dumps(_widget("bad", {"size": 99, "color": "green"})),
    )
    assert rejected.returncode != 0
    assert "spec.size" in rejected.stderr and "spec.color" in rejected.stderr, rejected.stderr
    assert (
        local_cluster.kubectl("get", "widget", "bad", "-n", namespace, check=False).returncode != 0
    )


def test_deleting_an_owner_garbage_collects_what_it_owns(
    local_cluster: Cluster, namespace: str
) -> None:
    local_cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=k=v")
    owner = local_cluster.get("configmap", "owner", "-n", namespace)
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "owner",
                    "uid": owner["metadata"]["uid"],
                }
            ],
        },
        "data": {"k": "v"},
    }
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(owned))
    # A Deployment owns a ReplicaSet that owns its pods: cascading deletion removes all.
    local_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=json.dumps(_gpu_deployment("cascade", 1, 1))
    )
    wait_for(
        lambda: local_cluster.get("replicasets", "-n", namespace, "-l", "app=cascade")["items"],
        what="the Deployment's ReplicaSet",
    )

    local_cluster.kubectl("delete", "configmap", "owner", "-n", namespace, "--wait=false")
    local_cluster.kubectl("delete", "deployment", "cascade", "-n", namespace, "--wait=false")

    wait_for(
        lambda: (
            local_cluster.kubectl(
                "get", "configmap", "owned", "-n", namespace, check=False
            ).returncode
            != 0
        ),
        what="the owned ConfigMap to be collected",
    )
    wait_for(
        lambda: (
            not local_cluster.get("replicasets,pods", "-n", namespace, "-l", "app=cascade")["items"]
        ),
        what="the ReplicaSet and its pods to be collected",
    )


def test_helm_installs_a_chart(local_cluster: Cluster, namespace: str) -> None:
    installed = local_cluster.run(
        "helm",
        "install",
        "hello",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "greeting=from-helm",
        "--wait",
        "--timeout",
        "60s",
    )
    assert "STATUS: deployed" in installed.stdout
    config_map = local_cluster.get("configmap", "hello-greeting", "-n", namespace)
    assert config_map["data"] == {"greeting": "from-helm"}
    releases = json.loads(local_cluster.run("helm", "list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("hello", "deployed")]
    local_cluster.run("helm", "uninstall", "hello", "--namespace", namespace, "--wait")
    assert (
        local_cluster.kubectl(
            "get", "configmap", "hello-greeting", "-n", namespace, check=False
        ).returncode
        != 0
    )
