"""Where the cluster's binaries, state, logs and PKI live."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Label that opts a pod in to the local pod runner.
LOCAL_RUN_LABEL = "loraplane.io/local-run"
# Label on every node of this cluster: the chart's `localRun: auto` turns local-run on by it.
LOCAL_RUNNER_NODE_LABEL = "loraplane.io/local-runner"
# Annotation kwok selects the nodes it manages by.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Loopback range for pod IPs: node i gets 127.1.i.0/24 (all of 127.0.0.0/8 is loopback on Linux).
POD_CIDR_PREFIX = "127.1"
SERVICE_CIDR = "10.96.0.0/16"


def repo_root() -> Path:
    """The checkout this package runs from (it is installed editable from the repo root)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "deploy" / "cluster" / "versions.env").is_file():
            return parent
    raise FileNotFoundError(
        f"deploy/cluster/versions.env not found above {here}: `loraplane cluster` runs from a "
        "loraplane checkout (pip install -e .)"
    )


def deploy_dir() -> Path:
    return repo_root() / "deploy" / "cluster"


def read_versions() -> dict[str, str]:
    """KEY=VALUE lines of deploy/cluster/versions.env."""
    versions: dict[str, str] = {}
    for line in (deploy_dir() / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            versions[key.strip()] = value.strip()
    return versions


def cache_root() -> Path:
    env = os.environ.get("LORAPLANE_CLUSTER_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "loraplane" / "cluster"


def bin_dir() -> Path:
    """Pinned binaries: <cache>/<KUBERNETES_VERSION>/bin (what deploy/cluster/build.sh fills)."""
    return cache_root() / read_versions()["KUBERNETES_VERSION"] / "bin"


def state_dir() -> Path:
    env = os.environ.get("LORAPLANE_CLUSTER_DIR")
    return Path(env) if env else cache_root() / "state"


def build_binaries(*, quiet: bool = False) -> Path:
    """Run deploy/cluster/build.sh (a no-op when every binary is already built)."""
    if shutil.which("go") is None:
        raise RuntimeError("`go` is not on PATH: the cluster binaries are built with Go >= 1.26")
    script = deploy_dir() / "build.sh"
    result = subprocess.run(
        ["bash", str(script)],
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed with exit code {result.returncode}")
    return Path(result.stdout.strip().splitlines()[-1])


@dataclass(slots=True)
class Process:
    """A process `cluster up` started, identified by PID and start time (PIDs get reused)."""

    name: str
    pid: int
    start_ticks: int
    log: str
    ports: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ClusterState:
    """What `cluster up` wrote to <state>/cluster.json, read by `down`, `status` and `env`."""

    state_dir: str
    bin_dir: str
    versions: dict[str, str]
    apiserver_port: int
    etcd_client_port: int
    etcd_peer_port: int
    nodes: int
    gpus_per_node: int
    processes: list[Process] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return Path(self.state_dir) / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def save(self) -> None:
        path = Path(self.state_dir) / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, state: Path) -> ClusterState | None:
        path = state / "cluster.json"
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        raw["processes"] = [Process(**p) for p in raw.get("processes", [])]
        return cls(**raw)
