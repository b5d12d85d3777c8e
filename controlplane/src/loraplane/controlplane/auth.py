"""Bearer tokens with scopes (read, route, admin) and a namespace, stored as sha256 hashes.

Tokens are 32 random bytes, so a plain sha256 is enough (no password stretching needed).
The bootstrap admin token comes from ``LORAPLANE_ADMIN_TOKEN`` and is never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
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


class TokenCache:
    """Principals of bearer tokens looked up lately, by token hash, each kept ``ttl_s`` after
    its lookup: a request with a known token does not wait for the database (a round trip,
    and a thread hop, per request otherwise). A revocation empties it (``invalidate``: this
    replica's own, or another's announced by an event), and a lookup that ran across an
    invalidation is not kept. Unknown tokens are not kept. ``ttl_s`` 0 keeps nothing."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._generation = 0
        self._lock = threading.Lock()  # invalidate() may run on a database thread

    @property
    def generation(self) -> int:
        """Take it before a lookup and give it to ``put`` after."""
        return self._generation

    def get(self, digest: str) -> Principal | None:
        entry = self._entries.get(digest)
        if entry is None or time.monotonic() - entry[1] >= self.ttl_s:
            return None
        return entry[0]

    def put(self, digest: str, principal: Principal, generation: int) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if generation != self._generation:
                return  # (revoked while it was looked up)
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[digest] = (principal, time.monotonic())

    def invalidate(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()
