"""One pass of the LoRAAdapter handler over `ml/a`, the way kopf calls it (shared by the
operator unit tests that drive `reconcile_adapter` against a fake control plane and kube)."""

from __future__ import annotations

import contextlib
from typing import Any

import kopf

from loraplane.operator import handlers
from loraplane.operator.config import OperatorConfig


def reconcile_adapter_once(
    kube: Any,
    cp: Any,
    spec: dict[str, Any],
    status: dict[str, Any],
    *,
    uid: str,
    generation: int = 1,
) -> dict[str, Any]:
    """Returns the status the pass writes (merged over `status`)."""
    runtime = handlers.Runtime(OperatorConfig(), kube, cp)
    body = kopf.Body(
        {
            "metadata": {"name": "a", "namespace": "ml", "uid": uid, "generation": generation},
            "spec": spec,
            "status": status,
        }
    )
    patch = kopf.Patch()
    with contextlib.suppress(kopf.TemporaryError):
        handlers.reconcile_adapter(
            name="a",
            namespace="ml",
            uid=uid,
            spec=kopf.Spec(body),
            status=kopf.Status(body),
            meta=kopf.Meta(body),
            body=body,
            patch=patch,
            memo=kopf.Memo(runtime=runtime),
            logger=None,
        )
    return {**status, **dict(patch["status"])}
