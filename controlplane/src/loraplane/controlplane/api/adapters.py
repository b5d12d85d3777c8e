"""Adapters: register, load, unload, pin/unpin, new version, delete. Every mutation is journalled."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import Field, SecretStr, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane import application
from loraplane.controlplane.api.bodies import Body, NoFields
from loraplane.controlplane.auth import Principal
from loraplane.controlplane.deps import (
    Admin,
    IdempotencyKey,
    Reader,
    Services,
    ServicesDep,
    check_namespace,
)
from loraplane.controlplane.models import Adapter, Operation, Pool
from loraplane.controlplane.operations import request_hash
from loraplane.controlplane.registry import (
    adapter_json,
    adapter_phase,
    check_label,
    get_adapter,
    operation_json,
)
from loraplane.controlplane.sources import (
    MAX_URI_CHARS,
    SourceCredentials,
    check_credentials,
)

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


Secret = Annotated[SecretStr, Field(min_length=1, max_length=8192)]


class CredentialsSpec(Body):
    """Per-adapter credentials for fetching the source: used by the preflight only, never
    stored, never logged, not part of the idempotency hash (SecretStr hides them in reprs)."""

    aws_access_key_id: Secret | None = Field(None, description="s3:// (with the secret key)")
    aws_secret_access_key: Secret | None = Field(None, description="s3:// (with the key id)")
    aws_session_token: Secret | None = Field(None, description="s3://, optional")
    token: Secret | None = Field(
        None, description="http(s):// and hf://: sent as `Authorization: Bearer <token>`"
    )

    @field_validator("*", mode="after")
    @classmethod
    def _header_safe(cls, value: Any) -> Any:
        # (each is sent in a request header or signs one; its value is never echoed)
        if isinstance(value, SecretStr) and not all(
            0x20 < ord(c) < 0x7F for c in value.get_secret_value()
        ):
            raise ValueError(
                "must be printable ASCII without spaces or line breaks (it goes into a request "
                "header); the value is not shown"
            )
        return value

    def for_fetch(self) -> SourceCredentials:
        return SourceCredentials(
            aws_access_key_id=self.aws_access_key_id,
            aws_secret_access_key=self.aws_secret_access_key,
            aws_session_token=self.aws_session_token,
            token=self.token,
        )


class SourceSpec(Body):
    uri: str = Field(min_length=1, max_length=MAX_URI_CHARS)
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="sha256 of adapter_model.safetensors"
    )
    credentials: CredentialsSpec | None = Field(
        None, description="fetch this source with these instead of the control plane's own"
    )

    def fetch_credentials(self) -> SourceCredentials | None:
        """The credentials for the preflight; 400 naming the key if they do not fit the URI."""
        credentials = self.credentials.for_fetch() if self.credentials is not None else None
        check_credentials(self.uri, credentials)
        return credentials


# What the idempotency hash of a request with a source covers: everything but the credentials
# (a retry with rotated credentials is the same request; no digest of a secret is stored).
UNHASHED = {"source": {"credentials"}}


class PlacementCount(Body):
    count: int = Field(ge=1, le=10_000)


Placement = Literal["all"] | PlacementCount


LoadPolicy = Annotated[
    Literal["OnDemand", "Explicit"],
    Field(
        description="OnDemand: a routed request for it loads it where it is not loaded; "
        "Explicit: only a load (registration, POST .../load) does, and the router refuses "
        "requests while it is loaded nowhere"
    ),
]


class AdapterCreate(Body):
    namespace: str = "default"
    name: str
    pool: str
    source: SourceSpec
    pinned: bool = False
    placement: Placement = "all"
    priority: int = Field(0, ge=-1000, le=1000)
    load: bool = True
    load_policy: LoadPolicy = "OnDemand"


class LoadRequest(Body):
    placement: Placement | None = None


class AdapterPatch(Body):
    pinned: bool | None = None
    priority: int | None = Field(None, ge=-1000, le=1000)
    load_policy: LoadPolicy | None = None


class VersionRequest(Body):
    source: SourceSpec


def count_of(placement: Placement) -> int | None:
    return None if placement == "all" else placement.count  # type: ignore[union-attr]


def source_of(source: SourceSpec) -> application.Source:
    """The source of a request; 400 naming the key if its credentials do not fit the URI."""
    return application.Source(source.uri, source.sha256, source.fetch_credentials())


def respond(
    session: Session, op: Operation, status_ok: int, include_adapter: bool = True
) -> JSONResponse:
    """The answer to a mutation: adapter and operation, 502 if the fan-out failed. Read in a
    session of its own (no refresh: an adapter a concurrent delete removed since this read
    is answered as read, not with an error)."""
    body: dict[str, Any] = {"operation": operation_json(op)}
    adapter = session.scalar(
        select(Adapter).where(Adapter.namespace == op.namespace, Adapter.name == op.adapter_name)
    )
    if include_adapter and adapter is not None:
        body["adapter"] = adapter_json(adapter)
    if op.state in ("failed", "rolled_back"):
        body["error"] = {
            "code": op.error_code or "fanout_failed",
            "field": None,
            "message": op.error or "the operation failed on a worker without a message",
        }
        return JSONResponse(body, status_code=502)
    if op.state in ("pending", "running"):
        return JSONResponse(body, status_code=202)
    return JSONResponse(body, status_code=status_ok)


async def answer(
    services: Services, done: application.OperationDone, status_ok: int
) -> JSONResponse:
    """The response to a use case's result (read in a worker thread, off the event loop)."""

    def read() -> JSONResponse:
        with services.db.session() as session:
            if done.operation_id is None:
                adapter = get_adapter(session, done.namespace, done.name)
                return JSONResponse({"adapter": adapter_json(adapter), "operation": None})
            op = session.get(Operation, done.operation_id)
            assert op is not None
            return respond(session, op, status_ok)

    return await asyncio.to_thread(read)


def visible(principal: Principal, namespace: str) -> None:
    check_namespace(principal, namespace)


@router.get("")
def list_adapters(
    services: ServicesDep,
    principal: Reader,
    namespace: str | None = None,
    pool: str | None = None,
    phase: str | None = Query(
        None, pattern="^(Pending|Loading|Ready|Degraded|Failed|Unloading|Unloaded)$"
    ),
) -> dict[str, Any]:
    with services.db.session() as session:
        query = select(Adapter).join(Pool).order_by(Adapter.namespace, Adapter.name)
        if namespace is not None:
            check_namespace(principal, namespace, "query.namespace")
            query = query.where(Adapter.namespace == namespace)
        if pool is not None:
            query = query.where(Pool.name == pool)
        adapters = [a for a in session.scalars(query).all() if principal.sees(a.namespace)]
        items = [adapter_json(a) for a in adapters if phase is None or adapter_phase(a) == phase]
    return {"items": items}


@router.get("/{namespace}/{name}")
def read_adapter(
    namespace: str, name: str, services: ServicesDep, principal: Reader
) -> dict[str, Any]:
    visible(principal, namespace)
    with services.db.session() as session:
        return adapter_json(get_adapter(session, namespace, name))


@router.post("", status_code=201)
async def register_adapter(
    body: AdapterCreate, services: ServicesDep, principal: Admin, key: IdempotencyKey = None
) -> JSONResponse:
    check_label(body.namespace, "body.namespace")
    check_label(body.name, "body.name")
    check_namespace(principal, body.namespace, "body.namespace")
    source = source_of(body.source)
    hash_ = request_hash("register", body.model_dump(mode="json", exclude=UNHASHED))
    command = application.Register(
        namespace=body.namespace,
        name=body.name,
        pool=body.pool,
        source=source,
        pinned=body.pinned,
        placement_count=count_of(body.placement),
        priority=body.priority,
        load=body.load,
        load_policy=body.load_policy,
        idempotency=application.Idempotency(key, hash_),
    )
    return await answer(services, await application.register(services, command), 201)


@router.post("/{namespace}/{name}/load")
async def load_adapter(
    namespace: str,
    name: str,
    services: ServicesDep,
    principal: Admin,
    body: LoadRequest | None = None,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    body = body or LoadRequest()
    hash_ = request_hash("load", [namespace, name, body.model_dump(mode="json")])
    command = application.Load(
        namespace,
        name,
        None if body.placement is None else (count_of(body.placement),),
        application.Idempotency(key, hash_),
    )
    return await answer(services, await application.load(services, command), 200)


async def _unload(
    namespace: str, name: str, services: Services, principal: Principal, key: str | None, kind: str
) -> JSONResponse:
    visible(principal, namespace)
    hash_ = request_hash(kind, [namespace, name])
    command = application.Unload(
        namespace, name, kind == "delete", application.Idempotency(key, hash_)
    )
    return await answer(services, await application.unload(services, command), 200)


def _unload_route(kind: str) -> Any:
    """The unload and delete routes: the same call, but delete forgets the adapter after."""

    async def route(
        namespace: str,
        name: str,
        services: ServicesDep,
        principal: Admin,
        key: IdempotencyKey = None,
        _body: NoFields | None = None,
    ) -> JSONResponse:
        return await _unload(namespace, name, services, principal, key, kind)

    route.__name__ = f"{kind}_adapter"
    return route


router.post("/{namespace}/{name}/unload")(_unload_route("unload"))
router.delete("/{namespace}/{name}")(_unload_route("delete"))


@router.patch("/{namespace}/{name}")
async def patch_adapter(
    namespace: str,
    name: str,
    body: AdapterPatch,
    services: ServicesDep,
    principal: Admin,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    hash_ = request_hash("patch", [namespace, name, body.model_dump(mode="json")])
    command = application.SetPinned(
        namespace,
        name,
        body.pinned,
        body.priority,
        body.load_policy,
        application.Idempotency(key, hash_),
    )
    return await answer(services, await application.set_pinned(services, command), 200)


@router.post("/{namespace}/{name}/version")
async def update_version(
    namespace: str,
    name: str,
    body: VersionRequest,
    services: ServicesDep,
    principal: Admin,
    key: IdempotencyKey = None,
) -> JSONResponse:
    visible(principal, namespace)
    source = source_of(body.source)
    hash_ = request_hash(
        "update_version", [namespace, name, body.model_dump(mode="json", exclude=UNHASHED)]
    )
    command = application.UpdateVersion(
        namespace, name, source, application.Idempotency(key, hash_)
    )
    return await answer(services, await application.update_version(services, command), 200)
