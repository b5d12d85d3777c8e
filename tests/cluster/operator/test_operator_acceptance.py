"""Issue 7's acceptance on a real local cluster: `helm install` the chart, apply a LoRAPool
and LoRAAdapters, and watch the operator, the control plane and real worker processes
(local-run pods at loopback pod IPs) converge.

Runs in file order against one installation (module-scoped `stack`). Before asking for the
session cluster it checks, at run time, that what the stack needs exists, and skips naming
what is missing.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from clusterkit import (
    LORAPLANE,
    Cluster,
    make_adapters,
    make_model,
    missing_prerequisites,
    pod_ready,
    wait_for,
)

from loraplane.devcluster.processes import free_port

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "loraplane"
RELEASE = "lp"
TOKEN = "lp_test_" + uuid.uuid4().hex


def _multirank_worker_problem(model: Path) -> str | None:
    """Start a tp=2 dp=2 worker for a few seconds: None if it starts serving, else why not."""
    port = free_port()
    process = subprocess.Popen(
        [LORAPLANE, "worker", "serve", "--model", str(model), "--tp", "2", "--dp", "2", "--dp-attention",
         "--device", "cpu", "--lora-backend", "torch", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                err = (process.stderr.read() if process.stderr else "").strip()
                return f"`loraplane worker serve --tp 2 --dp 2` exits {process.returncode}: {err[-300:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return "`loraplane worker serve --tp 2 --dp 2` did not become healthy within 120 s"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)


@dataclass
class Stack:
    cluster: Cluster
    release_ns: str
    ns: str
    work: Path
    model: Path
    other_model: Path
    adapters: dict[str, Path]
    operator_sa: str

    def controlplane_url(self) -> str:
        pods = self.cluster.get(
            "pods", "-n", self.release_ns, "-l", "app.kubernetes.io/component=controlplane"
        )["items"]
        ready = [p for p in pods if pod_ready(p)]
        assert ready, "no ready control plane pod"
        return f"http://{ready[0]['status']['podIP']}:8080"

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(
            method,
            self.controlplane_url() + path,
            # The router resolves adapter names in one namespace: the test's.
            headers={"Authorization": f"Bearer {TOKEN}", "X-Loraplane-Namespace": self.ns},
            timeout=120,
            **kwargs,
        )

    def adapter(self, name: str) -> dict[str, Any]:
        return self.cluster.get("loraadapter", name, "-n", self.ns)  # type: ignore[no-any-return]

    def pool(self, name: str) -> dict[str, Any]:
        return self.cluster.get("lorapool", name, "-n", self.ns)  # type: ignore[no-any-return]


def _fixtures(work: Path) -> tuple[Path, Path, dict[str, Path]]:
    model = make_model(work / "models" / "base", hidden=64)
    other = make_model(work / "models" / "other", hidden=32)
    names = ("sql", "tone", "summary", "spare", "extra")
    return model, other, make_adapters(model, work / "adapters", names)


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    missing = missing_prerequisites()
    if missing:
        pytest.skip("the operator's acceptance needs: " + "; ".join(missing))
    work = tmp_path_factory.mktemp("operator")
    model, other, adapters = _fixtures(work)
    problem = _multirank_worker_problem(model)
    if problem:
        pytest.skip(f"the pool runs tp=2 dp=2 workers, but {problem}")
    cluster: Cluster = request.getfixturevalue("local_cluster")
    release_ns, ns = f"lp-{uuid.uuid4().hex[:6]}", f"t-{uuid.uuid4().hex[:6]}"
    for name in (release_ns, ns):
        cluster.kubectl("create", "namespace", name)
    install = cluster.run(
        "helm", "install", RELEASE, str(CHART), "-n", release_ns, "--wait=false",
        "--set", "localRun=true",
        "--set", f"auth.adminToken={TOKEN}",
        "--set", f"controlplane.database.url=sqlite:///{work}/registry.db",
        "--set", f"controlplane.sources.allowedRoots={{{work}}}",
        "--set", f"controlplane.sources.cacheDir={work}/cache",
        "--set", "controlplane.reconcileInterval=1",
        "--set", "operator.resyncInterval=2",
        "--set", "operator.maxAttempts=3",
        "--set", "operator.backoff=1",
        "--set", "operator.peering.name=" + release_ns,
    )  # fmt: skip
    assert "NOTES" in install.stdout or install.returncode == 0
    for component in ("controlplane", "operator"):
        wait_for(
            lambda c=component: [
                p for p in cluster.get("pods", "-n", release_ns, "-l", f"app.kubernetes.io/component={c}")["items"]
                if pod_ready(p)
            ],
            what=f"the {component} pod to be Ready",
            timeout_s=180,
        )  # fmt: skip
    yield Stack(
        cluster, release_ns, ns, work, model, other, adapters, f"{RELEASE}-loraplane-operator"
    )
    cluster.kubectl(
        "delete", "loraadapters", "--all", "-n", ns, "--wait=true", "--timeout=120s", check=False
    )
    cluster.run("helm", "uninstall", RELEASE, "-n", release_ns, "--wait", check=False)
    for name in (ns, release_ns):
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _pool_manifest(stack: Stack, name: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "LoRAPool",
        "metadata": {"name": name, "namespace": stack.ns},
        "spec": {
            "model": str(stack.model),
            "replicas": replicas,
            "tp": 2,
            "dp": 2,
            "enableDPAttention": True,
            "maxLorasPerBatch": 3,
            "maxLoadedLoras": 6,
            "maxLoraRank": 16,
            "engineArgs": [
                "--device", "cpu", "--lora-backend", "torch", "--enable-fault-injection",
                "--allowed-lora-root", str(stack.work),
            ],
            **spec,
        },
    }  # fmt: skip


def _adapter_manifest(
    stack: Stack, name: str, source: Path | str, pool: str = "pool", **spec: Any
) -> dict[str, Any]:
    uri = source if isinstance(source, str) else f"file://{source}"
    return {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": stack.ns},
        "spec": {"pool": pool, "source": {"uri": uri}, **spec},
    }


def _phase(stack: Stack, name: str) -> str | None:
    return (stack.adapter(name).get("status") or {}).get("phase")


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(
        (c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {}
    )


def _wait_ready(stack: Stack, names: list[str], replicas: int, timeout_s: float = 240) -> None:
    def done() -> bool:
        for name in names:
            st = stack.adapter(name).get("status") or {}
            if st.get("phase") != "Ready" or st.get("loadedReplicas") != replicas:
                return False
        return True

    wait_for(
        done,
        what=f"adapters {names} Ready on {replicas} replicas",
        timeout_s=timeout_s,
        interval_s=1,
    )


def test_pool_pods_run_on_gpu_nodes_and_register(stack: Stack) -> None:
    stack.cluster.apply(_pool_manifest(stack, "pool", 2))
    wait_for(
        lambda: (stack.pool("pool").get("status") or {}).get("registeredWorkers") == 2,
        what="2 workers registered", timeout_s=300, interval_s=1,
    )  # fmt: skip
    pods = stack.cluster.get("pods", "-n", stack.ns, "-l", "loraplane.io/pool=pool")["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"].startswith("gpu-node-")
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
    sts = stack.cluster.get("statefulset", "pool", "-n", stack.ns)
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "LoRAPool"
    assert stack.cluster.get("pdb", "pool", "-n", stack.ns)["spec"]["maxUnavailable"] == 1
    status = stack.pool("pool")["status"]
    assert status["readyReplicas"] == 2
    assert all(len(w["dpGroups"]) == 2 for w in status["workers"])
    assert _condition(stack.pool("pool"), "Ready")["status"] == "True"
    # the workers' token: the pool's own Secret, read by its pods (workers registered and
    # probed with it above), and the chart's NetworkPolicy accepted by the API server
    secret = stack.cluster.get("secret", "pool-worker-token", "-n", stack.ns)
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "LoRAPool"
    for pod in pods:
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        ref = env["LORAPLANE_WORKER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pool-worker-token", "key": "token"}
    policy = stack.cluster.get(
        "networkpolicy", f"{RELEASE}-loraplane-workers", "-n", stack.release_ns
    )
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"


def test_three_adapters_become_ready_on_both_replicas(stack: Stack) -> None:
    stack.cluster.apply(
        [
            _adapter_manifest(stack, "sql", stack.adapters["sql"], pinned=True),
            _adapter_manifest(stack, "tone", stack.adapters["tone"]),
            _adapter_manifest(stack, "summary", stack.adapters["summary"]),
        ]
    )
    _wait_ready(stack, ["sql", "tone", "summary"], 2)
    sql = stack.adapter("sql")
    assert sql["metadata"]["finalizers"] == ["loraplane.io/unload"]
    assert sql["status"]["observedGeneration"] == sql["metadata"]["generation"]
    assert sql["status"]["rank"] == 8
    assert {c["type"]: c["status"] for c in sql["status"]["conditions"]} == {
        "Validated": "True", "Loaded": "True", "Ready": "True", "Degraded": "False",
    }  # fmt: skip
    assert all(
        len(r["dpGroups"]) == 2 and r["state"] == "loaded" for r in sql["status"]["replicaStates"]
    )
    table = stack.cluster.kubectl("get", "loraadapters", "-n", stack.ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "POOL", "PHASE", "READY", "PINNED", "RANK", "AGE"]
    assert any(row.split()[:6] == ["sql", "pool", "Ready", "2/2", "true", "8"] for row in table[1:])
    events = stack.cluster.get(
        "events", "-n", stack.ns, "--field-selector", "involvedObject.name=sql"
    )["items"]
    assert any(e["reason"] == "Ready" for e in events)


def test_router_serves_the_named_adapter(stack: Stack) -> None:
    def complete(model: str) -> str:
        response = stack.api(
            "POST", "/v1/completions",
            json={"model": model, "prompt": "hello world", "max_tokens": 6, "temperature": 0},
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        return str(response.json()["choices"][0]["text"])

    # Each adapter's answer equals the one a worker gives for that adapter directly.
    worker = stack.pool("pool")["status"]["workers"][0]["podIP"]
    for name in ("sql", "tone"):
        lora_name = stack.adapter(name)["status"]["loraName"]
        direct = httpx.post(
            f"http://{worker}:8000/v1/completions",
            json={"model": lora_name, "prompt": "hello world", "max_tokens": 6, "temperature": 0},
            timeout=120,
        )  # fmt: skip
        assert direct.status_code == 200, direct.text
        assert complete(f"pool:{name}") == direct.json()["choices"][0]["text"]
    assert complete("pool:sql") != complete("pool:tone") or complete("pool:sql") != complete("pool")


def test_scale_up_adapters_follow_onto_the_new_replica(stack: Stack) -> None:
    stack.cluster.kubectl("scale", "lorapool", "pool", "-n", stack.ns, "--replicas=3")
    wait_for(
        lambda: (stack.pool("pool").get("status") or {}).get("registeredWorkers") == 3,
        what="3 workers registered", timeout_s=300, interval_s=1,
    )  # fmt: skip
    _wait_ready(stack, ["sql", "tone", "summary"], 3)


def test_deleted_pod_comes_back_and_gets_its_adapters(stack: Stack) -> None:
    old_uid = stack.cluster.get("pod", "pool-1", "-n", stack.ns)["metadata"]["uid"]
    stack.cluster.kubectl("delete", "pod", "pool-1", "-n", stack.ns, "--wait=true", "--timeout=90s")
    names = {stack.adapter(n)["status"]["loraName"] for n in ("sql", "tone", "summary")}
    seen: set[tuple[str, str]] = set()

    def new_pod_serves_its_adapters() -> bool:
        status = stack.adapter("tone").get("status") or {}
        seen.add((str(status.get("phase")), str(status.get("ready"))))
        # The pool's status may still describe the old pod for a moment: ask the new one.
        try:
            pod = stack.cluster.get("pod", "pool-1", "-n", stack.ns)
        except Exception:  # not recreated yet
            return False
        ip = pod.get("status", {}).get("podIP")
        if pod["metadata"]["uid"] == old_uid or not ip:
            return False
        try:
            models = httpx.get(f"http://{ip}:8000/v1/models", timeout=10).json()
        except httpx.HTTPError:
            return False  # the new worker is still starting
        return names <= {m["id"] for m in models["data"]}

    wait_for(
        new_pod_serves_its_adapters,
        what="the recreated pool-1 serving its adapters",
        timeout_s=300,
        interval_s=1,
    )
    _wait_ready(stack, ["sql", "tone", "summary"], 3)
    # While the pod was away the adapter said so: loaded on 2 of the 3 replicas the pool wants.
    assert ("Degraded", "2/3") in seen, seen
    events = stack.cluster.get(
        "events", "-n", stack.ns, "--field-selector", "involvedObject.name=tone"
    )["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "ReplicaLost" for e in events)
    assert any(e["type"] == "Normal" and e["reason"] == "ReplicaLoaded" for e in events)


def test_a_pool_change_its_adapters_contradict_is_refused_and_not_rolled_out(
    stack: Stack,
) -> None:
    """maxLoraRank below a registered adapter's rank: the control plane refuses the pool, the
    pool says why, and its pods keep the limit they have; the change undone, it is Ready."""

    def patch_rank(rank: int) -> None:
        body = json.dumps({"spec": {"maxLoraRank": rank}})
        stack.cluster.kubectl(
            "patch", "lorapool", "pool", "-n", stack.ns, "--type=merge", "-p", body
        )

    def rank_arg() -> str:
        sts = stack.cluster.get("statefulset", "pool", "-n", stack.ns)
        command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
        return str(command[command.index("--max-lora-rank") + 1])

    patch_rank(4)
    wait_for(
        lambda: _condition(stack.pool("pool"), "Ready").get("reason") == "ControlPlaneRejected",
        what="pool reported ControlPlaneRejected", timeout_s=60,
    )  # fmt: skip
    message = _condition(stack.pool("pool"), "Ready")["message"]
    assert "max_lora_rank=4" in message and "sql (r=8)" in message, message
    assert rank_arg() == "16"
    patch_rank(16)
    wait_for(
        lambda: _condition(stack.pool("pool"), "Ready").get("status") == "True",
        what="pool Ready again", timeout_s=60,
    )  # fmt: skip
    _wait_ready(stack, ["sql", "tone", "summary"], 3)


def test_control_plane_outage_shows_unknown_not_a_failure(stack: Stack) -> None:
    deployment = f"deployment/{RELEASE}-loraplane-controlplane"
    stack.cluster.kubectl("scale", deployment, "-n", stack.release_ns, "--replicas=0")
    try:
        wait_for(
            lambda: _phase(stack, "tone") == "Unknown" and stack.pool("pool")["status"].get("phase") == "Unknown",
            what="adapter tone and pool pool Unknown while the control plane is down",
            timeout_s=120, interval_s=1,
        )  # fmt: skip
        tone = stack.adapter("tone")
        assert tone["status"]["ready"] == "3/3" and tone["status"]["attempts"] == 0
        assert _condition(tone, "Ready")["reason"] == "ControlPlaneUnavailable"
        events = stack.cluster.get(
            "events", "-n", stack.ns, "--field-selector", "involvedObject.name=tone"
        )["items"]
        assert any(e["type"] == "Warning" and e["reason"] == "Unknown" for e in events)
    finally:
        stack.cluster.kubectl("scale", deployment, "-n", stack.release_ns, "--replicas=1")
    # The registry is in a file that outlives the pod: everything comes back as it was.
    _wait_ready(stack, ["sql", "tone", "summary"], 3)
    wait_for(
        lambda: stack.pool("pool")["status"].get("phase") == "Ready",
        what="pool Ready again", timeout_s=120,
    )  # fmt: skip


def test_pool_deleted_during_an_outage_does_not_leave_its_adapter_stuck(stack: Stack) -> None:
    small = {"tp": 1, "dp": 1, "enableDPAttention": False}
    stack.cluster.apply(_pool_manifest(stack, "doomed", 1, **small))
    stack.cluster.apply(
        _adapter_manifest(stack, "orphaned", stack.adapters["spare"], pool="doomed")
    )
    _wait_ready(stack, ["orphaned"], 1)
    deployment = f"deployment/{RELEASE}-loraplane-controlplane"
    stack.cluster.kubectl("scale", deployment, "-n", stack.release_ns, "--replicas=0")
    try:
        wait_for(
            lambda: _phase(stack, "orphaned") == "Unknown",
            what="orphaned Unknown while the control plane is down", timeout_s=120,
        )  # fmt: skip
        stack.cluster.kubectl("delete", "lorapool", "doomed", "-n", stack.ns, "--timeout=120s")
        wait_for(
            lambda: not stack.cluster.get("pods", "-n", stack.ns, "-l", "loraplane.io/pool=doomed")["items"],
            what="the pool's pod gone", timeout_s=120,
        )  # fmt: skip
    finally:
        stack.cluster.kubectl("scale", deployment, "-n", stack.release_ns, "--replicas=1")
    wait_for(lambda: _cp_ready(stack), what="the control plane back", timeout_s=120)
    # The finalizer ends: the adapter is unloaded (its pool's unreachable workers released).
    stack.cluster.kubectl("delete", "loraadapter", "orphaned", "-n", stack.ns, "--timeout=120s")
    assert stack.api("GET", f"/v1/adapters/{stack.ns}/orphaned").status_code == 404
    # And the registry forgets the pool (the operator's sweep).
    wait_for(
        lambda: stack.api("GET", f"/v1/pools/{stack.ns}/doomed").status_code == 404,
        what="registry pool doomed deleted", timeout_s=120,
    )  # fmt: skip


def _cp_ready(stack: Stack) -> bool:
    pods = stack.cluster.get(
        "pods", "-n", stack.release_ns, "-l", "app.kubernetes.io/component=controlplane"
    )["items"]
    return any(pod_ready(p) for p in pods)


def test_invalid_resources_are_rejected_or_reported(stack: Stack) -> None:
    bad_enum = _adapter_manifest(
        stack, "bad-enum", stack.adapters["spare"], placement={"mode": "some"}
    )
    rejected = stack.cluster.apply(bad_enum, check=False)
    assert rejected.returncode != 0 and "spec.placement.mode" in rejected.stderr
    # 55 characters: its pods' controller-revision-hash label would pass 63.
    too_long = _pool_manifest(stack, "p" * 55, 1)
    rejected = stack.cluster.apply(too_long, check=False)
    assert rejected.returncode != 0 and "metadata.name" in rejected.stderr
    assert "52" in rejected.stderr
    negative = _pool_manifest(stack, "negative", 1, maxLoraRank=-8)
    rejected = stack.cluster.apply(negative, check=False)
    assert rejected.returncode != 0 and "spec.maxLoraRank" in rejected.stderr
    indivisible = _pool_manifest(stack, "indivisible", 1, tp=3, dp=2)  # enableDPAttention is set
    rejected = stack.cluster.apply(indivisible, check=False)
    assert rejected.returncode != 0 and "divisible" in rejected.stderr
    negative_stage = _pool_manifest(stack, "negative-stage", 1, stageSlots=-1)
    rejected = stack.cluster.apply(negative_stage, check=False)
    assert rejected.returncode != 0 and "spec.stageSlots" in rejected.stderr

    # spec.stageSlots reaches the workers' command; given twice, the pool reports which field.
    # (No replicas: only what the operator renders is checked.)
    args = _pool_manifest(stack, "-", 0)["spec"]["engineArgs"]
    stack.cluster.apply(
        [
            _pool_manifest(stack, "staged", 0, stageSlots=2),
            _pool_manifest(
                stack, "twice", 0, stageSlots=2, engineArgs=[*args, "--stage-slots", "4"]
            ),
        ]
    )

    def staged_command() -> list[str] | None:
        found = stack.cluster.kubectl(
            "get", "statefulset", "staged", "-n", stack.ns, "-o", "json", check=False
        )
        if found.returncode != 0:
            return None
        return json.loads(found.stdout)["spec"]["template"]["spec"]["containers"][0]["command"]

    command = wait_for(staged_command, what="pool staged's StatefulSet")
    assert command[command.index("--stage-slots") + 1] == "2"
    wait_for(
        lambda: _condition(stack.pool("twice"), "Validated").get("reason") == "InvalidSpec",
        what="pool twice reported InvalidSpec",
    )
    assert "spec.stageSlots" in _condition(stack.pool("twice"), "Validated")["message"]
    for name in ("staged", "twice"):
        stack.cluster.kubectl("delete", "lorapool", name, "-n", stack.ns, "--timeout=120s")

    stack.cluster.apply(
        _adapter_manifest(stack, "orphan", stack.adapters["spare"], pool="no-such-pool")
    )
    wait_for(
        lambda: _condition(stack.adapter("orphan"), "Validated").get("reason") == "PoolNotFound",
        what="orphan reported PoolNotFound",
    )
    assert _phase(stack, "orphan") == "Pending"
    assert "no-such-pool" in _condition(stack.adapter("orphan"), "Validated")["message"]

    # K = 3: two pinned adapters are allowed (sql is one), a third is not.
    stack.cluster.apply(_adapter_manifest(stack, "spare", stack.adapters["spare"], pinned=True))
    _wait_ready(stack, ["spare"], 3)
    time.sleep(1)  # distinct creationTimestamps
    stack.cluster.apply(_adapter_manifest(stack, "extra", stack.adapters["extra"], pinned=True))
    wait_for(
        lambda: _condition(stack.adapter("extra"), "Validated").get("reason") == "TooManyPinned",
        what="extra reported TooManyPinned", timeout_s=60,
    )  # fmt: skip
    assert "maxLorasPerBatch-1 = 2" in _condition(stack.adapter("extra"), "Validated")["message"]
    assert _phase(stack, "extra") != "Ready"
    for name in ("orphan", "extra", "spare"):
        stack.cluster.kubectl("delete", "loraadapter", name, "-n", stack.ns, "--timeout=120s")


def test_pool_volumes_and_a_compile_cache_claim_per_replica(stack: Stack) -> None:
    # No storage provisioner runs here: the claim stays Pending, and so does the pod; what is
    # checked is what the API, the StatefulSet controller and the garbage collector do.
    cache = {"size": "1Gi", "storageClassName": "loraplane-test-unprovisioned"}
    models = {"name": "models", "hostPath": {"path": str(stack.work)}}
    mount = {"name": "models", "mountPath": "/models", "readOnly": True}
    pool = _pool_manifest(
        stack, "cached", 1, compileCache=cache, volumes=[models], volumeMounts=[mount]
    )
    stack.cluster.apply(pool)

    def claim() -> dict[str, Any] | None:
        found = stack.cluster.kubectl(
            "get", "pvc", "compile-cache-cached-0", "-n", stack.ns, "-o", "json", check=False
        )
        return json.loads(found.stdout) if found.returncode == 0 else None

    made = wait_for(claim, what="the StatefulSet controller's claim compile-cache-cached-0")
    assert made["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert made["spec"]["storageClassName"] == "loraplane-test-unprovisioned"
    assert made["metadata"]["labels"]["loraplane.io/pool"] == "cached"
    sts = stack.cluster.get("statefulset", "cached", "-n", stack.ns)
    template = sts["spec"]["template"]["spec"]
    assert [v["name"] for v in template["volumes"]] == ["models"]
    assert template["containers"][0]["volumeMounts"] == [
        mount,
        {"name": "compile-cache", "mountPath": "/var/cache/loraplane"},
    ]

    # The API server's own rules: the claims cannot change, mounts must name volumes.
    for changed in ({**cache, "size": "2Gi"}, None):
        spec = {k: v for k, v in pool["spec"].items() if k != "compileCache"}
        if changed is not None:
            spec["compileCache"] = changed
        rejected = stack.cluster.apply({**pool, "spec": spec}, check=False)
        assert rejected.returncode != 0 and "spec.compileCache is immutable" in rejected.stderr
    dangling = _pool_manifest(stack, "dangling", 0, volumeMounts=[mount])
    rejected = stack.cluster.apply(dangling, check=False)
    assert rejected.returncode != 0 and "must name a volume in spec.volumes" in rejected.stderr

    # A volume the schema lets through but the API refuses in a StatefulSet: the pool says
    # so, naming the field, and the StatefulSet keeps its template.
    broken = {"name": "broken", "persistentVolumeClaim": {}}
    stack.cluster.apply(
        _pool_manifest(
            stack, "cached", 1, compileCache=cache, volumes=[models, broken], volumeMounts=[mount]
        )
    )
    wait_for(
        lambda: _condition(stack.pool("cached"), "Validated").get("reason") == "InvalidSpec",
        what="pool cached reported InvalidSpec",
    )
    assert "claimName" in _condition(stack.pool("cached"), "Validated")["message"]
    after = stack.cluster.get("statefulset", "cached", "-n", stack.ns)
    assert after["spec"]["template"] == sts["spec"]["template"]
    stack.cluster.apply(pool)
    wait_for(
        lambda: _condition(stack.pool("cached"), "Validated").get("status") == "True",
        what="pool cached valid again",
    )

    stack.cluster.kubectl("delete", "lorapool", "cached", "-n", stack.ns, "--timeout=120s")
    wait_for(lambda: claim() is None, what="compile-cache-cached-0 deleted with its pool",
             timeout_s=120)  # fmt: skip


def test_deleted_adapter_is_unloaded_everywhere_and_its_finalizer_removed(stack: Stack) -> None:
    lora_name = stack.adapter("summary")["status"]["loraName"]
    stack.cluster.kubectl(
        "delete", "loraadapter", "summary", "-n", stack.ns, "--wait=true", "--timeout=120s"
    )
    assert (
        stack.cluster.kubectl(
            "get", "loraadapter", "summary", "-n", stack.ns, check=False
        ).returncode
        != 0
    )
    assert stack.api("GET", f"/v1/adapters/{stack.ns}/summary").status_code == 404
    for worker in stack.pool("pool")["status"]["workers"]:
        ids = {
            m["id"]
            for m in httpx.get(f"http://{worker['podIP']}:8000/v1/models", timeout=30).json()[
                "data"
            ]
        }
        assert lora_name not in ids, worker["name"]


def test_operator_rbac_allows_what_it_needs_and_no_more(stack: Stack) -> None:
    who = f"system:serviceaccount:{stack.release_ns}:{stack.operator_sa}"

    def can(*args: str) -> bool:
        result = stack.cluster.kubectl(
            "auth", "can-i", *args, "--as", who, "-n", stack.ns, check=False
        )
        return result.stdout.strip() == "yes"

    assert can("patch", "loraadapters.loraplane.io", "--subresource=status")
    assert can("watch", "pods")
    assert can("patch", "statefulsets.apps")
    assert not can("delete", "statefulsets.apps")
    # Secrets: one by name (spec.source.credentialsSecretRef; the pools' token Secrets are
    # applied), never listed or watched.
    assert can("get", "secrets") and can("patch", "secrets")
    assert not can("list", "secrets") and not can("watch", "secrets")
    assert not can("delete", "pods")
    assert not can("update", "loraadapters.loraplane.io")
    # And the real thing: a request under the operator's identity is refused.
    forbidden = stack.cluster.kubectl("get", "secrets", "-n", stack.ns, "--as", who, check=False)
    assert forbidden.returncode != 0 and "forbidden" in forbidden.stderr.lower()


def test_source_secret_missing_is_pending_until_it_has_the_keys(stack: Stack) -> None:
    # Nothing listens on port 9: once the Secret is usable the control plane's fetch fails,
    # which shows the operator got past the Secret (read under its real RBAC) and sent it.
    manifest = {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "private", "namespace": stack.ns},
        "spec": {
            "pool": "pool",
            "source": {
                "uri": "http://127.0.0.1:9/private",
                "credentialsSecretRef": {"name": "private-source"},
            },
        },
    }
    stack.cluster.apply(manifest)

    def validated() -> dict[str, Any]:
        return _condition(stack.adapter("private"), "Validated")

    wait_for(
        lambda: validated().get("reason") == "CredentialsNotFound",
        what="private reported CredentialsNotFound", timeout_s=60,
    )  # fmt: skip
    assert _phase(stack, "private") == "Pending"
    message = validated()["message"]
    assert "spec.source.credentialsSecretRef.name" in message and stack.ns in message
    stack.cluster.kubectl(
        "create", "secret", "generic", "private-source", "-n", stack.ns,
        "--from-literal=UNRELATED=x",
    )  # fmt: skip
    wait_for(
        lambda: "lacks the keys" in validated().get("message", ""),
        what="private reported a Secret without TOKEN", timeout_s=60,
    )  # fmt: skip
    assert validated()["reason"] == "CredentialsNotFound"
    stack.cluster.kubectl("delete", "secret", "private-source", "-n", stack.ns)
    stack.cluster.kubectl(
        "create", "secret", "generic", "private-source", "-n", stack.ns,
        "--from-literal=TOKEN=per-adapter-token",
    )  # fmt: skip
    wait_for(
        lambda: "127.0.0.1:9" in ((stack.adapter("private").get("status") or {}).get("lastError") or ""),
        what="private fetched by the control plane (and refused by the closed port)", timeout_s=90,
    )  # fmt: skip
    assert not validated().get("reason", "").startswith("Credentials")
    assert "per-adapter-token" not in json.dumps(stack.adapter("private"))
    stack.cluster.kubectl("delete", "loraadapter", "private", "-n", stack.ns, "--timeout=120s")
    stack.cluster.kubectl("delete", "secret", "private-source", "-n", stack.ns)


def _operator_pods(stack: Stack) -> list[dict[str, Any]]:
    return stack.cluster.get(  # type: ignore[no-any-return]
        "pods", "-n", stack.release_ns, "-l", "app.kubernetes.io/component=operator"
    )["items"]


def _load_operations(stack: Stack, name: str) -> list[dict[str, Any]]:
    items = stack.api(
        "GET", "/v1/operations", params={"namespace": stack.ns, "adapter": name, "limit": "200"}
    )
    return [
        o
        for o in items.json()["items"]
        if o["kind"] in ("register", "load") and o["state"] == "succeeded"
    ]


def test_killed_operator_restarts_and_converges_without_duplicate_loads(stack: Stack) -> None:
    stack.cluster.apply(_adapter_manifest(stack, "late", stack.adapters["extra"]))
    # Kill the operator as soon as the adapter is being worked on.
    wait_for(
        lambda: _phase(stack, "late") is not None,
        what="late picked up",
        timeout_s=60,
        interval_s=0.2,
    )
    for pod in _operator_pods(stack):
        stack.cluster.kubectl(
            "delete",
            "pod",
            pod["metadata"]["name"],
            "-n",
            stack.release_ns,
            "--grace-period=0",
            "--force",
        )
    wait_for(
        lambda: [p for p in _operator_pods(stack) if pod_ready(p)],
        what="a new operator pod",
        timeout_s=120,
    )
    _wait_ready(stack, ["late"], 3)
    assert len(_load_operations(stack, "late")) == 1


def _process_pid(stack: Stack, pod: dict[str, Any]) -> int | None:
    """The pid of the local-run pod's current process (the runner rewrites it per start)."""
    meta = pod["metadata"]
    run_dir = f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
    path = stack.cluster.state_dir / "pods" / run_dir / "process.json"
    return int(json.loads(path.read_text())["pid"]) if path.exists() else None


def _healthy(pod: dict[str, Any]) -> bool:
    try:
        url = f"http://{pod['status']['podIP']}:8081/healthz"
        return httpx.get(url, timeout=2).status_code == 200
    except (httpx.HTTPError, KeyError):
        return False


def test_operator_killed_with_sigkill_acts_on_the_next_change_within_10_s(stack: Stack) -> None:
    # kill -9 leaves the process's peering record behind, alive for its lifetime; the
    # restarted process outranks it (newest-first priority) and does not pause for it.
    (pod,) = [p for p in _operator_pods(stack) if pod_ready(p)]
    killed = _process_pid(stack, pod)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    wait_for(
        lambda: _process_pid(stack, pod) not in (None, killed) and _healthy(pod),
        what="the operator's process restarted by the runner and serving /healthz",
        timeout_s=120,
    )
    stack.cluster.apply(_adapter_manifest(stack, "after-kill", stack.adapters["spare"]))
    wait_for(
        lambda: _phase(stack, "after-kill") is not None,
        what="the restarted operator to act on a new LoRAAdapter",
        timeout_s=10,
        interval_s=0.2,
    )
    stack.cluster.kubectl("delete", "loraadapter", "after-kill", "-n", stack.ns, "--timeout=120s")


def test_with_two_replicas_only_the_leader_acts(stack: Stack) -> None:
    stack.cluster.kubectl(
        "scale",
        "deployment",
        f"{RELEASE}-loraplane-operator",
        "-n",
        stack.release_ns,
        "--replicas=2",
    )
    wait_for(
        lambda: len([p for p in _operator_pods(stack) if pod_ready(p)]) == 2,
        what="2 operators",
        timeout_s=120,
    )
    # The local cluster's kwok can hand a new pod the IP it freed moments ago (the operator
    # killed in the previous test) while another live pod holds it too; two processes on one
    # IP cannot both bind their health and metrics ports. Replace the newer pod until the
    # two replicas have their own addresses, as they would on a real cluster.
    for _ in range(3):
        pods = sorted(_operator_pods(stack), key=lambda p: p["metadata"]["creationTimestamp"])
        if len({p.get("status", {}).get("podIP") for p in pods}) == len(pods):
            break
        stack.cluster.kubectl(
            "delete", "pod", pods[-1]["metadata"]["name"], "-n", stack.release_ns, "--wait=true"
        )
        wait_for(
            lambda: len([p for p in _operator_pods(stack) if pod_ready(p)]) == 2,
            what="2 operators",
            timeout_s=120,
        )

    def peers() -> dict[str, Any]:
        peering = stack.cluster.get("clusterkopfpeering", stack.release_ns)
        return {k: v for k, v in (peering.get("status") or {}).items() if isinstance(v, dict)}

    wait_for(lambda: len(peers()) >= 2, what="both operators in the peering object", timeout_s=120)

    def leader(pod: dict[str, Any]) -> float | None:
        # The operator's own signal: `loraplane_operator_leader` on its metrics port is 1 while
        # the replica acts and 0 while kopf's peering pauses it (a replica of lower priority
        # than a live peer stays paused from its start, so its log shows no transition).
        try:
            text = httpx.get(f"http://{pod['status']['podIP']}:9090/metrics", timeout=5).text
        except (httpx.HTTPError, KeyError):
            return None
        for line in text.splitlines():
            if line.startswith("loraplane_operator_leader "):
                return float(line.split()[1])
        return None

    def one_leader() -> bool:
        values = [leader(p) for p in _operator_pods(stack) if pod_ready(p)]
        return None not in values and sorted(v or 0.0 for v in values) == [0.0, 1.0]

    wait_for(
        one_leader,
        what="exactly one operator leading (loraplane_operator_leader 1) and one standing by (0)",
        timeout_s=180,
    )
    stack.cluster.apply(_adapter_manifest(stack, "after-ha", stack.adapters["spare"]))
    _wait_ready(stack, ["after-ha"], 3)
    assert len(_load_operations(stack, "after-ha")) == 1
    stack.cluster.kubectl("delete", "loraadapter", "after-ha", "-n", stack.ns, "--timeout=120s")
    stack.cluster.kubectl(
        "scale",
        "deployment",
        f"{RELEASE}-loraplane-operator",
        "-n",
        stack.release_ns,
        "--replicas=1",
    )


def _worker_token_header(stack: Stack) -> dict[str, str]:
    """The pool's workers' admin token (its Secret, which the operator made), as a header:
    their adapter and debug endpoints refuse calls without it."""
    secret = stack.cluster.get("secret", "pool-worker-token", "-n", stack.ns)
    token = base64.b64decode(secret["data"]["token"]).decode()
    return {"Authorization": f"Bearer {token}"}


def test_adapter_failing_on_one_dp_group_is_never_ready_and_stops_retrying(stack: Stack) -> None:
    message = "injected: dp group 1 cannot load"
    admin = _worker_token_header(stack)
    for worker in stack.pool("pool")["status"]["workers"]:
        armed = httpx.post(
            f"http://{worker['podIP']}:8000/debug/fault",
            json={"op": "load", "dp_group": 1, "count": 1000, "message": message},
            headers=admin, timeout=30,
        )  # fmt: skip
        assert armed.status_code == 200, armed.text
    stack.cluster.apply(_adapter_manifest(stack, "broken", stack.adapters["spare"]))
    seen: set[str] = set()

    def failed() -> bool:
        adapter = stack.adapter("broken")
        seen.add(str((adapter.get("status") or {}).get("phase")))
        return (adapter.get("status") or {}).get("phase") == "Failed"

    wait_for(failed, what="broken to end Failed", timeout_s=240, interval_s=0.5)
    assert "Ready" not in seen
    adapter = stack.adapter("broken")
    assert message in _condition(adapter, "Degraded")["message"]
    assert _condition(adapter, "Ready")["reason"] == "RetriesExhausted"
    attempts = adapter["status"]["attempts"]
    assert attempts == 3
    events = stack.cluster.get(
        "events", "-n", stack.ns, "--field-selector", "involvedObject.name=broken"
    )["items"]
    assert any(e["type"] == "Warning" and e["reason"] in ("Degraded", "Failed") for e in events)
    time.sleep(8)  # several resync periods: no more attempts
    assert stack.adapter("broken")["status"]["attempts"] == attempts
    for worker in stack.pool("pool")["status"]["workers"]:
        httpx.post(
            f"http://{worker['podIP']}:8000/debug/fault",
            json={"op": "load", "dp_group": 1, "count": 0}, headers=admin, timeout=30,
        )  # fmt: skip
    stack.cluster.kubectl("delete", "loraadapter", "broken", "-n", stack.ns, "--timeout=120s")


def test_helm_lint_is_clean(stack: Stack) -> None:
    result = stack.cluster.run("helm", "lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
