"""The local pod runner: what a kubelet does, for pods labelled `loraplane.io/local-run: "true"`.

kwok gives such a pod a node, a loopback pod IP (127.1.<node>.<n>) and phase Running, but
leaves it not Ready. The runner then starts the pod's first container `command` + `args`
(`$(VAR)` expanded) as a local process with the container's `env`, plus:

  POD_IP, POD_NAME, POD_NAMESPACE, HOSTNAME      so the process can bind to its pod IP
  KUBERNETES_SERVICE_HOST/PORT                    the API server (127.0.0.1:<port>)
  LORAPLANE_SERVICEACCOUNT_DIR                    a directory laid out like
      /var/run/secrets/kubernetes.io/serviceaccount (token, ca.crt, namespace), holding a
      TokenRequest token bound to the pod, refreshed before it expires

It sets the pod Ready from the container's readinessProbe (httpGet, tcpSocket or exec;
Ready as soon as it starts when there is none), restarts an exited process as
`restartPolicy` says, and when the pod is deleted it stops the process (SIGTERM, then
SIGKILL after terminationGracePeriodSeconds) before removing the pod. Each pod's output
goes to <state>/pods/<namespace>_<name>_<uid>/log.

Run by `loraplane cluster up` as `python -m loraplane.devcluster.runner --state-dir DIR`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplane.devcluster import podenv, processes
from loraplane.devcluster.kubehttp import KubeHTTP
from loraplane.devcluster.layout import LOCAL_RUN_LABEL, ClusterState, Process

log = logging.getLogger("loraplane.devcluster.runner")

_TOKEN_SECONDS = 3600
_MAX_BACKOFF_S = 30.0


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRun:
    """One local-run pod and its process."""

    uid: str
    namespace: str
    name: str
    directory: Path
    pod: dict[str, Any]
    child: subprocess.Popen[bytes] | None = None
    record: Process | None = None
    restarts: int = 0
    next_start: float = 0.0
    finished: bool = False  # exited for good (restartPolicy said so)
    stopping: bool = False
    ready: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0
    token_refresh_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)


class Runner:
    def __init__(self, state: Path, workdir: Path) -> None:
        cluster = ClusterState.load(state)
        if cluster is None:
            raise SystemExit(f"no cluster.json in {state}")
        self.state = state
        self.workdir = workdir
        self.cluster = cluster
        self.api = KubeHTTP(cluster.server, state / "pki")
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.runs: dict[str, PodRun] = {}
        self.stopping = threading.Event()
        self.ca = (state / "pki" / "ca.crt").read_bytes()

    # -- watching ----------------------------------------------------------------------

    def watch_pods(self) -> None:
        """List, then watch, local-run pods; put events on the queue; relist on any error."""
        selector = f"{LOCAL_RUN_LABEL}=true"
        while not self.stopping.is_set():
            try:
                listed = self.api.request("GET", "/api/v1/pods", labelSelector=selector)
                self.events.put(("LIST", listed["items"]))
                version = listed["metadata"]["resourceVersion"]
                for event in self.api.watch("/api/v1/pods", version, labelSelector=selector):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.events.put((event["type"], event["object"]))
                    elif event["type"] == "ERROR":  # e.g. 410 Gone: relist
                        break
            except Exception as exc:  # the API server restarts, a watch expires: relist
                if not self.stopping.is_set():
                    log.warning("pod watch failed (%s); relisting", exc)
                    time.sleep(1.0)

    # -- main loop -----------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self.watch_pods, name="watch", daemon=True).start()
        while not self.stopping.is_set():
            try:
                kind, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                kind, payload = "TICK", None
            try:
                if kind == "LIST":
                    seen = {p["metadata"]["uid"] for p in payload}
                    for uid in list(self.runs):
                        if uid not in seen:
                            self.pod_gone(uid)
                    for pod in payload:
                        self.reconcile(pod)
                elif kind == "DELETED":
                    self.pod_gone(payload["metadata"]["uid"])
                elif kind in ("ADDED", "MODIFIED"):
                    self.reconcile(payload)
                self.tick()
            except Exception:
                log.exception("runner loop")
        self.stop_all()

    def reconcile(self, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
        uid = meta["uid"]
        run = self.runs.get(uid)
        if run is None:
            if status.get("phase") in ("Succeeded", "Failed"):
                return
            run = PodRun(
                uid=uid,
                namespace=meta["namespace"],
                name=meta["name"],
                directory=self.state / "pods" / f"{meta['namespace']}_{meta['name']}_{uid}",
                pod=pod,
            )
            self.runs[uid] = run
        run.pod = pod
        if meta.get("deletionTimestamp"):
            if not run.stopping:
                run.stopping = True
                threading.Thread(target=self.terminate, args=(run,), daemon=True).start()
            return
        if (
            run.child is None
            and not run.finished
            and spec.get("nodeName")
            and status.get("podIP")
            and status.get("phase") == "Running"
            and time.monotonic() >= run.next_start
        ):
            self.start(run)

    def tick(self) -> None:
        now = time.monotonic()
        for run in list(self.runs.values()):
            if run.stopping:
                continue
            if run.child is not None and run.child.poll() is not None:
                self.exited(run, run.child.returncode)
            elif (
                run.child is None and not run.finished and run.next_start and now >= run.next_start
            ):
                self.reconcile(run.pod)
            if run.child is not None:
                if now >= run.token_refresh_at and run.token_refresh_at:
                    self.write_service_account(run)
                if now >= run.next_probe:
                    self.probe(run)

    # -- process lifecycle ---------------------------------------------------------------

    def start(self, run: PodRun) -> None:
        pod = run.pod
        container = pod["spec"]["containers"][0]
        run.directory.mkdir(parents=True, exist_ok=True)
        try:
            env = self.base_env(run)
            env = podenv.container_env(
                pod,
                container,
                env,
                read_secret=self.read("secrets"),
                read_config_map=self.read("configmaps"),
            )
            argv = podenv.command_line(container, env)
        except (podenv.PodEnvError, OSError) as exc:
            log.error("%s/%s: %s", run.namespace, run.name, exc)
            with open(run.directory / "log", "a") as out:
                out.write(f"[local-run] cannot start: {exc}\n")
            self.patch_status(run, ready=False, waiting=("CreateContainerConfigError", str(exc)))
            run.finished = True
            return
        workdir = Path(container.get("workingDir") or self.workdir)
        if not workdir.is_dir():
            workdir = self.workdir
        with open(run.directory / "log", "a") as out:
            out.write(f"[local-run] {_now()} start (restart {run.restarts}): {argv}\n")
        try:
            argv[0] = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
            run.record, run.child = processes.spawn(
                f"{run.namespace}/{run.name}", argv, run.directory / "log", env=env, cwd=workdir
            )
        except OSError as exc:
            log.error("%s/%s: %s", run.namespace, run.name, exc)
            with open(run.directory / "log", "a") as out:
                out.write(f"[local-run] cannot start: {exc}\n")
            run.next_start = time.monotonic() + self.backoff(run)
            run.restarts += 1
            return
        (run.directory / "process.json").write_text(json.dumps(asdict(run.record)))
        run.env = env
        run.ready = False
        run.probe_failures = 0
        probe = container.get("readinessProbe") or {}
        run.next_probe = time.monotonic() + float(probe.get("initialDelaySeconds", 0))
        log.info(
            "%s/%s: started pid %d at %s", run.namespace, run.name, run.record.pid, env["POD_IP"]
        )
        self.patch_status(run, ready=False, running=True)

    def base_env(self, run: PodRun) -> dict[str, str]:
        """This process's environment (so `python`, the venv and PATH work as in the shell
        that ran `cluster up`), less KUBECONFIG, plus what a kubelet would give."""
        pod = run.pod
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env["PATH"] = os.pathsep.join(
            [str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]
        )
        env.update(
            POD_IP=pod["status"]["podIP"],
            POD_NAME=run.name,
            POD_NAMESPACE=run.namespace,
            HOSTNAME=run.name,
            KUBERNETES_SERVICE_HOST="127.0.0.1",
            KUBERNETES_SERVICE_PORT=str(self.cluster.apiserver_port),
            KUBERNETES_SERVICE_PORT_HTTPS=str(self.cluster.apiserver_port),
        )
        if pod["spec"].get("automountServiceAccountToken", True):
            env["LORAPLANE_SERVICEACCOUNT_DIR"] = str(self.write_service_account(run))
        return env

    def write_service_account(self, run: PodRun) -> Path:
        """token, ca.crt and namespace for the pod's ServiceAccount, as a kubelet mounts them."""
        directory = run.directory / "serviceaccount"
        directory.mkdir(parents=True, exist_ok=True)
        account = run.pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": _TOKEN_SECONDS,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": run.name,
                    "uid": run.uid,
                },
            },
        }
        path = f"/api/v1/namespaces/{run.namespace}/serviceaccounts/{account}/token"
        token = self.api.request("POST", path, request)["status"]["token"]
        for name, content in (
            ("token", token),
            ("ca.crt", self.ca),
            ("namespace", run.namespace),
        ):
            tmp = directory / f".{name}.tmp"
            tmp.write_bytes(content if isinstance(content, bytes) else content.encode())
            tmp.replace(directory / name)
        run.token_refresh_at = time.monotonic() + 0.8 * _TOKEN_SECONDS
        return directory

    def exited(self, run: PodRun, code: int) -> None:
        policy = run.pod["spec"].get("restartPolicy", "Always")
        log.info(
            "%s/%s: process exited with %d (restartPolicy %s)",
            run.namespace,
            run.name,
            code,
            policy,
        )
        with open(run.directory / "log", "a") as out:
            out.write(f"[local-run] {_now()} exited with code {code}\n")
        run.child = None
        (run.directory / "process.json").unlink(missing_ok=True)
        run.ready = False
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            run.restarts += 1
            run.next_start = time.monotonic() + self.backoff(run)
            self.patch_status(
                run, ready=False, terminated=code, waiting=("CrashLoopBackOff", f"exit code {code}")
            )
        else:
            run.finished = True
            self.patch_status(
                run, ready=False, terminated=code, phase="Succeeded" if code == 0 else "Failed"
            )

    def backoff(self, run: PodRun) -> float:
        return float(min(_MAX_BACKOFF_S, 2 ** min(run.restarts, 5)))

    def terminate(self, run: PodRun) -> None:
        """Stop the pod's process gracefully, then remove the pod (kwok leaves that to us)."""
        grace = run.pod["spec"].get("terminationGracePeriodSeconds", 30)
        if run.record is not None:
            processes.stop(run.record, grace_s=float(min(grace or 0, 60)))
            (run.directory / "process.json").unlink(missing_ok=True)
            with open(run.directory / "log", "a") as out:
                out.write(f"[local-run] {_now()} stopped: pod deleted\n")
        try:
            self.api.request(
                "DELETE",
                f"/api/v1/namespaces/{run.namespace}/pods/{run.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": run.uid}},
            )
        except Exception as exc:  # already gone, or replaced by a pod of the same name
            log.debug("delete %s/%s: %s", run.namespace, run.name, exc)

    def pod_gone(self, uid: str) -> None:
        run = self.runs.pop(uid, None)
        if run is not None and run.record is not None and not run.stopping:
            run.stopping = True
            processes.stop(run.record, grace_s=10.0)
            (run.directory / "process.json").unlink(missing_ok=True)
            log.info("%s/%s: pod gone, process stopped", run.namespace, run.name)

    def stop_all(self) -> None:
        live = [
            r.record
            for r in self.runs.values()
            if r.record is not None and processes.is_running(r.record)
        ]
        threads = [
            threading.Thread(target=processes.stop, args=(p,), kwargs={"grace_s": 10.0})
            for p in live
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for run in self.runs.values():
            (run.directory / "process.json").unlink(missing_ok=True)

    # -- readiness -----------------------------------------------------------------------

    def probe(self, run: PodRun) -> None:
        container = run.pod["spec"]["containers"][0]
        probe = container.get("readinessProbe")
        if not probe:
            ok = True
            period = 10.0
        else:
            ok = self.run_probe(run, container, probe)
            period = float(probe.get("periodSeconds", 10))
        if ok:
            run.probe_failures = 0
            if not run.ready:
                run.ready = True
                self.patch_status(run, ready=True, running=True)
        else:
            run.probe_failures += 1
            if run.ready and run.probe_failures >= int((probe or {}).get("failureThreshold", 3)):
                run.ready = False
                self.patch_status(run, ready=False, running=True)
        # Until first Ready, probe every second so start-up is noticed quickly.
        run.next_probe = time.monotonic() + (period if run.ready else min(period, 1.0))

    def run_probe(self, run: PodRun, container: dict[str, Any], probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        pod_ip = run.env["POD_IP"]

        def port_of(value: Any) -> int:
            if isinstance(value, int) or str(value).isdigit():
                return int(value)
            for port in container.get("ports") or []:
                if port.get("name") == value:
                    return int(port["containerPort"])
            raise ValueError(f"no container port named {value!r}")

        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or pod_ip}:{port_of(get['port'])}"
                request = urllib.request.Request(url + get.get("path", "/"))
                for header in get.get("httpHeaders") or []:
                    request.add_header(header["name"], header["value"])
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return bool(200 <= response.status < 400)
            if "tcpSocket" in probe:
                tcp = probe["tcpSocket"]
                with socket.create_connection(
                    (tcp.get("host") or pod_ip, port_of(tcp["port"])), timeout=timeout
                ):
                    return True
            if "exec" in probe:
                result = subprocess.run(
                    probe["exec"]["command"],
                    env=run.env,
                    timeout=timeout,
                    capture_output=True,
                    check=False,
                )
                return result.returncode == 0
        except (OSError, ValueError, urllib.error.URLError, subprocess.TimeoutExpired):
            return False
        return True  # a probe kind this runner does not know: treat as passing

    # -- API helpers ---------------------------------------------------------------------

    def read(self, kind: str) -> podenv.Reader:
        """A reader of `secrets` or `configmaps` by (namespace, name)."""

        def reader(namespace: str, name: str) -> dict[str, Any] | None:
            return self.api.get_or_none(f"/api/v1/namespaces/{namespace}/{kind}/{name}")

        return reader

    def patch_status(
        self,
        run: PodRun,
        *,
        ready: bool,
        running: bool = False,
        terminated: int | None = None,
        waiting: tuple[str, str] | None = None,
        phase: str | None = None,
    ) -> None:
        """Write the container state and the Ready conditions as a kubelet would. A JSON
        merge patch replaces the lists whole, so each container's `state` holds exactly
        one of running, waiting or terminated."""
        now = _now()
        state: dict[str, Any]
        if running:
            state = {"running": {"startedAt": now}}
        elif waiting is not None:
            state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        else:
            state = {
                "terminated": {
                    "exitCode": terminated or 0,
                    "finishedAt": now,
                    "reason": "Completed" if not terminated else "Error",
                }
            }
        previous = {c["name"]: c for c in run.pod.get("status", {}).get("containerStatuses") or []}
        statuses = []
        for container in run.pod["spec"]["containers"]:
            entry: dict[str, Any] = {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "ready": ready,
                "started": running,
                "restartCount": run.restarts,
                "state": state,
            }
            if terminated is not None and waiting is not None:
                entry["lastState"] = {
                    "terminated": {
                        "exitCode": terminated,
                        "finishedAt": now,
                        "reason": "Completed" if not terminated else "Error",
                    }
                }
            elif previous.get(container["name"], {}).get("lastState"):
                entry["lastState"] = previous[container["name"]]["lastState"]
            statuses.append(entry)
        flag = "True" if ready else "False"
        conditions = [
            c
            for c in run.pod.get("status", {}).get("conditions") or []
            if c["type"] not in ("Ready", "ContainersReady")
        ]
        for kind in ("ContainersReady", "Ready"):
            condition = {"type": kind, "status": flag, "lastTransitionTime": now}
            if not ready:
                condition["reason"] = "LocalRunNotReady"
            conditions.append(condition)
        patch: dict[str, Any] = {
            "status": {"conditions": conditions, "containerStatuses": statuses}
        }
        if phase:
            patch["status"]["phase"] = phase
        try:
            run.pod = self.api.request(
                "PATCH",
                f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status",
                patch,
                content_type="application/merge-patch+json",
            )
        except Exception as exc:  # the pod went away meanwhile
            log.debug("patch status of %s/%s: %s", run.namespace, run.name, exc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path.cwd())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    runner = Runner(args.state_dir, args.workdir)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping pod processes", signum)
        runner.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.run()


if __name__ == "__main__":
    main()
