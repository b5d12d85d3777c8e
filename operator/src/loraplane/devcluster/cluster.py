"""`cluster up`, `down` and `status`: start the control plane on loopback, stop it by PID,
say what runs where."""

from __future__ import annotations

import json
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.devcluster import components, pki, processes
from loraplane.devcluster.layout import (
    LOCAL_RUN_LABEL,
    ClusterState,
    Process,
    deploy_dir,
    read_versions,
)

# Stop order: the runner first (it stops pod processes), etcd last.
_STOP_ORDER = [
    "runner",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
]


class ClusterError(RuntimeError):
    """`cluster up` or `down` could not do what was asked; the message says why."""


@dataclass(frozen=True, slots=True)
class NodeShape:
    count: int
    gpus: int
    cpu: str = "32"
    memory: str = "256Gi"
    pods: int = 110

    def __post_init__(self) -> None:
        if not 1 <= self.count <= 250:
            raise ValueError(f"nodes={self.count}: must be between 1 and 250")
        if self.gpus < 0:
            raise ValueError(f"gpus_per_node={self.gpus}: must be >= 0")


def up(
    state: Path,
    bin_dir: Path,
    shape: NodeShape,
    *,
    timeout_s: float = 120.0,
    log: Callable[[str], None] = print,
) -> ClusterState:
    """Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and the
    local pod runner; create the fake GPU nodes; return once the API is ready and every
    node is Ready. On failure, stop whatever was started and raise ClusterError."""
    previous = ClusterState.load(state)
    if previous is not None and any(processes.is_running(p) for p in previous.processes):
        raise ClusterError(
            f"a cluster is already running from {state} (see `loraplane cluster status`); "
            "run `loraplane cluster down` first or set LORAPLANE_CLUSTER_DIR to another directory"
        )
    _reset_state_dir(state)
    started = time.monotonic()
    deadline = started + timeout_s

    pki.write_pki(state / "pki")
    etcd_client, etcd_peer, apiserver_port = (processes.free_port() for _ in range(3))
    cluster = ClusterState(
        state_dir=str(state),
        bin_dir=str(bin_dir),
        versions=read_versions(),
        apiserver_port=apiserver_port,
        etcd_client_port=etcd_client,
        etcd_peer_port=etcd_peer,
        nodes=shape.count,
        gpus_per_node=shape.gpus,
    )
    server = cluster.server
    (state / "kubeconfig").write_text(pki.kubeconfig(server, state / "pki", "admin"))
    for user in ("controller-manager", "scheduler"):
        (state / f"{user}.kubeconfig").write_text(pki.kubeconfig(server, state / "pki", user))
    for path in state.glob("*kubeconfig"):
        path.chmod(0o600)
    kwok_config = state / "kwok.yaml"
    shutil.copyfile(deploy_dir() / "kwok.yaml", kwok_config)
    logs = state / "logs"

    def start(name: str, argv: list[str], ports: list[int] | None = None) -> Process:
        process, _ = processes.spawn(name, argv, logs / f"{name}.log", cwd=state, ports=ports or [])
        cluster.processes.append(process)
        cluster.save()
        return process

    try:
        etcd = start(
            "etcd",
            components.etcd(bin_dir, state, etcd_client, etcd_peer),
            [etcd_client, etcd_peer],
        )
        _wait(
            lambda: _http_ok(f"http://127.0.0.1:{etcd_client}/health"),
            deadline,
            etcd,
            "etcd /health",
        )
        log(f"etcd ready on 127.0.0.1:{etcd_client} ({time.monotonic() - started:.1f} s)")

        apiserver = start(
            "kube-apiserver",
            components.kube_apiserver(bin_dir, state, apiserver_port, etcd_client),
            [apiserver_port],
        )
        tls = _admin_tls(state / "pki")
        _wait(
            lambda: _http_ok(f"{server}/readyz", tls), deadline, apiserver, "kube-apiserver /readyz"
        )
        log(f"kube-apiserver ready on {server} ({time.monotonic() - started:.1f} s)")

        start("kube-controller-manager", components.kube_controller_manager(bin_dir, state))
        start("kube-scheduler", components.kube_scheduler(bin_dir, state))
        kwok = start("kwok", components.kwok(bin_dir, state, kwok_config))
        start(
            "runner",
            [
                sys.executable,
                "-m",
                "loraplane.devcluster.runner",
                "--state-dir",
                str(state),
                "--workdir",
                str(Path.cwd()),
            ],
        )

        api = _core_api(state / "kubeconfig")
        for index in range(1, shape.count + 1):
            api.create_node(
                components.node_manifest(index, shape.gpus, shape.cpu, shape.memory, shape.pods)
            )
        _wait(lambda: _nodes_ready(api, shape.count), deadline, kwok, f"{shape.count} Ready nodes")
        log(f"{shape.count} nodes Ready ({time.monotonic() - started:.1f} s)")
        # Pods in `default` need its ServiceAccount, made by the controller manager.
        _wait(
            lambda: _has_default_service_account(api),
            deadline,
            cluster.processes[2],
            "the default ServiceAccount",
        )
        for process in cluster.processes:
            if not processes.is_running(process):
                raise ClusterError(
                    f"{process.name} exited during start-up; see {process.log}:\n"
                    f"{_tail(Path(process.log))}"
                )
    except BaseException:
        down(state)
        raise
    log(f"cluster up in {time.monotonic() - started:.1f} s; kubeconfig: {cluster.kubeconfig}")
    return cluster


def down(state: Path, *, log: Callable[[str], None] = lambda _: None) -> list[str]:
    """Stop every process `up` started from `state`, and every pod process the runner
    started, by PID. Returns what is still wrong afterwards (empty when all is gone)."""
    cluster = ClusterState.load(state)
    problems: list[str] = []
    if cluster is None:
        return problems
    by_name = {p.name: p for p in cluster.processes}
    for name in _STOP_ORDER:
        process = by_name.get(name)
        if process is not None and processes.is_running(process):
            log(f"stopping {name} (pid {process.pid})")
            processes.stop(process)
    # Pod processes whose runner did not stop them (it died, or was killed).
    for pid_file in sorted((state / "pods").glob("*/process.json")):
        pod_process = Process(**json.loads(pid_file.read_text()))
        if processes.is_running(pod_process):
            log(f"stopping pod process {pod_process.name} (pid {pod_process.pid})")
            processes.stop(pod_process, grace_s=5.0)
        pid_file.unlink(missing_ok=True)
    for process in cluster.processes:
        if processes.is_running(process):
            problems.append(f"{process.name} (pid {process.pid}) is still running")
        for port in process.ports:
            if processes.is_listening(port):
                problems.append(f"port 127.0.0.1:{port} of {process.name} is still listening")
    if not problems:
        (state / "cluster.json").rename(state / "cluster.last.json")
    return problems


def status(state: Path) -> dict[str, Any]:
    """What runs where: processes, API readiness, nodes and local-run pods."""
    cluster = ClusterState.load(state)
    if cluster is None:
        return {"state_dir": str(state), "running": False}
    report: dict[str, Any] = {
        "state_dir": str(state),
        "kubeconfig": str(cluster.kubeconfig),
        "server": cluster.server,
        "versions": cluster.versions,
        "processes": [
            {
                "name": p.name,
                "pid": p.pid,
                "running": processes.is_running(p),
                "ports": p.ports,
                "log": p.log,
            }
            for p in cluster.processes
        ],
    }
    report["running"] = all(p["running"] for p in report["processes"])
    report["ready"] = _http_ok(f"{cluster.server}/readyz", _admin_tls(state / "pki"))
    if report["ready"]:
        api = _core_api(cluster.kubeconfig)
        report["nodes"] = [
            {
                "name": n.metadata.name,
                "ready": _is_ready(n.status.conditions),
                "pod_cidr": n.spec.pod_cidr,
                "allocatable": dict(n.status.allocatable or {}),
            }
            for n in api.list_node().items
        ]
        report["local_run_pods"] = [
            {
                "pod": f"{p.metadata.namespace}/{p.metadata.name}",
                "node": p.spec.node_name,
                "pod_ip": p.status.pod_ip,
                "phase": p.status.phase,
                "ready": _is_ready(p.status.conditions),
                "process": _pod_process(state, p.metadata.uid),
            }
            for p in api.list_pod_for_all_namespaces(label_selector=f"{LOCAL_RUN_LABEL}=true").items
        ]
    return report


def pod_log(state: Path, namespace: str, pod: str) -> Path:
    """The output file of local-run pod `namespace/pod` (the newest, if the name was reused);
    FileNotFoundError naming what was looked for when there is none."""
    found = sorted(
        (state / "pods").glob(f"{namespace}_{pod}_*/log"), key=lambda p: p.stat().st_mtime
    )
    if not found:
        raise FileNotFoundError(
            f"no output of pod {namespace}/{pod} under {state / 'pods'}: only local-run pods "
            f"(label {LOCAL_RUN_LABEL}=true) run, and a pod's output appears once it started"
        )
    return found[-1]


# -- helpers -------------------------------------------------------------------------


def _reset_state_dir(state: Path) -> None:
    """Empty `state` for a fresh cluster, refusing a directory that is not ours."""
    if state.exists():
        entries = list(state.iterdir())
        ours = {"cluster.json", "cluster.last.json"}
        if entries and not any(e.name in ours for e in entries):
            raise ClusterError(
                f"{state} is not empty and holds no cluster.json: refusing to reuse it"
            )
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    state.mkdir(parents=True, exist_ok=True)


def _admin_tls(pki_dir: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    context.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return context


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait(check: Callable[[], bool], deadline: float, process: Process, what: str) -> None:
    while time.monotonic() < deadline:
        if check():
            return
        if not processes.is_running(process):
            raise ClusterError(
                f"{process.name} exited while waiting for {what}; see {process.log}:\n"
                f"{_tail(Path(process.log))}"
            )
        time.sleep(0.2)
    raise ClusterError(
        f"timed out waiting for {what}; see {process.log}:\n{_tail(Path(process.log))}"
    )


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _core_api(kubeconfig: Path) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))


def _is_ready(conditions: list[Any] | None) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def _nodes_ready(api: Any, count: int) -> bool:
    """`count` nodes Ready and without the not-ready/unreachable taints the node
    lifecycle controller puts on a new node, so pods can be scheduled right away."""
    schedulable = 0
    for node in api.list_node().items:
        taints = [t.key for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        schedulable += _is_ready(node.status.conditions) and not taints
    return schedulable >= count


def _has_default_service_account(api: Any) -> bool:
    return any(
        sa.metadata.name == "default" for sa in api.list_namespaced_service_account("default").items
    )


def _pod_process(state: Path, uid: str) -> dict[str, Any] | None:
    for path in (state / "pods").glob(f"*_{uid}/process.json"):
        recorded = Process(**json.loads(path.read_text()))
        return {"pid": recorded.pid, "running": processes.is_running(recorded), "log": recorded.log}
    return None
