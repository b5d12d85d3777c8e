"""`loraplane cluster up|down|status|env`: a real Kubernetes control plane on this machine."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

cluster_app = typer.Typer(
    no_args_is_help=True,
    help=(
        "etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok fake GPU nodes\n"
        "on loopback, built from the Go module proxy at pinned versions (docs/cluster.md).\n"
        "State lives in $LORAPLANE_CLUSTER_DIR (default ~/.cache/loraplane/cluster/state)."
    ),
)

StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir", help="Where the cluster keeps its state [env LORAPLANE_CLUSTER_DIR]."
    ),
]


def _state(state_dir: Path | None) -> Path:
    from loraplane.devcluster.layout import state_dir as default_state_dir

    return (state_dir or default_state_dir()).resolve()


@cluster_app.command()
def up(
    nodes: Annotated[int, typer.Option(help="Number of fake GPU nodes.")] = 2,
    gpus_per_node: Annotated[int, typer.Option(help="nvidia.com/gpu capacity of each node.")] = 8,
    cpu: Annotated[str, typer.Option(help="CPU capacity of each node.")] = "32",
    memory: Annotated[str, typer.Option(help="Memory capacity of each node.")] = "256Gi",
    build: Annotated[
        bool, typer.Option(help="Build missing binaries first (deploy/cluster/build.sh).")
    ] = True,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the cluster to be ready.")
    ] = 180.0,
    state_dir: StateDir = None,
) -> None:
    """Start the cluster and wait until the API is ready and every node is Ready."""
    from loraplane.devcluster import cluster, layout

    state = _state(state_dir)
    try:
        bin_dir = layout.build_binaries() if build else layout.bin_dir()
        cluster.up(
            state,
            bin_dir,
            cluster.NodeShape(nodes, gpus_per_node, cpu, memory),
            timeout_s=timeout,
            log=lambda line: typer.echo(line, err=True),
        )
    except (cluster.ClusterError, RuntimeError) as exc:  # (a ValueError is a refusal: exit 2)
        typer.echo(f"cluster up failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f'ready: eval "$(loraplane cluster env{_state_flag(state_dir)})"', err=True)


@cluster_app.command()
def down(state_dir: StateDir = None) -> None:
    """Stop every process `up` started (by PID) and check nothing is left listening."""
    from loraplane.devcluster import cluster

    problems = cluster.down(_state(state_dir), log=lambda line: typer.echo(line, err=True))
    if problems:
        typer.echo("cluster down left things behind:\n  " + "\n  ".join(problems), err=True)
        raise typer.Exit(1)
    typer.echo("cluster down: nothing left running", err=True)


@cluster_app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Say what runs where: processes, ports, API readiness, nodes and local-run pods."""
    from loraplane.devcluster import cluster

    report = cluster.status(_state(state_dir))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(_format_status(report))
    if not report.get("running"):
        raise typer.Exit(1)


@cluster_app.command()
def env(state_dir: StateDir = None) -> None:
    """Print shell exports: eval "$(loraplane cluster env)" puts the pinned kubectl and
    helm first on PATH and points KUBECONFIG at the admin kubeconfig."""
    from loraplane.devcluster import layout

    state = _state(state_dir)
    typer.echo(f"export KUBECONFIG={shlex.quote(str(state / 'kubeconfig'))}")
    typer.echo(f'export PATH={shlex.quote(str(layout.bin_dir()))}:"$PATH"')


@cluster_app.command()
def logs(
    pod: Annotated[
        str,
        typer.Argument(
            help="Pod name (a `pod/` prefix, as `kubectl get -o name` prints, is fine)."
        ),
    ],
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="The pod's namespace.")
    ] = "default",
    state_dir: StateDir = None,
) -> None:
    """Print a local-run pod's output (this cluster has no kubelet, so `kubectl logs` cannot
    reach it): `<state>/pods/<namespace>_<pod>_<uid>/log`, the newest pod of that name."""
    from loraplane.devcluster import cluster

    try:
        path = cluster.pod_log(_state(state_dir), namespace, pod.removeprefix("pod/"))
    except FileNotFoundError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    typer.echo(path.read_text(errors="replace"), nl=False)


def _state_flag(state_dir: Path | None) -> str:
    return f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else ""


def _format_status(report: dict[str, object]) -> str:
    lines = [f"state: {report['state_dir']}"]
    if "processes" not in report:
        lines.append("not running (no cluster.json)")
        return "\n".join(lines)
    lines.append(
        f"api:   {report['server']} ready={report.get('ready')}  kubeconfig: {report['kubeconfig']}"
    )
    for process in report["processes"]:  # type: ignore[attr-defined]
        ports = ",".join(str(p) for p in process["ports"]) or "-"
        state = "running" if process["running"] else "STOPPED"
        lines.append(
            f"  {process['name']:<24} pid {process['pid']:<8} {state:<8} ports {ports:<12} {process['log']}"
        )
    for node in report.get("nodes", []):  # type: ignore[attr-defined]
        gpus = node["allocatable"].get("nvidia.com/gpu", "0")
        lines.append(
            f"  node {node['name']:<19} ready={node['ready']!s:<5} gpus={gpus} pod CIDR {node['pod_cidr']}"
        )
    for pod in report.get("local_run_pods", []):  # type: ignore[attr-defined]
        process = pod["process"] or {}
        lines.append(
            f"  local-run {pod['pod']:<30} {pod['pod_ip'] or '-':<14} {pod['phase']:<9} ready={pod['ready']!s:<5} "
            f"pid={process.get('pid', '-')} log={process.get('log', '-')}"
        )
    return "\n".join(lines)
