"""Bearer tokens with scopes (read, route, admin) and a namespace, stored as sha256 hashes.

Tokens are 32 random bytes, so a plain sha256 is enough (no password stretching needed).
The bootstrap admin token comes from ``LORAPLANE_ADMIN_TOKEN`` and is never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

SCOPES = ("read", "route", "admin")
ALL_NAMESPACES = "*"
TOKEN_PREFIX = "lp_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: its scopes and namespace ("*" = every namespace)."""

    name: str
    scopes: frozenset[str]
    namespace: str

    def has(self, scope: str) -> bool:
        # admin implies read and route
        return scope in self.scopes or "admin" in self.scopes

    def sees(self, namespace: str) -> bool:
        return self.namespace == ALL_NAMESPACES or self.namespace == namespace

    @property
    def cluster_admin(self) -> bool:
        return "admin" in self.scopes and self.namespace == ALL_NAMESPACES


BOOTSTRAP = Principal("bootstrap-admin", frozenset({"admin"}), ALL_NAMESPACES)
