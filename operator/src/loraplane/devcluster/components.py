"""The command line of each control-plane process `cluster up` starts.

Everything listens on 127.0.0.1 only. kube-controller-manager and kube-scheduler serve no
port at all (`--secure-port=0`); their health shows in their leader-election leases.
"""

from __future__ import annotations

from pathlib import Path

from loraplane.devcluster.layout import (
    KWOK_NODE_ANNOTATION,
    LOCAL_RUNNER_NODE_LABEL,
    SERVICE_CIDR,
)


def etcd(bin_dir: Path, state: Path, client_port: int, peer_port: int) -> list[str]:
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        str(bin_dir / "etcd"),
        "--name=loraplane-dev",
        f"--data-dir={state / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=loraplane-dev={peer}",
        "--initial-cluster-state=new",
        "--auto-compaction-retention=1",
        "--quota-backend-bytes=2147483648",
        # A development cluster survives losing its last writes; fsync on every write
        # would dominate the start time on a shared disk.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def kube_apiserver(bin_dir: Path, state: Path, port: int, etcd_client_port: int) -> list[str]:
    pki = state / "pki"
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{etcd_client_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Endpoints may not hold loopback addresses, so the `kubernetes` Service gets none;
        # in-cluster clients are pointed at 127.0.0.1 directly (KUBERNETES_SERVICE_HOST).
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        "--profiling=false",
        "--v=1",
    ]


def kube_controller_manager(bin_dir: Path, state: Path) -> list[str]:
    pki = state / "pki"
    kubeconfig = state / "controller-manager.kubeconfig"
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--secure-port=0",
        "--leader-elect=true",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allocate-node-cidrs=false",
        "--profiling=false",
        "--v=1",
    ]


def kube_scheduler(bin_dir: Path, state: Path) -> list[str]:
    kubeconfig = state / "scheduler.kubeconfig"
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--secure-port=0",
        "--leader-elect=true",
        "--profiling=false",
        "--v=1",
    ]


def kwok(bin_dir: Path, state: Path, config: Path) -> list[str]:
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={state / 'kubeconfig'}",
        f"--config={config}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
        "--node-ip=127.0.0.1",
        "--cidr=127.1.0.0/16",
        "--node-lease-duration-seconds=40",
        "--server-address=",
        "--node-port=0",
        "--v=1",
    ]


def node_manifest(index: int, gpus: int, cpu: str, memory: str, pods: int) -> dict[str, object]:
    """A fake GPU node that kwok manages: node i (from 1) gets pod IPs from 127.1.i.0/24."""
    name = f"gpu-node-{index}"
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "fake-gpu",
                "nvidia.com/gpu.present": "true",
                "type": "kwok",
                LOCAL_RUNNER_NODE_LABEL: "true",
            },
        },
        "spec": {"podCIDR": f"127.1.{index}.0/24", "podCIDRs": [f"127.1.{index}.0/24"]},
        "status": {"capacity": resources, "allocatable": resources},
    }
