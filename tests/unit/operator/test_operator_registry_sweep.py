"""Lifecycle edges: a LoRAPool deleted while the control plane was down is cleaned up in the
registry once it answers, and an adapter of such a pool does not hang in its finalizer."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from loraplane.operator import handlers
from loraplane.operator.config import OperatorConfig
from loraplane.operator.cpclient import ControlPlaneError

pytestmark = pytest.mark.unit


class Kube:
    def __init__(self, pools: set[tuple[str, str]]) -> None:
        self.pools = pools

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"spec": {}} if (namespace, name) in self.pools else None


class Registry:
    """The control plane's pools, workers and adapters, with its rules: a pool with workers or
    adapters cannot be deleted (409), and unloading an adapter fans out to the pool's workers,
    failing (502) while one of them is unreachable."""

    def __init__(self) -> None:
        self.pools: set[tuple[str, str]] = set()
        self.workers: dict[str, tuple[str, str]] = {}  # name -> pool
        self.unreachable: set[str] = set()
        self.adapters: dict[tuple[str, str], tuple[str, str]] = {}  # adapter -> pool

    def list_pools(self) -> list[dict[str, Any]]:
        return [{"namespace": ns, "name": name} for ns, name in sorted(self.pools)]

    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [{"name": w} for w, p in self.workers.items() if p == (namespace, pool)]

    def delete_worker(self, name: str) -> None:
        self.workers.pop(name, None)

    def delete_pool(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self.workers.values() or key in self.adapters.values():
            raise ControlPlaneError(
                409, "conflict", "pool still has workers or adapters", None, None
            )
        self.pools.discard(key)

    def delete_adapter(self, namespace: str, name: str, key: str) -> None:
        pool = self.adapters.get((namespace, name))
        if pool is not None and any(
            w in self.unreachable for w, p in self.workers.items() if p == pool
        ):
            raise ControlPlaneError(502, "fanout_failed", "w-gone: unreachable", None, None)
        self.adapters.pop((namespace, name), None)


def runtime(kube: Kube, cp: Registry, namespaces: tuple[str, ...] = ()) -> handlers.Runtime:
    return handlers.Runtime(OperatorConfig(namespaces=namespaces), kube, cp)  # type: ignore[arg-type]


def test_sweep_releases_pools_whose_lorapool_is_gone() -> None:
    cp = Registry()
    cp.pools = {("ml", "gone"), ("ml", "kept"), ("other", "gone")}
    cp.workers = {
        "ml-gone-0": ("ml", "gone"),
        "ml-kept-0": ("ml", "kept"),
        "o-0": ("other", "gone"),
    }
    kube = Kube({("ml", "kept")})
    assert handlers.sweep_registry(runtime(kube, cp, namespaces=("ml",))) == ["ml/gone"]
    assert cp.pools == {("ml", "kept"), ("other", "gone")}  # other: not a watched namespace
    assert set(cp.workers) == {"ml-kept-0", "o-0"}


def test_sweep_keeps_a_pool_with_adapters_until_they_are_gone() -> None:
    cp = Registry()
    cp.pools = {("ml", "gone")}
    cp.workers = {"ml-gone-0": ("ml", "gone")}
    cp.adapters = {("ml", "a"): ("ml", "gone")}
    rt = runtime(Kube(set()), cp)
    assert handlers.sweep_registry(rt) == ["ml/gone"]
    assert cp.workers == {} and cp.pools == {("ml", "gone")}  # 409: the adapter remains
    cp.adapters.clear()
    handlers.sweep_registry(rt)
    assert cp.pools == set()


def unload(kube: Kube, cp: Registry, retry: int) -> None:
    """The finalizer's delete handler for LoRAAdapter ml/a of pool `gone`, as kopf calls it."""
    body = kopf.Body(
        {"metadata": {"name": "a", "namespace": "ml", "uid": "u"}, "spec": {"pool": "gone"}}
    )
    handlers.unload_adapter(
        name="a",
        namespace="ml",
        uid="u",
        body=body,
        patch=kopf.Patch(),
        retry=retry,
        memo=kopf.Memo(runtime=runtime(kube, cp)),
    )


def test_an_adapter_of_a_deleted_pool_is_unloaded_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers.kopf, "event", lambda *args, **kwargs: None)
    cp = Registry()
    cp.pools = {("ml", "gone")}
    cp.workers = {"w-gone": ("ml", "gone")}
    cp.unreachable = {"w-gone"}
    cp.adapters = {("ml", "a"): ("ml", "gone")}
    unload(Kube(set()), cp, retry=0)
    assert cp.adapters == {} and cp.workers == {}
    # While the pool exists, a failing unload is still retried, not forced.
    cp.workers = {"w-gone": ("ml", "gone")}
    cp.adapters = {("ml", "a"): ("ml", "gone")}
    with pytest.raises(kopf.TemporaryError):
        unload(Kube({("ml", "gone")}), cp, retry=1)
    assert cp.adapters and cp.workers
