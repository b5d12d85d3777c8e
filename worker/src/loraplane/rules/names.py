"""Names: Kubernetes-style labels for namespaces, pools and adapters, and the name a worker
knows an adapter version by."""

from __future__ import annotations

import re
from typing import TypeGuard

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_LABEL_MAX = 63
DNS_LABEL_RULE = (
    "lowercase letters, digits and '-', starting and ending with a letter or digit, "
    f"at most {DNS_LABEL_MAX} characters"
)


def is_dns_label(value: object) -> TypeGuard[str]:
    """A DNS-1123 label: what a namespace, pool or adapter name may be."""
    return (
        isinstance(value, str) and len(value) <= DNS_LABEL_MAX and bool(DNS_LABEL.fullmatch(value))
    )  # (fullmatch: a pattern's `$` also matches before a final newline)


# the name a worker accepts for an adapter (the control plane's `lora_name`s are a subset)
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"


def lora_name(namespace: str, name: str, version: int) -> str:
    """The name workers know an adapter version by: `sql`, `team-a.sql`, `sql_v2`. Unambiguous
    because DNS-1123 labels have no `.` or `_`; the worker accepts `[A-Za-z0-9._-]`."""
    base = name if namespace == "default" else f"{namespace}.{name}"
    return base if version == 1 else f"{base}_v{version}"
