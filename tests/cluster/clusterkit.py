"""Helpers for the cluster tests: run the pinned kubectl/helm, poll until something holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LORAPLANE = str(Path(sys.executable).parent / "loraplane")
CLUSTER_BINARIES = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm",
)  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    state_dir: Path
    kubeconfig: Path
    bin_dir: Path
    server: str

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}:{os.environ['PATH']}",
        }

    def run(
        self, tool: str, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl or helm against this cluster."""
        return self._exec([str(self.bin_dir / tool), *args], check=check, stdin=stdin)

    def shell(self, script: str, *, cwd: Path | None = None, timeout_s: float = 300) -> str:
        """Run `script` in bash (pinned kubectl/helm on PATH, this cluster's KUBECONFIG), as
        a user pastes documented commands; its stdout."""
        argv = ["bash", "-euo", "pipefail", "-c", script]
        return self._exec(argv, check=True, cwd=cwd, timeout_s=timeout_s).stdout

    def _exec(
        self,
        argv: list[str],
        *,
        check: bool,
        stdin: str | None = None,
        cwd: Path | None = None,
        timeout_s: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv,
            env=self.env(),
            input=stdin,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, check=check, stdin=stdin)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(
        self, manifest: dict[str, Any] | list[dict[str, Any]], *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        items = manifest if isinstance(manifest, list) else [manifest]
        return self.kubectl(
            "apply",
            "-f",
            "-",
            check=check,
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )


def wait_for(
    check: Callable[[], Any], *, what: str, timeout_s: float = 60.0, interval_s: float = 0.5
) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def missing_prerequisites() -> list[str]:
    """What a test installing the chart with real workers needs and this machine lacks:
    the `loraplane` commands, and the cluster binaries (built by `loraplane cluster up` or
    deploy/cluster/build.sh; a test does not start that long build)."""
    missing = []
    for args, what in (
        (("worker", "serve"), "`loraplane worker serve`"),
        (("controlplane", "serve"), "`loraplane controlplane serve`"),
        (("fixtures", "make-model"), "`loraplane fixtures make-model`"),
    ):
        probe = subprocess.run([LORAPLANE, *args, "--help"], capture_output=True, text=True)
        if probe.returncode != 0:
            missing.append(f"{what} (exit {probe.returncode}: {probe.stderr.strip()[-200:]})")
    try:
        from loraplane.devcluster import layout
    except ImportError as exc:
        return [*missing, f"loraplane.devcluster ({exc})"]
    unbuilt = [b for b in CLUSTER_BINARIES if not (layout.bin_dir() / b).is_file()]
    if unbuilt:
        missing.append(
            f"not built yet in {layout.bin_dir()}: {', '.join(unbuilt)} "
            "(run deploy/cluster/build.sh)"
        )
    return missing


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def make_model(out: Path, hidden: int) -> Path:
    """A small random Qwen3 checkpoint (`loraplane fixtures make-model`) at `out`."""
    subprocess.run(
        [LORAPLANE, "fixtures", "make-model", "--arch", "qwen3", "--out", str(out), "--hidden", str(hidden)],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def make_adapters(model: Path, root: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """One rank-8 adapter of `model` per name under `root`, each with its own seed."""
    adapters = {}
    for seed, name in enumerate(names):
        out = root / name
        subprocess.run(
            [LORAPLANE, "fixtures", "make-adapter", "--model", str(model), "--rank", "8", "--alpha", "16", "--init-scale", "1.0",
             "--targets", "q_proj,v_proj,down_proj", "--out", str(out), "--seed", str(seed + 1)],
            check=True, capture_output=True,
        )  # fmt: skip
        adapters[name] = out
    return adapters
