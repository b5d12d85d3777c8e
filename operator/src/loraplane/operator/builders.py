"""Pure builders: a LoRAPool's spec in, plain Kubernetes manifests (dicts) out.

Nothing here talks to an API; the handlers apply what these return. Names are
deterministic (`<pool>` for the StatefulSet, `<pool>-workers` for the headless Service,
`<pool>` for the PodDisruptionBudget) so applying twice changes nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplane.rules.names import is_dns_label

Manifest = dict[str, Any]

GROUP = "loraplane.io"
VERSION = "v1alpha1"
POOL_LABEL = "loraplane.io/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKER_PORT = 8000
GPU_RESOURCE = "nvidia.com/gpu"
# The worker image keeps Triton's compiled kernels here (TRITON_CACHE_DIR under it,
# docker/worker.Dockerfile); the operator mounts the compile cache volume at it.
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_PATH = "/var/cache/loraplane"
# The worker image's user and group (docker/worker.Dockerfile): a claim's files are made
# group-writable for it (pod securityContext.fsGroup).
WORKER_GROUP = 10001
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The StatefulSet controller labels each pod `controller-revision-hash: <sts>-<hash>`, the
# hash up to 10 characters; a label value has at most 63, so the StatefulSet's (the pool's)
# name has at most 63 - 11.
MAX_POOL_NAME = 52
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")


@dataclass(frozen=True)
class CompileCache:
    """`spec.compileCache`: one PersistentVolumeClaim per replica for compiled kernels."""

    size: str
    storage_class: str | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> CompileCache | None:
        if spec is None:
            return None
        size = str(spec.get("size") or "")
        if not _QUANTITY.match(size):
            raise ValueError(
                f"spec.compileCache.size: {size!r} is not a storage quantity; write one such "
                "as 2Gi or 500Mi"
            )
        storage_class = spec.get("storageClassName")
        return cls(size=size, storage_class=str(storage_class) if storage_class else None)


@dataclass(frozen=True)
class PoolSpec:
    """The fields of a LoRAPool's spec the builders use, defaults as in the CRD."""

    model: str
    replicas: int = 1
    tp: int = 1
    dp: int = 1
    enable_dp_attention: bool = False
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 8
    max_lora_rank: int = 64
    stage_slots: int | None = None  # None: the worker's default
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    engine_args: Sequence[str] = ()
    volumes: Sequence[Mapping[str, Any]] = ()
    volume_mounts: Sequence[Mapping[str, Any]] = ()
    compile_cache: CompileCache | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("spec.model: must not be empty")
        for name, value in (("replicas", self.replicas), ("tp", self.tp), ("dp", self.dp)):
            if value < (0 if name == "replicas" else 1):
                raise ValueError(f"spec.{name}: {value} is out of range")
        if self.tp % self.dp != 0:
            raise ValueError(f"spec.tp: {self.tp} is not divisible by spec.dp={self.dp}")
        if self.dp > 1 and not self.enable_dp_attention:
            raise ValueError(
                f"spec.enableDPAttention: must be true when spec.dp={self.dp} > 1 (dp is "
                "DP-attention groups inside one worker; use spec.replicas for independent workers)"
            )
        if self.max_loras_per_batch < 1:
            raise ValueError(f"spec.maxLorasPerBatch: {self.max_loras_per_batch} must be >= 1")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"spec.maxLoadedLoras: {self.max_loaded_loras} must be >= "
                f"spec.maxLorasPerBatch={self.max_loras_per_batch}"
            )
        if self.stage_slots is not None:
            if self.stage_slots < 0:
                raise ValueError(f"spec.stageSlots: {self.stage_slots} must be >= 0")
            if any(
                a == "--stage-slots" or a.startswith("--stage-slots=") for a in self.engine_args
            ):
                raise ValueError(
                    "spec.stageSlots: --stage-slots is also in spec.engineArgs; set it in one place"
                )
        check_volumes(self.volumes, self.volume_mounts)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> PoolSpec:
        """Read a LoRAPool `spec` (camelCase, as the API returns it)."""
        return cls(
            model=str(spec.get("model") or ""),
            replicas=int(spec.get("replicas", 1)),
            tp=int(spec.get("tp", 1)),
            dp=int(spec.get("dp", 1)),
            enable_dp_attention=bool(spec.get("enableDPAttention", False)),
            max_loras_per_batch=int(spec.get("maxLorasPerBatch", 4)),
            max_loaded_loras=int(spec.get("maxLoadedLoras", 8)),
            max_lora_rank=int(spec.get("maxLoraRank", 64)),
            stage_slots=int(spec["stageSlots"]) if spec.get("stageSlots") is not None else None,
            image=spec.get("image"),
            image_pull_policy=spec.get("imagePullPolicy"),
            resources=dict(spec.get("resources") or {}),
            node_selector=dict(spec.get("nodeSelector") or {}),
            tolerations=list(spec.get("tolerations") or []),
            pod_labels=dict(spec.get("podLabels") or {}),
            pod_annotations=dict(spec.get("podAnnotations") or {}),
            engine_args=[str(a) for a in spec.get("engineArgs") or []],
            volumes=[dict(v) for v in spec.get("volumes") or []],
            volume_mounts=[dict(m) for m in spec.get("volumeMounts") or []],
            compile_cache=CompileCache.from_spec(spec.get("compileCache")),
        )


def check_volumes(
    volumes: Sequence[Mapping[str, Any]], mounts: Sequence[Mapping[str, Any]]
) -> None:
    """ValueError naming the field: what the CRD checks, checked again (the operator may
    run against an older CRD), and what it cannot check (a name given twice)."""
    names: set[str] = set()
    for i, volume in enumerate(volumes):
        name = volume.get("name")
        if not is_dns_label(name):
            raise ValueError(f"spec.volumes[{i}].name: {name!r} is not a DNS label (a-z, 0-9, -)")
        if name == COMPILE_CACHE_VOLUME:
            raise ValueError(
                f"spec.volumes[{i}].name: {name!r} is the operator's (see spec.compileCache); "
                "pick another"
            )
        if name in names:
            raise ValueError(f"spec.volumes[{i}].name: {name!r} is given twice")
        names.add(name)
    paths: set[str] = set()
    for i, mount in enumerate(mounts):
        name, path = mount.get("name"), mount.get("mountPath")
        if name not in names:
            raise ValueError(
                f"spec.volumeMounts[{i}].name: no volume named {name!r} in spec.volumes"
            )
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"spec.volumeMounts[{i}].mountPath: {path!r} is not an absolute path")
        if path.rstrip("/") == COMPILE_CACHE_PATH or path.startswith(COMPILE_CACHE_PATH + "/"):
            raise ValueError(
                f"spec.volumeMounts[{i}].mountPath: {path!r} is the compile cache's mount "
                f"({COMPILE_CACHE_PATH}, see spec.compileCache); mount elsewhere"
            )
        if path.rstrip("/") in paths:
            raise ValueError(f"spec.volumeMounts[{i}].mountPath: {path!r} is mounted twice")
        paths.add(path.rstrip("/"))


@dataclass(frozen=True)
class WorkerDefaults:
    """Operator-wide defaults for worker pods (chart values `worker.*`)."""

    image: str = "ghcr.io/loraplane/worker:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    service_account: str | None = None
    termination_grace_period_s: int = 30
    # the workers' admin token (the chart's Secret, passed to the operator as
    # LORAPLANE_WORKER_ADMIN_TOKEN); set: each pool gets a Secret with it, its workers require it
    admin_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Owner:
    """The object that owns the children (the LoRAPool)."""

    name: str
    namespace: str
    uid: str
    kind: str = "LoRAPool"
    api_version: str = f"{GROUP}/{VERSION}"


def owner_reference(owner: Owner) -> Manifest:
    return {
        "apiVersion": owner.api_version,
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(pool: str) -> dict[str, str]:
    """Labels that select a pool's worker pods (immutable once the StatefulSet exists)."""
    return {POOL_LABEL: pool, COMPONENT_LABEL: "worker"}


def common_labels(pool: str) -> dict[str, str]:
    return {
        **selector_labels(pool),
        "app.kubernetes.io/name": "loraplane-worker",
        "app.kubernetes.io/part-of": "loraplane",
        "app.kubernetes.io/managed-by": "loraplane-operator",
    }


def check_pool_name(name: str) -> None:
    """ValueError naming `metadata.name` unless every name derived from the pool's is legal
    (the CRD checks the same; the operator may run against an older CRD)."""
    if len(name) > MAX_POOL_NAME:
        raise ValueError(
            f"metadata.name: {name!r} has {len(name)} characters; a LoRAPool name has at most "
            f"{MAX_POOL_NAME} (its StatefulSet's pods carry the label "
            "controller-revision-hash=<name>-<10-character hash>, at most 63)"
        )
    if not _DNS_1035_LABEL.match(name):
        raise ValueError(
            f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits and "
            "'-', starting with a letter and ending with a letter or digit); its Service "
            f"{service_name(name)!r} needs one"
        )


def statefulset_name(pool: str) -> str:
    return pool


def service_name(pool: str) -> str:
    return f"{pool}-workers"


def pdb_name(pool: str) -> str:
    return pool


WORKER_TOKEN_ENV = "LORAPLANE_WORKER_ADMIN_TOKEN"


def worker_token_secret(pool: str) -> str:
    return f"{pool}-worker-token"


def worker_name(namespace: str, pod: str) -> str:
    """The control plane's worker name for a pod: global there, so other namespaces get
    a prefix; kept a DNS-1123 label (<= 63 chars, a short hash when shortened)."""
    name = pod if namespace == "default" else f"{namespace}-{pod}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(f"{namespace}/{pod}".encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-')}-{digest}"


def worker_command(spec: PoolSpec) -> list[str]:
    """The worker container's command: the same `loraplane worker serve` the tests run."""
    command = [
        "loraplane",
        "worker",
        "serve",
        "--model",
        spec.model,
        "--tp",
        str(spec.tp),
        "--dp",
        str(spec.dp),
        "--host",
        "$(POD_IP)",
        "--port",
        str(WORKER_PORT),
        "--max-loras-per-batch",
        str(spec.max_loras_per_batch),
        "--max-loaded-loras",
        str(spec.max_loaded_loras),
        "--max-lora-rank",
        str(spec.max_lora_rank),
    ]
    if spec.enable_dp_attention:
        command.append("--dp-attention")
    if spec.stage_slots is not None:  # unset adds nothing: existing pods keep their template
        command += ["--stage-slots", str(spec.stage_slots)]
    return [*command, *spec.engine_args]


def _resources(spec: PoolSpec) -> Manifest:
    requests = dict(spec.resources.get("requests") or {})
    limits = dict(spec.resources.get("limits") or {})
    # Extended resources must have request == limit; GPUs per replica = tp, always.
    requests[GPU_RESOURCE] = spec.tp
    limits[GPU_RESOURCE] = spec.tp
    return {"requests": requests, "limits": limits}


def build_pod_template(pool: str, spec: PoolSpec, defaults: WorkerDefaults) -> Manifest:
    labels = {**defaults.pod_labels, **spec.pod_labels, **common_labels(pool)}
    container: Manifest = {
        "name": "worker",
        "image": spec.image or defaults.image,
        "imagePullPolicy": spec.image_pull_policy or defaults.image_pull_policy,
        "command": worker_command(spec),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "LORAPLANE_POOL", "value": pool},
            *(
                [
                    {
                        "name": WORKER_TOKEN_ENV,
                        "valueFrom": {
                            "secretKeyRef": {"name": worker_token_secret(pool), "key": "token"}
                        },
                    }
                ]
                if defaults.admin_token
                else []
            ),
        ],
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": [
            *(dict(m) for m in spec.volume_mounts),
            {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_PATH},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 120,
        },
    }
    volumes = [dict(v) for v in spec.volumes]
    if spec.compile_cache is None:  # else the StatefulSet's claim template names it
        volumes.append({"name": COMPILE_CACHE_VOLUME, "emptyDir": {}})
    pod_spec: Manifest = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": defaults.termination_grace_period_s,
        "automountServiceAccountToken": False,
    }
    if spec.compile_cache is not None:
        # A new claim's root is the provisioner's (often root, 0755): the image's group
        # gets it, so the worker can write its kernels there.
        pod_spec["securityContext"] = {
            "fsGroup": WORKER_GROUP,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
    if defaults.service_account:
        pod_spec["serviceAccountName"] = defaults.service_account
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    metadata: Manifest = {"labels": labels}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    return {"metadata": metadata, "spec": pod_spec}


def build_statefulset(owner: Owner, spec: PoolSpec, defaults: WorkerDefaults) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": statefulset_name(owner.name),
            "namespace": owner.namespace,
            "labels": common_labels(owner.name),
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "replicas": spec.replicas,
            "serviceName": service_name(owner.name),
            # Workers are independent: start and stop them all at once.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner.name)},
            "template": build_pod_template(owner.name, spec, defaults),
            **_claim_templates(owner.name, spec.compile_cache),
        },
    }


def _claim_templates(pool: str, cache: CompileCache | None) -> Manifest:
    """The StatefulSet fields of a compile cache claim per replica (none without one).
    Claims go with the pool and stay when it scales down (the replica that comes back
    finds its kernels)."""
    if cache is None:
        return {}
    claim: Manifest = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class is not None:
        claim["storageClassName"] = cache.storage_class
    return {
        "volumeClaimTemplates": [
            {
                "metadata": {"name": COMPILE_CACHE_VOLUME, "labels": common_labels(pool)},
                "spec": claim,
            }
        ],
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
    }


def build_headless_service(owner: Owner) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(owner.name),
            "namespace": owner.namespace,
            "labels": common_labels(owner.name),
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http"}],
        },
    }


def build_pdb(owner: Owner) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": pdb_name(owner.name),
            "namespace": owner.namespace,
            "labels": common_labels(owner.name),
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            # Drain one worker at a time; its adapters stay routable on the others.
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
        },
    }


def build_worker_token_secret(owner: Owner, token: str) -> Manifest:
    """The pool's copy of the workers' admin token (a pod reads Secrets of its own namespace)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": worker_token_secret(owner.name),
            "namespace": owner.namespace,
            "labels": common_labels(owner.name),
            "ownerReferences": [owner_reference(owner)],
        },
        "type": "Opaque",
        "stringData": {"token": token},
    }


def build_pool_children(owner: Owner, spec: PoolSpec, defaults: WorkerDefaults) -> list[Manifest]:
    """Everything a LoRAPool owns, in the order to apply them."""
    token = [build_worker_token_secret(owner, defaults.admin_token)] if defaults.admin_token else []
    return [
        *token,
        build_headless_service(owner),
        build_statefulset(owner, spec, defaults),
        build_pdb(owner),
    ]


def build_controlplane_pool(spec: PoolSpec) -> Manifest:
    """The body of `PUT /v1/pools/{namespace}/{name}`."""
    return {
        "model": spec.model,
        "tp": spec.tp,
        "dp": spec.dp,
        "max_loras_per_batch": spec.max_loras_per_batch,
        "max_loaded_loras": spec.max_loaded_loras,
        "max_lora_rank": spec.max_lora_rank,
    }


def build_worker_registration(
    namespace: str, pool: str, pod_name: str, pod_ip: str, dp: int
) -> Manifest:
    """The body of `POST /v1/workers` for one ready pod."""
    return {
        "name": worker_name(namespace, pod_name),
        "namespace": namespace,
        "pool": pool,
        "endpoint": f"http://{pod_ip}:{WORKER_PORT}",
        "dp_size": dp,
    }


def placement_of(spec: Mapping[str, Any]) -> str | dict[str, int]:
    """A LoRAAdapter's placement in the control plane's shape: "all" or {"count": N}."""
    placement = spec.get("placement") or {}
    if placement.get("mode", "all") == "count":
        return {"count": int(placement["count"])}
    return "all"


# The keys of a `spec.source.credentialsSecretRef` Secret each URI scheme uses, and the
# control plane's `source.credentials` key each becomes (docs/operator.md). file:// and
# pvc:// sources take no credentials.
SECRET_KEYS: dict[str, dict[str, str]] = {
    "s3": {
        "AWS_ACCESS_KEY_ID": "aws_access_key_id",
        "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
        "AWS_SESSION_TOKEN": "aws_session_token",
    },
    "http": {"TOKEN": "token"},
    "https": {"TOKEN": "token"},
    "hf": {"TOKEN": "token"},
}
# Keys without which a Secret is of no use for the scheme.
REQUIRED_SECRET_KEYS: dict[str, tuple[str, ...]] = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "http": ("TOKEN",),
    "https": ("TOKEN",),
    "hf": ("TOKEN",),
}


def uri_scheme(uri: str) -> str:
    return uri.partition("://")[0].lower() if "://" in uri else ""


def credentials_secret_name(spec: Mapping[str, Any]) -> str | None:
    """`spec.source.credentialsSecretRef.name`, or None when the source has no Secret."""
    ref = (spec.get("source") or {}).get("credentialsSecretRef") or {}
    name = ref.get("name")
    return str(name) if name else None


def secret_keys_wanted(uri: str) -> str:
    """The Secret keys a source at `uri` uses, for messages."""
    scheme = uri_scheme(uri)
    required = REQUIRED_SECRET_KEYS.get(scheme, ())
    optional = [k for k in SECRET_KEYS.get(scheme, {}) if k not in required]
    text = " and ".join(required) or "none"
    return text + (f" ({', '.join(optional)} optional)" if optional else "")


def check_credentials_supported(uri: str) -> None:
    """ValueError naming the field when the scheme of `uri` takes no credentials."""
    scheme = uri_scheme(uri)
    if scheme not in SECRET_KEYS:
        raise ValueError(
            f"spec.source.credentialsSecretRef: {scheme or 'this'}:// sources take no "
            "credentials (only s3://, http(s):// and hf:// do); remove it"
        )


def source_credentials(uri: str, secret_data: Mapping[str, str]) -> dict[str, str]:
    """The control plane's `source.credentials` for a source at `uri`, from a Secret's
    decoded data: only the keys the scheme uses, empty values ignored; `{}` when a required
    key is missing. ValueError when the scheme takes no credentials (file://, pvc://)."""
    check_credentials_supported(uri)
    scheme = uri_scheme(uri)
    present = {key: value for key, value in secret_data.items() if value}
    if not all(key in present for key in REQUIRED_SECRET_KEYS[scheme]):
        return {}
    return {api_key: present[key] for key, api_key in SECRET_KEYS[scheme].items() if key in present}


def build_adapter_registration(
    namespace: str,
    name: str,
    spec: Mapping[str, Any],
    credentials: Mapping[str, str] | None = None,
) -> Manifest:
    """The body of `POST /v1/adapters` for a LoRAAdapter; `credentials` (from its
    `credentialsSecretRef` Secret, `source_credentials`) go into `source.credentials`."""
    source = spec.get("source") or {}
    body_source: Manifest = {"uri": source.get("uri")}
    if source.get("sha256"):
        body_source["sha256"] = source["sha256"]
    if credentials:
        body_source["credentials"] = dict(credentials)
    return {
        "namespace": namespace,
        "name": name,
        "pool": spec.get("pool"),
        "source": body_source,
        "pinned": bool(spec.get("pinned", False)),
        "placement": placement_of(spec),
        "priority": int(spec.get("priority", 0)),
        "load": True,
        "load_policy": str(spec.get("loadPolicy", "OnDemand")),
    }
