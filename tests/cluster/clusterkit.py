"""Helpers for the cluster tests: run the pinned kubectl/helm, poll until something holds."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
        result = subprocess.run(
            [str(self.bin_dir / tool), *args],
            env=self.env(),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
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
