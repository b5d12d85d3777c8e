"""The cluster tier: one real local control plane per test session (`loraplane cluster up`).

The session fixture builds the pinned binaries if the cache is cold (long the first time,
see docs/cluster.md), starts a 2-node cluster with 8 GPUs per node in its own state
directory, and stops it at the end, failing the session if anything is left running.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterkit import Cluster, wait_for

from loraplane.devcluster import cluster, layout


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the pinned binaries before any test runs when a cluster test was selected:
    a cold build takes far longer than one test's timeout (docs/cluster.md)."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("cluster") for item in session.items):
        started = time.monotonic()
        bin_dir = layout.build_binaries()
        elapsed = time.monotonic() - started
        if elapsed > 5:
            print(f"\ncluster binaries built into {bin_dir} in {elapsed:.0f} s")


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("cluster-state")
    bin_dir = layout.build_binaries()
    started = cluster.up(state, bin_dir, cluster.NodeShape(count=2, gpus=8), timeout_s=180.0)
    yield Cluster(
        state_dir=state, kubeconfig=started.kubeconfig, bin_dir=bin_dir, server=started.server
    )
    problems = cluster.down(state)
    assert not problems, f"cluster down left things behind: {problems}"


@pytest.fixture(scope="session")
def kubeconfig(local_cluster: Cluster) -> Path:
    """The admin kubeconfig of the session's cluster."""
    return local_cluster.kubeconfig


@pytest.fixture
def namespace(local_cluster: Cluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    local_cluster.kubectl("create", "namespace", name)
    # The ServiceAccount controller creates `default` shortly after the namespace.
    wait_for(
        lambda: (
            local_cluster.kubectl(
                "get", "serviceaccount", "default", "-n", name, check=False
            ).returncode
            == 0
        ),
        what=f"ServiceAccount {name}/default",
    )
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
