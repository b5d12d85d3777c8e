"""docs/operator.md's quick start and the chart's NOTES, run as written on the local cluster.

The commands are the docs' own: `helm install loraplane charts/loraplane -n loraplane
--create-namespace` (plus one `--set`: the control plane may read file:// sources only under
`controlplane.sources.allowedRoots`, here the test's fixtures), the NOTES' `kubectl` lines,
`kubectl apply -f pool.yaml -f adapters.yaml` of deploy/examples with a small CPU model and
file:// adapters in place of the GPU model and remote URIs, a request through the router,
and the documented uninstall.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from clusterkit import Cluster, make_adapters, make_model, missing_prerequisites, wait_for
from openai import OpenAI

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "deploy" / "examples"


def _shell(cluster: Cluster, script: str) -> str:
    return cluster.shell(script, cwd=ROOT)


def _examples(work: Path) -> tuple[Path, Path]:
    """deploy/examples' pool and adapters with a CPU fixture model and file:// sources."""
    model = make_model(work / "models" / "qwen3-tiny", hidden=64)
    (pool,) = yaml.safe_load_all((EXAMPLES / "pool.yaml").read_text())
    adapters = list(yaml.safe_load_all((EXAMPLES / "adapters.yaml").read_text()))
    names = tuple(a["metadata"]["name"] for a in adapters)
    sources = make_adapters(model, work / "adapters", names)
    spec = pool["spec"]
    for key in ("volumes", "volumeMounts", "compileCache", "resources", "tolerations"):
        spec.pop(key, None)
    spec.update(
        model=str(model),
        replicas=1,
        tp=1,
        dp=1,
        enableDPAttention=False,
        engineArgs=["--device", "cpu", "--lora-backend", "torch", "--allowed-lora-root", str(work)],
    )
    for adapter in adapters:
        adapter["spec"]["source"] = {"uri": f"file://{sources[adapter['metadata']['name']]}"}
    pool_file, adapters_file = work / "pool.yaml", work / "adapters.yaml"
    pool_file.write_text(yaml.safe_dump(pool))
    adapters_file.write_text(yaml.safe_dump_all(adapters))
    return pool_file, adapters_file


def _notes_lines(notes: str, start: str) -> list[str]:
    return [line.strip() for line in notes.splitlines() if line.strip().startswith(start)]


def test_quick_start_as_written(local_cluster: Cluster, tmp_path: Path) -> None:
    missing = missing_prerequisites()
    if missing:
        pytest.skip("the quick start needs: " + "; ".join(missing))
    cluster = local_cluster
    pool_file, adapters_file = _examples(tmp_path)
    install = _shell(
        cluster,
        "helm install loraplane charts/loraplane -n loraplane --create-namespace "
        f"--set 'controlplane.sources.allowedRoots={{{tmp_path}}}'",
    )
    try:
        _walk_through(cluster, install, pool_file, adapters_file)
    except BaseException:
        # (the quick start's pool holds GPUs of the fake nodes: give them back, or the tests
        # after a failure here find too few)
        cluster.kubectl("delete", "loraadapters,lorapools", "--all", "-A", check=False)
        cluster.run("helm", "uninstall", "loraplane", "-n", "loraplane", "--wait", check=False)
        raise


def _walk_through(cluster: Cluster, install: str, pool_file: Path, adapters_file: Path) -> None:
    """The quick start after ``helm install``: its NOTES' steps, a request, the uninstall."""
    # localRun: auto found the local cluster's nodes.
    assert "localRun is on" in install
    # NOTES step 1, as printed (rollout status waits for Ready pods).
    for line in _notes_lines(install, "kubectl -n loraplane rollout status"):
        _shell(cluster, line + " --timeout=180s")
    apply = f"kubectl apply -f {pool_file} -f {adapters_file}"
    _shell(cluster, apply)
    names = [a["metadata"]["name"] for a in yaml.safe_load_all(adapters_file.read_text())]

    def all_ready() -> bool:
        adapters = cluster.get("loraadapters", "-n", "default")["items"]
        phases = {a["metadata"]["name"]: (a.get("status") or {}).get("phase") for a in adapters}
        return all(phases.get(n) == "Ready" for n in names)

    wait_for(all_ready, what=f"adapters {names} Ready", timeout_s=300, interval_s=2)
    # NOTES' and the docs' listing command: kubectl accepts it, and shows both kinds.
    (listing,) = [
        line.split("#")[0].strip() for line in _notes_lines(install, "kubectl get lorapools")
    ]
    table = _shell(cluster, listing)
    assert "lorapool.loraplane.io/qwen-small" in table
    assert "loraadapter.loraplane.io/sql-expert" in table

    # NOTES step 3: the token and the router's address, then a request for pool:adapter.
    exports = _notes_lines(install, "export ")
    assert len(exports) == 2
    url, token = _shell(
        cluster, "\n".join([*exports, 'echo "$LORAPLANE_URL $LORAPLANE_TOKEN"'])
    ).split()
    client = OpenAI(base_url=f"{url}/v1", api_key=token, timeout=120, max_retries=0)
    # (greedy: sampled, this random fixture model's first token is at times its end of text)
    completion = client.completions.create(
        model="qwen-small:sql-expert", prompt="Hello", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens >= 1

    # The documented uninstall: nothing waits on a finalizer, nothing is left.
    _shell(cluster, "kubectl delete loraadapters --all -A --timeout=120s")
    _shell(cluster, "kubectl delete lorapools --all -A --timeout=120s")
    _shell(cluster, "helm uninstall loraplane -n loraplane --wait --timeout=120s")
    left: dict[str, Any] = cluster.get("loraadapters,lorapools", "-A")
    assert left["items"] == []
    assert cluster.get("deployments", "-n", "loraplane")["items"] == []
    cluster.kubectl("delete", "namespace", "loraplane", "--wait=false")
