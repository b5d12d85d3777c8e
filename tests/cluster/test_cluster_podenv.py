"""How the local pod runner builds a container's environment and command line (no cluster)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from loraplane.devcluster.podenv import PodEnvError, command_line, container_env, expand

pytestmark = pytest.mark.cluster

POD: dict[str, Any] = {
    "metadata": {"name": "w-0", "namespace": "ml", "uid": "u1", "labels": {"pool": "p"}},
    "spec": {"nodeName": "gpu-node-1", "serviceAccountName": "worker"},
    "status": {"podIP": "127.1.1.7", "hostIP": "127.0.0.1", "podIPs": [{"ip": "127.1.1.7"}]},
}


def _no_objects(_namespace: str, _name: str) -> None:
    return None


def test_expand_follows_kubernetes_rules() -> None:
    env = {"POD_IP": "127.1.1.7", "PORT": "8000"}
    assert expand("--host=$(POD_IP):$(PORT)", env) == "--host=127.1.1.7:8000"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"  # escaped
    assert expand("$(UNSET) $HOME $", env) == "$(UNSET) $HOME $"  # left as written


def test_env_resolves_values_field_refs_and_secrets() -> None:
    container = {
        "name": "main",
        "command": ["serve", "--host", "$(POD_IP)", "--name=$(NAME)"],
        "args": ["--pool", "$(POOL)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POOL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['pool']"}}},
            {"name": "URL", "value": "http://$(POD_IP):8000"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        ],
    }

    def secrets(namespace: str, name: str) -> dict[str, Any]:
        assert (namespace, name) == ("ml", "s")
        return {"data": {"token": base64.b64encode(b"t0k").decode()}}

    env = container_env(
        POD, container, {"PATH": "/bin"}, read_secret=secrets, read_config_map=_no_objects
    )
    assert env["URL"] == "http://127.1.1.7:8000"
    assert env["TOKEN"] == "t0k" and env["PATH"] == "/bin"
    assert command_line(container, env) == [
        "serve",
        "--host",
        "127.1.1.7",
        "--name=w-0",
        "--pool",
        "p",
    ]


def test_missing_command_and_unknown_field_are_named() -> None:
    with pytest.raises(PodEnvError, match="no `command`"):
        command_line({"name": "main", "args": ["x"]}, {})
    bad = {
        "name": "main",
        "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.priority"}}}],
    }
    with pytest.raises(PodEnvError, match=r"spec\.priority"):
        container_env(POD, bad, {}, read_secret=_no_objects, read_config_map=_no_objects)
