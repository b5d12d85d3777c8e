"""The local pod runner: labelled pods run as real processes at their loopback pod IPs."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from clusterkit import LORAPLANE, Cluster, wait_for

pytestmark = pytest.mark.cluster


def _local_run_pod(
    name: str, command: list[str], container: dict[str, Any] | None = None, **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"loraplane.io/local-run": "true", "app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            **spec,
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/unused:1",
                    "command": command,
                    "env": [
                        {
                            "name": "MY_POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        }
                    ],
                    **(container or {}),
                }
            ],
        },
    }


def _pod_dir(local_cluster: Cluster, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return local_cluster.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
    )


def _listening(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((ip, port)) == 0


def test_labelled_pod_serves_http_at_its_pod_ip(local_cluster: Cluster, namespace: str) -> None:
    pod = _local_run_pod(
        "web",
        ["python3", "-m", "http.server", "--bind", "$(MY_POD_IP)", "8080"],
        container={
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 2},
        },
    )
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pod))
    pod = wait_for(
        lambda: (p := local_cluster.get("pod", "web", "-n", namespace)) and _ready(p) and p,
        what="pod web to be Ready",
    )
    pod_ip = pod["status"]["podIP"]
    assert pod_ip.startswith("127.1.") and pod_ip != "127.0.0.1"
    assert pod["status"]["containerStatuses"][0]["state"].get("running")

    with urllib.request.urlopen(f"http://{pod_ip}:8080/", timeout=5) as response:
        assert response.status == 200
    # It listens on its pod IP only, not on every loopback address.
    assert not _listening("127.0.0.1", 8080)

    record = json.loads((_pod_dir(local_cluster, pod) / "process.json").read_text())
    assert Path(f"/proc/{record['pid']}").exists()

    # `kubectl logs` needs a kubelet; `loraplane cluster logs` reads the pod's output.
    state = ["--state-dir", str(local_cluster.state_dir)]
    logs = subprocess.run(
        [LORAPLANE, "cluster", "logs", "pod/web", "-n", namespace, *state],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert '"GET / HTTP/1.1" 200' in logs.stdout and "start (restart 0)" in logs.stdout
    missing = subprocess.run(
        [LORAPLANE, "cluster", "logs", "no-such-pod", "-n", namespace, *state],
        capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 1 and f"no output of pod {namespace}/no-such-pod" in missing.stderr

    local_cluster.kubectl("delete", "pod", "web", "-n", namespace, "--wait=true", "--timeout=60s")
    assert not _listening(pod_ip, 8080)
    assert (
        not Path(f"/proc/{record['pid']}/stat").exists()
        or "Z" in Path(f"/proc/{record['pid']}/stat").read_text().split()[2]
    )
    assert "stopped: pod deleted" in (_pod_dir(local_cluster, pod) / "log").read_text()


_WHOAMI = """
import json, os, time
from kubernetes import client
from kubernetes.config.incluster_config import InClusterConfigLoader

sa = os.environ["LORAPLANE_SERVICEACCOUNT_DIR"]
InClusterConfigLoader(token_filename=f"{sa}/token", cert_filename=f"{sa}/ca.crt").load_and_set()
namespace = open(f"{sa}/namespace").read()
review = client.AuthenticationV1Api().create_self_subject_review(
    client.V1SelfSubjectReview(api_version="authentication.k8s.io/v1", kind="SelfSubjectReview"))
pods = [p.metadata.name for p in client.CoreV1Api().list_namespaced_pod(namespace).items]
try:
    client.CoreV1Api().list_namespaced_secret(namespace)
    secrets = "allowed"
except client.exceptions.ApiException as exc:
    secrets = exc.status
print("RESULT " + json.dumps({"user": review.status.user_info.username, "pods": pods, "secrets": secrets}), flush=True)
time.sleep(3600)
"""


def test_pod_gets_a_service_account_token_and_rbac_applies(
    local_cluster: Cluster, namespace: str
) -> None:
    local_cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    local_cluster.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list", "--resource=pods"
    )
    local_cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
    )
    pod = _local_run_pod("whoami", ["python3", "-c", _WHOAMI], serviceAccountName="reader")
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pod))
    pod = wait_for(
        lambda: (p := local_cluster.get("pod", "whoami", "-n", namespace)) and _ready(p) and p,
        what="pod whoami to be Ready",
    )
    log = _pod_dir(local_cluster, pod) / "log"

    def result() -> dict[str, Any] | None:
        for line in log.read_text().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]
        return None

    seen = wait_for(result, what=f"the pod's RESULT line in {log}", timeout_s=60)
    assert seen["user"] == f"system:serviceaccount:{namespace}:reader"
    assert "whoami" in seen["pods"]
    assert seen["secrets"] == 403  # RBAC grants pods only
    local_cluster.kubectl(
        "delete", "pod", "whoami", "-n", namespace, "--wait=true", "--timeout=60s"
    )


def test_exited_process_is_restarted_and_counted(local_cluster: Cluster, namespace: str) -> None:
    pod = _local_run_pod("flaky", ["sh", "-c", "echo started; sleep 1; exit 3"])
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pod))

    def restarted() -> dict[str, Any] | None:
        status = local_cluster.get("pod", "flaky", "-n", namespace)["status"]
        containers = status.get("containerStatuses") or [{}]
        return containers[0] if containers[0].get("restartCount", 0) >= 1 else None

    container = wait_for(restarted, what="a restart of pod flaky", timeout_s=60)
    assert container["lastState"]["terminated"]["exitCode"] == 3
    local_cluster.kubectl("delete", "pod", "flaky", "-n", namespace, "--wait=true", "--timeout=60s")
