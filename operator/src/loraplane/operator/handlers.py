"""Thin kopf handlers: read observed state, call the pure builders and status logic,
apply the result. Every handler is idempotent; timers re-run them so nothing depends on
one create event having been seen.

`register(registry, config)` attaches them (timer intervals come from the config);
`configure` is the one startup function holding every kopf setting.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import threading
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import kopf

from loraplane.operator import builders
from loraplane.operator import status as states
from loraplane.operator.config import OperatorConfig
from loraplane.operator.cpclient import (
    ControlPlaneClient,
    ControlPlaneError,
    ControlPlaneUnavailable,
)
from loraplane.operator.kube import (
    ControlPlaneLocator,
    Kube,
    Rejected,
    SecretNotReadable,
    pod_view,
    service_account_dir,
)
from loraplane.operator.metrics import OperatorMetrics

FINALIZER = "loraplane.io/unload"
POOLS = ("loraplane.io", "v1alpha1", "lorapools")
ADAPTERS = ("loraplane.io", "v1alpha1", "loraadapters")
# Control plane error codes that mean the spec itself cannot work (no retry until it changes).
PERMANENT_CODES = {
    "invalid_value": "InvalidSpec",
    "preflight_failed": "PreflightFailed",
    "digest_mismatch": "DigestMismatch",
    "source_not_allowed": "SourceNotAllowed",
    "validation_error": "InvalidSpec",
}
PERMANENT_REASONS = set(PERMANENT_CODES.values())

log = logging.getLogger("loraplane.operator")


@dataclass
class Runtime:
    """What handlers share: settings, the Kubernetes API and the control plane client."""

    config: OperatorConfig
    kube: Kube
    controlplane: ControlPlaneClient


def _runtime(memo: kopf.Memo) -> Runtime:
    runtime: Runtime = memo["runtime"]
    return runtime


def _metrics(memo: kopf.Memo) -> OperatorMetrics | None:
    metrics: OperatorMetrics | None = memo.get("metrics")
    return metrics


# ------------------------------------------------------------------ startup and login


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Every kopf setting, in one place."""
    config: OperatorConfig = memo["config"]
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="loraplane.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="loraplane.io", key="last-handled-configuration"
    )
    settings.peering.name = config.peering_name
    settings.peering.priority = config.priority
    settings.peering.standalone = config.standalone
    settings.peering.mandatory = not config.standalone
    settings.peering.clusterwide = not config.namespaces
    # A short lifetime so a standby takes over within seconds of a leader dying; with a
    # keep-alive every few seconds, kopf logs none of them.
    settings.peering.lifetime = config.peering_lifetime_s
    settings.peering.stealth = True
    # Our own Events (phase transitions) are posted explicitly; log lines are not.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    kube = Kube()
    locator = ControlPlaneLocator(
        kube,
        config.controlplane_url,
        config.controlplane_selector,
        config.controlplane_namespace,
        config.controlplane_port,
    )
    metrics = _metrics(memo)
    runtime = Runtime(
        config,
        kube,
        ControlPlaneClient(
            locator,
            config.admin_token,
            on_reachable=metrics.controlplane_reachable if metrics else None,
        ),
    )
    memo["runtime"] = runtime
    memo["sweeper"] = RegistrySweeper(runtime, max(config.resync_interval_s, 5.0))
    memo["sweeper"].start()


def cleanup(memo: kopf.Memo, **_: Any) -> None:
    sweeper = memo.get("sweeper")
    if sweeper is not None:
        sweeper.stop()
    runtime = memo.get("runtime")
    if runtime is not None:
        runtime.controlplane.close()


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Service-account files from LORAPLANE_SERVICEACCOUNT_DIR (in a pod or a local-run
    pod), else the kubeconfig."""
    sa = service_account_dir()
    if sa is None:
        return kopf.login_with_kubeconfig(**kwargs)
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    return kopf.ConnectionInfo(
        server=f"https://{host}:{port}",
        ca_path=str(sa / "ca.crt"),
        scheme="Bearer",
        token=(sa / "token").read_text().strip(),
        default_namespace=(sa / "namespace").read_text().strip()
        if (sa / "namespace").exists()
        else None,
    )


# ------------------------------------------------------------------ pools


def _owner(name: str, namespace: str, uid: str) -> builders.Owner:
    return builders.Owner(name=name, namespace=namespace, uid=uid)


def reconcile_pool(
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Children applied, pool and ready pods registered, stale workers removed, status and
    Events (workers registered or removed, phase changes)."""
    runtime = _runtime(memo)
    generation = int(meta.get("generation") or 0)
    now = states.now_iso()
    try:
        builders.check_pool_name(name)
        pool = builders.PoolSpec.from_spec(spec)
    except ValueError as exc:
        new = states.pool_problem(generation, dict(status), now, "InvalidSpec", str(exc))
        _write_pool_status(new, dict(status), body, patch)
        raise kopf.PermanentError(str(exc)) from exc
    # The children as the API would take them, then the control plane, then the children for
    # real: a spec either refuses (the API: a volume's source, say; the control plane: limits
    # its adapters or pinned slots contradict) reaches neither. An outage of the control plane
    # does not hold the pods back.
    children = builders.build_pool_children(
        _owner(name, namespace, uid), pool, runtime.config.worker
    )
    _apply_children(runtime, children, generation, status, now, body, patch, dry_run=True)
    outage: ControlPlaneUnavailable | None = None
    try:
        runtime.controlplane.put_pool(
            namespace, name, builders.build_controlplane_pool(pool), key=""
        )
    except ControlPlaneUnavailable as exc:
        outage = exc
    except ControlPlaneError as exc:
        _rejected(generation, status, now, body, patch, exc, runtime)
    _apply_children(runtime, children, generation, status, now, body, patch, dry_run=False)
    pods = [
        {**p, "worker": builders.worker_name(namespace, p["name"])}
        for p in runtime.kube.pool_pods(namespace, name)
    ]
    try:
        if outage is not None:
            raise outage
        cp_workers, changes = _sync_workers(runtime, namespace, name, pool.dp, pods)
    except ControlPlaneUnavailable as exc:
        new = states.pool_unknown(
            generation, pool.replicas, pods, dict(status), now, f"control plane unreachable: {exc}"
        )
        _write_pool_status(new, dict(status), body, patch)
        raise kopf.TemporaryError(
            f"control plane unavailable: {exc}", delay=runtime.config.resync_interval_s
        ) from exc
    except ControlPlaneError as exc:
        _rejected(generation, status, now, body, patch, exc, runtime)
    new = states.pool_status(generation, pool.replicas, pods, cp_workers, dict(status), now)
    _write_pool_status(new, dict(status), body, patch, changes)


def _apply_children(
    runtime: Runtime,
    children: list[dict[str, Any]],
    generation: int,
    status: kopf.Status,
    now: str,
    body: kopf.Body,
    patch: kopf.Patch,
    *,
    dry_run: bool,
) -> None:
    try:
        for manifest in children:
            runtime.kube.apply(manifest, dry_run=dry_run)
    except Rejected as exc:
        # What the schema and the builders let through but the API refuses (a volume's
        # source, say); the refused object is unchanged. The next spec change retries.
        message = f"the API refused the pool's {exc}"
        new = states.pool_problem(generation, dict(status), now, "InvalidSpec", message)
        _write_pool_status(new, dict(status), body, patch)
        raise kopf.PermanentError(message) from exc


def _rejected(
    generation: int,
    status: kopf.Status,
    now: str,
    body: kopf.Body,
    patch: kopf.Patch,
    exc: ControlPlaneError,
    runtime: Runtime,
) -> NoReturn:
    new = states.pool_problem(generation, dict(status), now, "ControlPlaneRejected", str(exc))
    _write_pool_status(new, dict(status), body, patch)
    raise kopf.TemporaryError(str(exc), delay=runtime.config.resync_interval_s) from exc


def _write_pool_status(
    new: dict[str, Any],
    old: dict[str, Any],
    body: kopf.Body,
    patch: kopf.Patch,
    changes: list[tuple[str, str, str]] | None = None,
) -> None:
    patch.status.update(new)
    for type_, reason, message in [*(changes or []), *states.pool_events(old, new)]:
        kopf.event(body, type=type_, reason=reason, message=message[:1000])


def _sync_workers(
    runtime: Runtime, namespace: str, pool: str, dp: int, pods: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, str, str]]]:
    """Register ready pods the control plane lacks (or knows at another IP); remove
    workers whose pod is gone. Returns the control plane's workers afterwards and an Event
    (type, reason, message) per change."""
    cp = runtime.controlplane
    known = {w["name"]: w for w in cp.list_workers(namespace, pool)}
    changes: list[tuple[str, str, str]] = []
    for pod in pods:
        endpoint = f"http://{pod['ip']}:{builders.WORKER_PORT}"
        current = known.get(pod["worker"])
        if pod["ready"] and (current is None or current.get("endpoint") != endpoint):
            cp.register_worker(
                builders.build_worker_registration(namespace, pool, pod["name"], pod["ip"], dp),
                key="",
            )
            changes.append(
                ("Normal", "WorkerRegistered", f"pod {pod['name']} registered at {endpoint}")
            )
    live = {p["worker"] for p in pods if not p["deleting"]}
    for worker in known:
        if worker not in live:
            cp.delete_worker(worker)
            changes.append(
                ("Normal", "WorkerRemoved", f"worker {worker} deregistered: its pod is gone")
            )
    workers = cp.list_workers(namespace, pool) if changes else list(known.values())
    return workers, changes


def forget_pool(
    name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Best effort: drop the pool's workers and the pool from the registry. What fails here
    (the control plane down, adapters still registered) `sweep_registry` finishes later."""
    runtime = _runtime(memo)
    try:
        _forget_registry_pool(runtime, namespace, name)
    except (ControlPlaneUnavailable, ControlPlaneError) as exc:
        logger.warning(
            "could not remove pool %s/%s from the control plane yet: %s", namespace, name, exc
        )


def _forget_registry_pool(runtime: Runtime, namespace: str, name: str) -> None:
    """Deregister the pool's workers, then delete the pool (a 409 while adapters remain)."""
    _forget_registry_pool_workers(runtime, namespace, name)
    runtime.controlplane.delete_pool(namespace, name)


def _forget_registry_pool_workers(runtime: Runtime, namespace: str, name: str) -> None:
    for worker in runtime.controlplane.list_workers(namespace, name):
        runtime.controlplane.delete_worker(worker["name"])


def sweep_registry(runtime: Runtime) -> list[str]:
    """Registry pools whose LoRAPool is gone (deleted while the control plane was down, or
    while no operator ran): workers deregistered, so their adapters can be unloaded and
    released, and the pool deleted once it has none. Only the watched namespaces. Returns
    `namespace/name` of each pool worked on."""
    swept = []
    for pool in runtime.controlplane.list_pools():
        namespace, name = str(pool["namespace"]), str(pool["name"])
        if runtime.config.namespaces and namespace not in runtime.config.namespaces:
            continue
        if runtime.kube.get_pool(namespace, name) is not None:
            continue
        swept.append(f"{namespace}/{name}")
        try:
            _forget_registry_pool(runtime, namespace, name)
        except ControlPlaneError as exc:
            # Adapters still registered (their LoRAAdapters' deletion unloads them): next pass.
            log.info("registry pool %s/%s not deleted yet: %s", namespace, name, exc.message)
    return swept


class RegistrySweeper:
    """`sweep_registry` every `interval_s` on a thread of its own (kopf timers belong to an
    object; this is about objects that are gone). Control plane outages only skip a pass."""

    def __init__(self, runtime: Runtime, interval_s: float) -> None:
        self._runtime = runtime
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                swept = sweep_registry(self._runtime)
            except ControlPlaneUnavailable:
                continue
            except Exception:  # a pass must not end the thread; the next one retries
                log.exception("registry sweep failed")
                continue
            if swept:
                log.info("registry pools without a LoRAPool cleaned up: %s", ", ".join(swept))


def on_worker_pod(
    event: dict[str, Any],
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """A worker pod changed: (de)register it at once instead of waiting for the timer."""
    runtime = _runtime(memo)
    body = event.get("object") or {}
    if not body.get("metadata"):
        return
    pod = pod_view(body)
    pool_name = labels.get(builders.POOL_LABEL, "")
    worker = builders.worker_name(namespace, pod["name"])
    try:
        if event.get("type") == "DELETED" or pod["deleting"]:
            runtime.controlplane.delete_worker(worker)
            return
        if not pod["ready"]:
            return
        pool = runtime.kube.get_pool(namespace, pool_name)
        if pool is None:
            return
        dp = int((pool.get("spec") or {}).get("dp", 1))
        known = {w["name"]: w for w in runtime.controlplane.list_workers(namespace, pool_name)}
        endpoint = f"http://{pod['ip']}:{builders.WORKER_PORT}"
        if (known.get(worker) or {}).get("endpoint") != endpoint:
            runtime.controlplane.register_worker(
                builders.build_worker_registration(
                    namespace, pool_name, pod["name"], pod["ip"], dp
                ),
                key="",
            )
    except (ControlPlaneUnavailable, ControlPlaneError) as exc:
        # The pool's timer repairs it on its next pass.
        logger.info("worker %s not (de)registered yet: %s", worker, exc)


# ------------------------------------------------------------------ adapters


def reconcile_adapter(
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Register/update/load the adapter per its spec and report what the control plane sees."""
    runtime = _runtime(memo)
    if meta.get("deletionTimestamp"):
        return
    generation = int(meta.get("generation") or 0)
    old = dict(status)
    spec_dict = dict(spec)
    placement = builders.placement_of(spec_dict)
    same_generation = old.get("observedGeneration") == generation
    view = states.AdapterView(
        generation=generation,
        cp_adapter=None,
        ready_workers=[],
        placement=placement,
        attempts=int(old.get("attempts", 0)) if same_generation else 0,
        actions=int(old.get("actions", 0)),
    )
    try:
        view = _observe_and_act(
            runtime, namespace, name, uid, spec_dict, old, view, same_generation
        )
    except ControlPlaneUnavailable as exc:
        view = replace(view, unreachable=str(exc))
        phase = _write_adapter_status(view, old, body, patch)
        record_adapter_phase(_metrics(memo), namespace, name, spec_dict, phase)
        raise kopf.TemporaryError(str(exc), delay=runtime.config.resync_interval_s) from exc
    phase = _write_adapter_status(view, old, body, patch)
    record_adapter_phase(_metrics(memo), namespace, name, spec_dict, phase)


def record_adapter_phase(
    metrics: OperatorMetrics | None, namespace: str, name: str, spec: dict[str, Any], phase: str
) -> None:
    """The phase just written, for `loraplane_operator_adapters`."""
    if metrics is not None:
        metrics.adapter_phase(namespace, name, str(spec.get("pool", "")), phase)


def _observe_and_act(
    runtime: Runtime,
    namespace: str,
    name: str,
    uid: str,
    spec: dict[str, Any],
    old: dict[str, Any],
    view: states.AdapterView,
    same_generation: bool,
) -> states.AdapterView:
    validated = states.find_condition(old.get("conditions"), "Validated")
    if same_generation and validated and validated.get("reason") in PERMANENT_REASONS:
        # Rejected for this generation; nothing to retry until the spec changes.
        return replace(view, invalid=(str(validated["reason"]), str(validated.get("message", ""))))
    pool_name = str(spec.get("pool", ""))
    pool = runtime.kube.get_pool(namespace, pool_name)
    if pool is None:
        return replace(
            view,
            pending=("PoolNotFound", f"spec.pool: LoRAPool {namespace}/{pool_name} does not exist"),
        )
    pool_spec = pool.get("spec") or {}
    view = replace(view, desired_replicas=int(pool_spec.get("replicas", 1)))
    max_per_batch = int(pool_spec.get("maxLorasPerBatch", 4))
    siblings = [
        a
        for a in runtime.kube.list_adapters(namespace)
        if (a.get("spec") or {}).get("pool") == pool_name
    ]
    excess = states.excess_pinned(siblings, max_per_batch)
    if name in excess:
        return replace(view, pending=("TooManyPinned", excess[name]))
    cp = runtime.controlplane
    ready_workers = sorted(
        w["name"] for w in cp.list_workers(namespace, pool_name) if w.get("state") == "ready"
    )
    cp_adapter = cp.get_adapter(namespace, name)
    view = replace(view, cp_adapter=cp_adapter, ready_workers=ready_workers)
    now = dt.datetime.now(dt.UTC)
    plan = states.plan_adapter(
        spec,
        view.placement,
        old if same_generation else {},
        view.generation,
        cp_adapter,
        ready_workers,
        runtime.config.retry,
        now,
    )
    if plan.action == "give_up":
        return replace(view, gave_up=True, last_error=old.get("lastError") or plan.reason)
    if plan.action in ("none", "wait"):
        error = old.get("lastError") if view.attempts else None
        return replace(view, last_error=error or None)
    key = idempotency_key(uid, view, plan.action)
    credentials: dict[str, str] | None = None
    if plan.action in ("register", "update_version"):
        # Only a fetch needs them: an adapter already loaded stays as it is without its Secret.
        try:
            credentials = source_credentials(runtime.kube, namespace, spec)
        except CredentialsUnavailable as exc:
            return replace(view, pending=(exc.reason, exc.message))
        except ValueError as exc:
            return replace(view, invalid=("InvalidSpec", str(exc)))
    try:
        if plan.action == "register":
            answer = cp.register_adapter(
                builders.build_adapter_registration(namespace, name, spec, credentials), key
            )
        elif plan.action == "update_version":
            source = builders.build_adapter_registration(namespace, name, spec, credentials)[
                "source"
            ]
            answer = cp.new_version(namespace, name, source, key)
        elif plan.action == "patch":
            answer = cp.patch_adapter(
                namespace,
                name,
                {
                    "pinned": bool(spec.get("pinned", False)),
                    "priority": int(spec.get("priority", 0)),
                    "load_policy": str(spec.get("loadPolicy", "OnDemand")),
                },
                key,
            )
        else:
            answer = cp.load_adapter(namespace, name, view.placement, key)
    except ControlPlaneError as exc:
        return _failed_attempt(runtime, namespace, name, view, exc)
    adapter = (answer or {}).get("adapter") or cp.get_adapter(namespace, name)
    return replace(
        view,
        cp_adapter=adapter,
        attempts=0,
        actions=view.actions + 1,
        last_error=None,
        event=action_event(plan, spec, old),
    )


def action_event(
    plan: states.Plan, spec: dict[str, Any], old: dict[str, Any]
) -> tuple[str, str, str]:
    """The Event for a control plane action that succeeded: (type, reason, message)."""
    uri = str((spec.get("source") or {}).get("uri") or "")
    if plan.action == "register":
        return ("Normal", "Registered", f"registered from {uri} and loading it")
    if plan.action == "update_version":
        return (
            "Normal",
            "VersionSwap",
            f"new version from {uri}: loaded beside the old one, then switched (make-before-break)",
        )
    if plan.action == "patch":
        return (
            "Normal",
            "Updated",
            f"pinned={bool(spec.get('pinned', False))}, priority={int(spec.get('priority', 0))}",
        )
    if old.get("phase") in ("Ready", "Degraded"):
        return ("Normal", "Repair", f"loading again where it is missing: {plan.reason}")
    return ("Normal", "Load", f"loading: {plan.reason}")


class CredentialsUnavailable(Exception):
    """The source's Secret cannot be used yet (`reason`, `message`): the adapter is Pending
    and every pass (the resync timer) looks again."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def source_credentials(kube: Kube, namespace: str, spec: dict[str, Any]) -> dict[str, str] | None:
    """The control plane's `source.credentials` from `spec.source.credentialsSecretRef`'s
    Secret in the adapter's namespace; None without a ref. CredentialsUnavailable when the
    Secret is missing, unreadable or lacks the keys the source's scheme needs; ValueError when
    the scheme takes no credentials."""
    secret = builders.credentials_secret_name(spec)
    if secret is None:
        return None
    uri = str((spec.get("source") or {}).get("uri") or "")
    field = "spec.source.credentialsSecretRef.name"
    builders.check_credentials_supported(uri)
    wanted = builders.secret_keys_wanted(uri)
    try:
        data = kube.get_secret_data(namespace, secret)
    except SecretNotReadable as exc:
        raise CredentialsUnavailable(
            "CredentialsNotReadable",
            f"{field}: {exc}; the chart's RBAC grants get on secrets in the watched namespaces",
        ) from None
    if data is None:
        raise CredentialsUnavailable(
            "CredentialsNotFound",
            f"{field}: Secret {secret!r} does not exist in namespace {namespace}; create it "
            f"with the keys {wanted}",
        )
    credentials = builders.source_credentials(uri, data)
    if not credentials:
        has = ", ".join(sorted(k for k, v in data.items() if v)) or "no non-empty keys"
        raise CredentialsUnavailable(
            "CredentialsNotFound",
            f"{field}: Secret {secret!r} in namespace {namespace} lacks the keys a "
            f"{builders.uri_scheme(uri)}:// source uses: {wanted} (it has {has})",
        )
    return credentials


def idempotency_key(uid: str, view: states.AdapterView, action: str) -> str:
    """`<uid>-g<generation>-<action>-a<actions>-<attempts>`, from the stored status only.

    `actions` (successful actions so far, never reset) makes a later action of the same kind
    in the same generation a new request, e.g. a second load after a replica lost the adapter;
    `attempts` makes a retry after a failure one. Neither moves until the status is written, so
    an operator that dies between the call and the status write repeats the same key and gets
    the same operation back."""
    return f"{uid}-g{view.generation}-{action}-a{view.actions}-{view.attempts}"


def _failed_attempt(
    runtime: Runtime, namespace: str, name: str, view: states.AdapterView, exc: ControlPlaneError
) -> states.AdapterView:
    field, text = spec_field(exc.field or ""), spec_field(exc.message)
    message = f"{field + ': ' if field and field not in text else ''}{text}"
    if exc.status in (400, 422) and exc.code in PERMANENT_CODES:
        return replace(view, invalid=(PERMANENT_CODES[exc.code], message))
    if exc.code == "too_many_pinned":
        return replace(view, pending=("TooManyPinned", message))
    if exc.status == 404:
        return replace(view, pending=("PoolNotRegistered", message))
    adapter = runtime.controlplane.get_adapter(namespace, name)
    attempts = view.attempts + 1
    policy = runtime.config.retry
    gave_up = attempts >= policy.max_attempts
    then = (
        "giving up for this generation"
        if gave_up
        else f"retrying in {policy.delay(attempts):.0f} s"
    )
    return replace(
        view,
        cp_adapter=adapter,
        attempts=attempts,
        last_error=message,
        gave_up=gave_up,
        event=(
            "Warning",
            "AttemptFailed",
            f"attempt {attempts}/{policy.max_attempts} failed: {message}; {then}",
        ),
    )


# The control plane's request fields and the LoRAAdapter fields they are built from
# (builders.build_adapter_registration; the load, patch and version bodies reuse them).
# `body.load` has no counterpart (always true) and stays as it is.
API_TO_SPEC = {
    "body.source.credentials": "spec.source.credentialsSecretRef",  # the Secret's keys
    "body.source": "spec.source",  # .uri, .sha256 alike
    "body.placement": "spec.placement",  # {"count": N} <- spec.placement.count
    "body.pool": "spec.pool",
    "body.pinned": "spec.pinned",
    "body.priority": "spec.priority",
    "body.load_policy": "spec.loadPolicy",
    "body.name": "metadata.name",
    "body.namespace": "metadata.namespace",
}
# A field name opens a message, or one part of a `; `-joined validation message.
# Longest first, so `body.source.credentials` is not read as `body.source`.
_API_FIELD = re.compile(
    r"(^|; )("
    + "|".join(re.escape(k) for k in sorted(API_TO_SPEC, key=len, reverse=True))
    + r")(?=[.:\s]|$)"
)


def spec_field(text: str) -> str:
    """Control plane field names (`body.source.uri`) at the start of `text`, or of a part of
    it, renamed to the LoRAAdapter's (`spec.source.uri`) for its status."""
    return _API_FIELD.sub(lambda m: m.group(1) + API_TO_SPEC[m.group(2)], text)


def _write_adapter_status(
    view: states.AdapterView, old: dict[str, Any], body: kopf.Body, patch: kopf.Patch
) -> str:
    """Patch the status; returns the phase written."""
    now = states.now_iso()
    new = states.adapter_status(view, old, now)
    if view.attempts and view.attempts != (
        old.get("attempts") if old.get("observedGeneration") == view.generation else 0
    ):
        new["lastAttemptTime"] = now
    else:
        new["lastAttemptTime"] = old.get("lastAttemptTime") if view.attempts else None
    patch.status.update(new)
    events = [view.event] if view.event else []
    events += states.replica_events(old, new)
    before, after = old.get("phase"), new["phase"]
    if before != after:
        ready = states.find_condition(new["conditions"], "Ready") or {}
        message = f"{before or 'None'} -> {after}: {ready.get('message', '')}"
        events.append((_event_type(after), after, message))
    for type_, reason, message in events:
        kopf.event(body, type=type_, reason=reason, message=message[:1000])
    return str(after)


def _event_type(phase: str) -> str:
    return "Warning" if phase in ("Failed", "Degraded", "Unknown") else "Normal"


def unload_adapter(
    name: str,
    namespace: str,
    uid: str,
    body: kopf.Body,
    patch: kopf.Patch,
    retry: int,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Finalizer `loraplane.io/unload`: unloaded everywhere and forgotten before delete."""
    runtime = _runtime(memo)
    metrics = _metrics(memo)
    if retry == 0:
        patch.status["phase"] = "Unloading"
        record_adapter_phase(metrics, namespace, name, dict(body.get("spec") or {}), "Unloading")
        kopf.event(body, type="Normal", reason="Unloading", message="unloading from every worker")
    delay = runtime.config.retry.delay(retry + 1)
    pool = str((body.get("spec") or {}).get("pool", ""))
    try:
        try:
            runtime.controlplane.delete_adapter(namespace, name, key=f"{uid}-delete-{retry}")
        except ControlPlaneError:
            if runtime.kube.get_pool(namespace, pool) is not None:
                raise
            # The pool is gone (deleted while the control plane was down): nothing serves
            # the adapter, and its unreachable workers would fail every unload. Release them.
            _forget_registry_pool_workers(runtime, namespace, pool)
            kopf.event(
                body,
                type="Normal",
                reason="PoolGone",
                message=f"LoRAPool {namespace}/{pool} is gone: its workers were deregistered",
            )
            runtime.controlplane.delete_adapter(namespace, name, key=f"{uid}-delete-{retry}-gone")
    except ControlPlaneUnavailable as exc:
        raise kopf.TemporaryError(f"control plane unavailable: {exc}", delay=delay) from exc
    except ControlPlaneError as exc:
        kopf.event(body, type="Warning", reason="UnloadFailed", message=exc.message[:1000])
        raise kopf.TemporaryError(f"unload failed: {exc.message}", delay=delay) from exc
    kopf.event(
        body, type="Normal", reason="Unloaded", message="unloaded everywhere; finalizer removed"
    )
    if metrics is not None:
        metrics.forget_adapter(namespace, name)


# ------------------------------------------------------------------ registration

_SELECTOR = re.compile(r"^[\w./-]+=[\w.-]*$")


def register(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    metrics: OperatorMetrics | None = None,
) -> None:
    """Attach every handler to `registry` (intervals from `config`); with `metrics`, every
    LoRAPool/LoRAAdapter reconcile pass is counted and timed."""
    interval = config.resync_interval_s
    pool_handler, adapter_handler = reconcile_pool, reconcile_adapter
    if metrics is not None:
        pool_handler = metrics.instrument("lorapool", reconcile_pool)
        adapter_handler = metrics.instrument("loraadapter", reconcile_adapter)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.login(registry=registry)(login)

    kopf.on.resume(*POOLS, registry=registry, backoff=5)(pool_handler)
    kopf.on.create(*POOLS, registry=registry, backoff=5)(pool_handler)
    kopf.on.update(*POOLS, registry=registry, field="spec", backoff=5)(pool_handler)
    kopf.timer(
        *POOLS,
        registry=registry,
        id="resync_pool",
        interval=interval,
        initial_delay=interval,
        backoff=interval,
    )(pool_handler)
    kopf.on.delete(*POOLS, registry=registry, optional=True)(forget_pool)
    kopf.on.event(
        "",
        "v1",
        "pods",
        registry=registry,
        labels={builders.POOL_LABEL: kopf.PRESENT, builders.COMPONENT_LABEL: "worker"},
    )(on_worker_pod)

    kopf.on.resume(*ADAPTERS, registry=registry, backoff=5)(adapter_handler)
    kopf.on.create(*ADAPTERS, registry=registry, backoff=5)(adapter_handler)
    kopf.on.update(*ADAPTERS, registry=registry, field="spec", backoff=5)(adapter_handler)
    kopf.timer(
        *ADAPTERS,
        registry=registry,
        id="resync_adapter",
        interval=interval,
        initial_delay=interval,
        backoff=interval,
    )(adapter_handler)
    kopf.on.delete(*ADAPTERS, registry=registry, retries=30, backoff=config.retry.base_delay_s)(
        unload_adapter
    )
