"""The errors a client sees, in one shape: ``{"error": {"code", "field", "message"}}``.

The domain (registry, sources, operations, the use cases in ``application``) raises the kinds
below: plain exceptions that name a stable ``code``, the offending ``field`` and a message, and
know nothing of HTTP. ``api.http_errors`` maps each kind to its status, once. The HTTP edge
(authentication, the router's proxy) raises ``ApiError`` with an explicit status of its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

QUOTE_CHARS = 200


def excerpt(value: str) -> str:
    """``repr(value)`` cut to `QUOTE_CHARS` characters (with the full length named): an error
    body never echoes a large input back."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}… ({len(value)} characters)"


class ApiError(Exception):
    """An error a client should see: a stable code, the offending field, a message; raised as
    such only at the HTTP edge, with its ``status``. Domain code raises a `DomainError` kind."""

    def __init__(
        self,
        status: int | None,
        code: str,
        message: str,
        field: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.field = field
        self.message = message
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"code": self.code, "field": self.field, "message": self.message},
            **self.extra,
        }


class DomainError(ApiError):
    """A refusal by the domain; its kind (the subclass) decides the HTTP status, in one table."""

    default_code: ClassVar[str] = "error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(None, code or self.default_code, message, field, extra)


class InvalidValue(DomainError):
    """A bad value in the request; nothing changed."""

    default_code = "invalid_value"


class InvalidSource(InvalidValue):
    """An adapter source that cannot be used (bad URI, preflight refused, digest mismatch)."""

    default_code = "invalid_source"


class NotFound(DomainError):
    default_code = "not_found"


class Conflict(DomainError):
    """The state forbids it now (exists, in another operation, inconsistent, key reused)."""

    default_code = "conflict"


class PinLimit(Conflict):
    """Pinning would leave no slot for unpinned traffic (at most K - 1 pinned per worker)."""

    default_code = "too_many_pinned"


class NoCapacity(Conflict):
    """No ready worker can take the adapter. ``no_worker``: some worker was not ready, or none
    is registered (the router answers ``no_worker`` then, ``no_capacity`` otherwise)."""

    default_code = "no_capacity"

    def __init__(self, message: str, *, no_worker: bool = False) -> None:
        super().__init__(message)
        self.no_worker = no_worker


class Unavailable(DomainError):
    """It cannot be done now but may be later (no worker, an on-demand load failed)."""

    default_code = "unavailable"


def bad_value(field: str, message: str, code: str = "invalid_value") -> InvalidValue:
    return InvalidValue(f"{field}: {message}", code=code, field=field)


def not_found(what: str, name: str, field: str | None = None) -> NotFound:
    return NotFound(f"{what} {excerpt(name)} not found", field=field)


def conflict(message: str, code: str = "conflict", field: str | None = None) -> Conflict:
    return Conflict(message, code=code, field=field)
