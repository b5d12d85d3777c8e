"""Shared services and ``Annotated`` dependencies for the routers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.auth import BOOTSTRAP, Principal, hash_token, same_hash
from loraplane.controlplane.errors import ApiError
from loraplane.controlplane.models import Token
from loraplane.controlplane.services import Services as Services  # the routers import it here


async def get_services(request: Request) -> Services:  # async: no thread hop per request
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    """A session for one request. Handlers that write commit before answering: FastAPI may run
    the code after ``yield`` only once the response is on its way."""
    with services.db.session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def get_principal(
    services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    return await authenticate(services, authorization)


async def authenticate(services: Services, authorization: str | None) -> Principal:
    """The caller of a request with this ``Authorization`` header; a bearer token other than
    the admin's is looked up off the event loop, unless looked up lately (``TokenCache``)."""
    if not services.settings.auth:
        return BOOTSTRAP
    if not authorization:
        raise ApiError(
            401,
            "unauthenticated",
            "header.Authorization: missing bearer token",
            field="header.Authorization",
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "unauthenticated",
            "header.Authorization: expected 'Bearer <token>'",
            field="header.Authorization",
        )
    digest = hash_token(token.strip())
    admin = services.settings.admin_token
    if admin is not None and same_hash(digest, hash_token(admin.get_secret_value())):
        return BOOTSTRAP
    principal = services.tokens.get(digest)
    if principal is not None:
        return principal
    generation = services.tokens.generation
    principal = await asyncio.to_thread(_token_principal, services, digest)
    if principal is not None:
        services.tokens.put(digest, principal, generation)
    if principal is None:
        raise ApiError(
            401,
            "unauthenticated",
            "header.Authorization: unknown token",
            field="header.Authorization",
        )
    return principal


def _token_principal(services: Services, digest: str) -> Principal | None:
    with services.db.session() as session:
        row = session.scalar(select(Token).where(Token.token_hash == digest))
        if row is None:
            return None
        return Principal(row.name, frozenset(row.scopes), row.namespace)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require(scope: str):  # type: ignore[no-untyped-def]
    async def check(principal: PrincipalDep) -> Principal:
        return check_scope(principal, scope)

    return check


def check_scope(principal: Principal, scope: str) -> Principal:
    if not principal.has(scope):
        raise ApiError(
            403,
            "forbidden_scope",
            f"token {principal.name!r} has scopes {sorted(principal.scopes)}; this call needs {scope!r}",
            field="header.Authorization",
        )
    return principal


Reader = Annotated[Principal, Depends(require("read"))]
RouteCaller = Annotated[Principal, Depends(require("route"))]
Admin = Annotated[Principal, Depends(require("admin"))]


async def require_cluster_admin(principal: Admin) -> Principal:
    if not principal.cluster_admin:
        raise ApiError(
            403,
            "forbidden_namespace",
            f"token {principal.name!r} is limited to namespace {principal.namespace!r}; "
            "pools, workers and tokens need an admin token for namespace '*'",
            field="header.Authorization",
        )
    return principal


ClusterAdmin = Annotated[Principal, Depends(require_cluster_admin)]


def check_namespace(principal: Principal, namespace: str, field: str = "path.namespace") -> None:
    if not principal.sees(namespace):
        raise ApiError(
            403,
            "forbidden_namespace",
            f"{field}: token {principal.name!r} may not access namespace {namespace!r} "
            f"(it is limited to {principal.namespace!r})",
            field=field,
        )


IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)]
