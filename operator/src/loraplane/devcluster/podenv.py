"""A pod container's environment and `$(VAR)` expansion, as a kubelet computes them.

Pods are plain JSON dicts (the API's camelCase shape). Secrets and ConfigMaps are read
through callables so this module needs no API client and is testable on its own.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

Pod = dict[str, Any]
# (namespace, name) -> the object's JSON, or None if it does not exist.
Reader = Callable[[str, str], dict[str, Any] | None]


class PodEnvError(ValueError):
    """The container's environment cannot be resolved; the message names the variable."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of `$(VAR)` references: a defined VAR is replaced by its
    value, an undefined one is left as written, and `$$` escapes a `$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":
            out.append("$")
            i += 2
        elif following == "(":
            close = text.find(")", i + 2)
            if close == -1:
                out.append(text[i:])
                break
            name = text[i + 2 : close]
            out.append(env[name] if name in env else text[i : close + 1])
            i = close + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: Pod, path: str) -> str:
    """The value of a downward-API `fieldRef.fieldPath` for `pod`."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs") or []),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs") or []),
    }
    if path in simple:
        return simple[path] or ""
    match = _LABEL_PATH.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise PodEnvError(f"fieldRef.fieldPath={path!r} is not supported by the local pod runner")


def container_env(
    pod: Pod,
    container: Mapping[str, Any],
    base: Mapping[str, str],
    *,
    read_secret: Reader,
    read_config_map: Reader,
) -> dict[str, str]:
    """`base` overlaid with the container's `envFrom` and then `env`, in order; each `env`
    value may reference variables defined before it with `$(VAR)`."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)

    def key_of(kind: str, source: Mapping[str, Any], reader: Reader, decode: bool) -> str | None:
        obj = reader(namespace, source["name"])
        data = (obj or {}).get("data") or {}
        if source["key"] not in data:
            if source.get("optional"):
                return None
            raise PodEnvError(f"{kind} {namespace}/{source['name']} has no key {source['key']!r}")
        value = data[source["key"]]
        return base64.b64decode(value).decode() if decode else str(value)

    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, reader, decode in (
            ("configMapRef", read_config_map, False),
            ("secretRef", read_secret, True),
        ):
            if kind not in source:
                continue
            obj = reader(namespace, source[kind]["name"])
            if obj is None:
                if source[kind].get("optional"):
                    continue
                raise PodEnvError(
                    f"envFrom.{kind}: {namespace}/{source[kind]['name']} does not exist"
                )
            for key, raw in (obj.get("data") or {}).items():
                env[prefix + key] = base64.b64decode(raw).decode() if decode else str(raw)

    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            value = key_of("Secret", source["secretKeyRef"], read_secret, True)
        elif "configMapKeyRef" in source:
            value = key_of("ConfigMap", source["configMapKeyRef"], read_config_map, False)
        else:
            raise PodEnvError(
                f"env {name}: valueFrom.{next(iter(source), '?')} is not supported by the local pod runner"
            )
        if value is not None:
            env[name] = value
    return env


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The container's `command` + `args` with `$(VAR)` expanded. A container without a
    `command` would run its image's entrypoint, which the local runner cannot know."""
    command = list(container.get("command") or [])
    if not command:
        raise PodEnvError(
            f"container {container.get('name')!r} has no `command`: the local pod runner runs "
            "the command itself, not the image's entrypoint"
        )
    return [expand(part, env) for part in command + list(container.get("args") or [])]
