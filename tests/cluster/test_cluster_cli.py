"""`loraplane cluster up|status|env|down` as a user runs them, on a cluster of its own
(the session cluster other tests use is left alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clusterkit import Cluster, wait_for

from loraplane.devcluster import layout, processes
from loraplane.devcluster.layout import ClusterState

pytestmark = pytest.mark.cluster


def _loraplane(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "loraplane.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"loraplane {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def test_up_status_env_down_leaves_nothing_behind(tmp_path: Path) -> None:
    layout.build_binaries(quiet=True)  # a no-op once the session cluster has built them
    state = tmp_path / "state"
    _loraplane("cluster", "up", "--nodes", "1", "--gpus-per-node", "2", "--state-dir", str(state))
    try:
        recorded = ClusterState.load(state)
        assert recorded is not None
        cluster = Cluster(state, recorded.kubeconfig, Path(recorded.bin_dir), recorded.server)

        exports = _loraplane("cluster", "env", "--state-dir", str(state)).stdout
        assert f"export KUBECONFIG={state / 'kubeconfig'}" in exports
        assert f"export PATH={recorded.bin_dir}:" in exports
        shell = subprocess.run(
            ["bash", "-c", f'eval "{exports}"; kubectl get nodes -o name; command -v helm'],
            capture_output=True,
            text=True,
            check=True,
            env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
        )
        assert shell.stdout.splitlines() == ["node/gpu-node-1", f"{recorded.bin_dir}/helm"]

        # A pod process must be stopped by `down` too.
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "sleeper",
                "namespace": "default",
                "labels": {"loraplane.io/local-run": "true"},
            },
            "spec": {
                "containers": [{"name": "main", "image": "unused", "command": ["sleep", "3600"]}]
            },
        }
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
        pod_json = wait_for(
            lambda: (
                (p := cluster.get("pod", "sleeper"))
                and p["status"].get("containerStatuses", [{}])[0].get("ready")
                and p
            ),
            what="pod sleeper to be Ready",
        )
        pod_dir = state / "pods" / f"default_sleeper_{pod_json['metadata']['uid']}"
        pod_process = layout.Process(**json.loads((pod_dir / "process.json").read_text()))

        status = json.loads(
            _loraplane("cluster", "status", "--json", "--state-dir", str(state)).stdout
        )
        assert status["running"] and status["ready"]
        assert {p["name"] for p in status["processes"]} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "runner",
        }
        assert [(p["pod"], p["process"]["running"]) for p in status["local_run_pods"]] == [
            ("default/sleeper", True)
        ]
    finally:
        down = _loraplane("cluster", "down", "--state-dir", str(state), check=False)
    assert down.returncode == 0, down.stderr

    for process in [*recorded.processes, pod_process]:
        assert not processes.is_running(process), (
            f"{process.name} (pid {process.pid}) survived `cluster down`"
        )
    for process in recorded.processes:
        for port in process.ports:
            assert not processes.is_listening(port), (
                f"port {port} of {process.name} still listening"
            )
    assert _loraplane("cluster", "status", "--state-dir", str(state), check=False).returncode != 0
