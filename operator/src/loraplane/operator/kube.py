"""Kubernetes API access for the handlers (the `kubernetes` client) and kopf's login.

Credentials come from the service-account directory (`LORAPLANE_SERVICEACCOUNT_DIR`,
default the in-pod path) when it exists, else from the kubeconfig: the same code runs in
a real pod and as a local process on the development cluster (docs/cluster.md).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client, config, dynamic

from loraplane.operator.builders import COMPONENT_LABEL, POOL_LABEL, Manifest

FIELD_MANAGER = "loraplane-operator"
DEFAULT_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def service_account_dir() -> Path | None:
    path = Path(os.environ.get("LORAPLANE_SERVICEACCOUNT_DIR", DEFAULT_SA_DIR))
    return path if (path / "token").is_file() and "KUBERNETES_SERVICE_HOST" in os.environ else None


def load_client_config() -> None:
    sa = service_account_dir()
    if sa is not None:
        from kubernetes.config.incluster_config import InClusterConfigLoader

        InClusterConfigLoader(
            token_filename=str(sa / "token"), cert_filename=str(sa / "ca.crt")
        ).load_and_set()
    else:
        config.load_kube_config()


class Rejected(Exception):
    """The API refused a manifest as invalid (HTTP 422); the message is the API's own, which
    names the field (e.g. `spec.template.spec.volumes[0].persistentVolumeClaim.claimName`)."""


class SecretNotReadable(Exception):
    """The API refused to show the operator a Secret (403: RBAC does not allow it)."""


def api_message(exc: client.ApiException) -> str:
    """The `message` of an API error's Status body, else its status line."""
    try:
        message = json.loads(exc.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else f"HTTP {exc.status} {exc.reason}"


def decode_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    """A Secret's `data` base64-decoded, surrounding whitespace (a trailing newline from
    `echo`) stripped; values that are not UTF-8 text are left out."""
    decoded: dict[str, str] = {}
    for key, value in (data or {}).items():
        try:
            decoded[key] = base64.b64decode(value or "", validate=True).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError):
            continue
    return decoded


class Kube:
    """The few API calls the handlers make (all of them allowed by the chart's RBAC)."""

    def __init__(self) -> None:
        load_client_config()
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self._dynamic: dynamic.DynamicClient | None = None
        self._lock = threading.Lock()

    def _dyn(self) -> dynamic.DynamicClient:
        with self._lock:
            if self._dynamic is None:
                self._dynamic = dynamic.DynamicClient(self.api)
            return self._dynamic

    def apply(self, manifest: Manifest, dry_run: bool = False) -> None:
        """Server-side apply (creates or updates; a no-op when nothing changed). `Rejected`
        when the API finds the manifest invalid: then nothing of it was applied. With
        ``dry_run`` the API checks it (admission included) and stores nothing."""
        resource = self._dyn().resources.get(
            api_version=manifest["apiVersion"], kind=manifest["kind"]
        )
        try:
            self._dyn().server_side_apply(
                resource,
                body=manifest,
                namespace=manifest["metadata"]["namespace"],
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
                **({"dry_run": "All"} if dry_run else {}),
            )
        except client.ApiException as exc:
            if exc.status == 422:
                kind, name = manifest["kind"], manifest["metadata"]["name"]
                raise Rejected(f"{kind} {name}: {api_message(exc)}") from None
            raise

    def pool_pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        """The pool's worker pods as plain dicts (`name`, `ip`, `ready`, `deleting`)."""
        pods = self.core.list_namespaced_pod(
            namespace, label_selector=f"{POOL_LABEL}={pool},{COMPONENT_LABEL}=worker"
        )
        return [pod_view(self.api.sanitize_for_serialization(p)) for p in pods.items]

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            pool: dict[str, Any] = self.custom.get_namespaced_custom_object(
                "loraplane.io", "v1alpha1", namespace, "lorapools", name
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return pool

    def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data, decoded (`decode_secret_data`); None when it does not exist.
        The values are credentials: they go to the control plane and nowhere else."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status == 403:
                raise SecretNotReadable(
                    f"the operator may not get Secret {namespace}/{name} (HTTP 403)"
                ) from None
            raise
        return decode_secret_data(secret.data)

    def list_adapters(self, namespace: str) -> list[dict[str, Any]]:
        answer = self.custom.list_namespaced_custom_object(
            "loraplane.io", "v1alpha1", namespace, "loraadapters"
        )
        return list(answer.get("items") or [])


def pod_view(pod: dict[str, Any]) -> dict[str, Any]:
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    meta = pod["metadata"]
    return {
        "name": meta["name"],
        "namespace": meta.get("namespace", ""),
        "pool": (meta.get("labels") or {}).get(POOL_LABEL, ""),
        "ip": status.get("podIP") or "",
        "ready": ready and bool(status.get("podIP")) and not meta.get("deletionTimestamp"),
        "deleting": bool(meta.get("deletionTimestamp")),
    }


class ControlPlaneLocator:
    """The control plane's base URL: fixed, or found by a pod label selector (cached)."""

    def __init__(
        self,
        kube: Kube | None,
        url: str,
        selector: str | None,
        namespace: str | None,
        port: int,
        ttl_s: float = 5.0,
    ) -> None:
        self._kube, self._url, self._selector = kube, url, selector
        self._namespace, self._port, self._ttl = namespace, port, ttl_s
        self._cached: tuple[float, str] | None = None

    def __call__(self) -> str:
        if not self._selector or self._kube is None:
            return self._url
        if self._cached and time.monotonic() - self._cached[0] < self._ttl:
            return self._cached[1]
        pods = self._kube.core.list_namespaced_pod(
            self._namespace or "default", label_selector=self._selector
        )
        views = [pod_view(self._kube.api.sanitize_for_serialization(p)) for p in pods.items]
        ready = sorted((v for v in views if v["ready"]), key=lambda v: v["name"])
        if not ready:
            raise LookupError(
                f"no ready control plane pod matches {self._selector!r} in namespace "
                f"{self._namespace or 'default'}"
            )
        url = f"http://{ready[0]['ip']}:{self._port}"
        self._cached = (time.monotonic(), url)
        return url
