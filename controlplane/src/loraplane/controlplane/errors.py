"""One error shape for every 4xx/5xx: ``{"error": {"code", "field", "message"}}``."""

from __future__ import annotations

from typing import Any

QUOTE_CHARS = 200


def excerpt(value: str) -> str:
    """``repr(value)`` cut to `QUOTE_CHARS` characters (with the full length named): an error
    body never echoes a large input back."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}… ({len(value)} characters)"


class ApiError(Exception):
    """An error a client should see: HTTP status, a stable code, the offending field."""

    def __init__(
        self,
        status: int,
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


def bad_value(field: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, code, f"{field}: {message}", field=field)


def not_found(what: str, name: str, field: str | None = None) -> ApiError:
    return ApiError(404, "not_found", f"{what} {name!r} not found", field=field)


def conflict(message: str, code: str = "conflict", field: str | None = None) -> ApiError:
    return ApiError(409, code, message, field=field)
