"""`loraplane operator run`: the kopf operator for LoRAPool and LoRAAdapter."""

from __future__ import annotations

import os
from typing import Annotated

import typer

operator_app = typer.Typer(no_args_is_help=True, help="The Kubernetes operator (kopf).")


def _labels(pairs: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--worker-pod-label {pair!r} must be KEY=VALUE")
        labels[key] = value
    return labels


@operator_app.command()
def run(
    controlplane_url: Annotated[
        str,
        typer.Option(envvar="LORAPLANE_CONTROLPLANE_URL", help="Base URL of the control plane"),
    ] = "http://loraplane-controlplane:8080",
    controlplane_selector: Annotated[
        str | None,
        typer.Option(
            envvar="LORAPLANE_CONTROLPLANE_SELECTOR",
            help="Find the control plane by this pod label selector instead of the URL "
            "(clusters whose Services do not route, like `loraplane cluster up`)",
        ),
    ] = None,
    controlplane_namespace: Annotated[
        str | None,
        typer.Option(envvar="LORAPLANE_CONTROLPLANE_NAMESPACE", help="Namespace of that pod"),
    ] = None,
    controlplane_port: Annotated[int, typer.Option(help="Port of that pod")] = 8080,
    peering: Annotated[
        str, typer.Option(help="ClusterKopfPeering object used for leader election")
    ] = "loraplane",
    standalone: Annotated[
        bool, typer.Option(help="No leader election (a single replica, development)")
    ] = False,
    priority: Annotated[
        int | None,
        typer.Option(
            help="Peering priority; the highest live replica acts (default: from the start "
            "time, so the newest replica acts and a restarted one never waits for its old record)"
        ),
    ] = None,
    peering_lifetime: Annotated[
        int,
        typer.Option(
            help="Seconds a replica's peering record stays alive without a keep-alive (>= 10): "
            "how long a standby waits for a leader that died"
        ),
    ] = 15,
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch only these namespaces (default: all)"),
    ] = None,
    resync_interval: Annotated[
        float, typer.Option(help="Seconds between reconciliations of every object")
    ] = 10.0,
    max_attempts: Annotated[
        int, typer.Option(help="Failed loads per adapter generation before phase Failed")
    ] = 5,
    backoff: Annotated[
        float, typer.Option(help="First retry delay in seconds (doubles, at most 60 s)")
    ] = 2.0,
    worker_image: Annotated[
        str, typer.Option(envvar="LORAPLANE_WORKER_IMAGE", help="Default worker image")
    ] = "ghcr.io/loraplane/worker:0.1.0",
    worker_pod_label: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE label on every worker pod (repeatable)"),
    ] = None,
    health: Annotated[
        str | None,
        typer.Option(help="Liveness endpoint, e.g. http://0.0.0.0:8081/healthz"),
    ] = None,
    metrics_port: Annotated[
        int,
        typer.Option(help="Port of the Prometheus endpoint (GET /metrics); 0: none"),
    ] = 9090,
    metrics_host: Annotated[
        str, typer.Option(help="Address the Prometheus endpoint binds to")
    ] = "0.0.0.0",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the operator until interrupted. The admin token is read from
    LORAPLANE_ADMIN_TOKEN (never a flag, so it does not show in `ps`)."""
    import logging

    import kopf

    from loraplane.operator import handlers
    from loraplane.operator.builders import WorkerDefaults
    from loraplane.operator.config import OperatorConfig, newest_first_priority
    from loraplane.operator.metrics import OperatorMetrics
    from loraplane.operator.status import RetryPolicy

    if controlplane_port < 1 or max_attempts < 1 or resync_interval <= 0:
        raise ValueError(
            f"--controlplane-port ({controlplane_port}), --max-attempts ({max_attempts}) and "
            f"--resync-interval ({resync_interval}) must be > 0"
        )
    if peering_lifetime < 10:
        raise typer.BadParameter(
            f"--peering-lifetime {peering_lifetime}: must be >= 10 (kopf renews a record "
            "5-10 s before it expires)"
        )
    if not 0 <= metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be 0..65535, got {metrics_port}")
    config = OperatorConfig(
        controlplane_url=controlplane_url,
        controlplane_selector=controlplane_selector,
        controlplane_namespace=controlplane_namespace,
        controlplane_port=controlplane_port,
        admin_token=os.environ.get("LORAPLANE_ADMIN_TOKEN") or None,
        resync_interval_s=resync_interval,
        retry=RetryPolicy(max_attempts=max_attempts, base_delay_s=backoff),
        worker=WorkerDefaults(
            image=worker_image,
            pod_labels=_labels(worker_pod_label or []),
            admin_token=os.environ.get("LORAPLANE_WORKER_ADMIN_TOKEN") or None,
        ),
        peering_name=peering,
        standalone=standalone,
        priority=priority if priority is not None else newest_first_priority(),
        peering_lifetime_s=peering_lifetime,
        namespaces=tuple(namespace or ()),
        health_endpoint=health,
    )
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    metrics = OperatorMetrics(standalone=config.standalone)
    metrics.watch_peering()
    if metrics_port:
        metrics.serve(metrics_port, metrics_host)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, config, metrics)
    kopf.run(
        registry=registry,
        memo=kopf.Memo(config=config, metrics=metrics),
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=config.health_endpoint,
        standalone=config.standalone,
        peering_name=None if config.standalone else config.peering_name,
        priority=config.priority,
    )
