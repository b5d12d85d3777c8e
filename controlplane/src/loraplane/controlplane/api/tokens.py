"""Bearer tokens (admin for namespace '*' only). The plaintext is shown once, at creation."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Response
from pydantic import Field
from sqlalchemy import select

from loraplane.controlplane.api.bodies import Body, NoFields
from loraplane.controlplane.auth import ALL_NAMESPACES, hash_token, new_token
from loraplane.controlplane.deps import ClusterAdmin, Services, ServicesDep, SessionDep
from loraplane.controlplane.errors import not_found
from loraplane.controlplane.models import Token
from loraplane.controlplane.registry import check_label, iso

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


class TokenCreate(Body):
    name: str = Field(min_length=1, max_length=200)
    scopes: list[Literal["read", "route", "admin"]] = Field(min_length=1)
    namespace: str = "default"


def token_json(token: Token) -> dict[str, Any]:
    return {
        "id": token.id,
        "name": token.name,
        "scopes": sorted(token.scopes),
        "namespace": token.namespace,
        "created_at": iso(token.created_at),
    }


@router.post("", status_code=201)
def create_token(body: TokenCreate, session: SessionDep, _: ClusterAdmin) -> dict[str, Any]:
    if body.namespace != ALL_NAMESPACES:
        check_label(body.namespace, "body.namespace")
    plaintext = new_token()
    token = Token(
        id="tok_" + uuid.uuid4().hex[:16],
        name=body.name,
        token_hash=hash_token(plaintext),
        scopes=sorted(set(body.scopes)),
        namespace=body.namespace,
    )
    session.add(token)
    session.commit()
    return {**token_json(token), "token": plaintext}


@router.get("")
def list_tokens(session: SessionDep, _: ClusterAdmin) -> dict[str, Any]:
    return {
        "items": [
            token_json(t) for t in session.scalars(select(Token).order_by(Token.created_at)).all()
        ]
    }


@router.delete("/{token_id}", status_code=204)
async def delete_token(
    token_id: str, services: ServicesDep, _: ClusterAdmin, _body: NoFields | None = None
) -> Response:
    """Revoke a token: refused from the next request on, on this replica and (through the
    ``token.revoked`` event) on the others, which otherwise accept it from memory for at most
    ``token_cache_s``."""
    await asyncio.to_thread(_delete, services, token_id)
    services.tokens.invalidate()
    await services.bus.publish("token.revoked", namespace=None, token=token_id)
    return Response(status_code=204)


def _delete(services: Services, token_id: str) -> None:
    with services.db.session() as session:
        token = session.get(Token, token_id)
        if token is None:
            raise not_found("token", token_id, field="path.token_id")
        session.delete(token)
        session.commit()
