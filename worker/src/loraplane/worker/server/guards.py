"""What the worker checks before any work: body size, body shape, and (when configured) a token.

Every refusal is the documented error body (`protocol.ErrorResponse`), naming the field; a
refusal never quotes more than `QUOTE_CHARS` characters of what the client sent.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.rules.body_limit import BodyLimit
from loraplane.rules.validation import UNPARSED, UNPARSED_MESSAGE, body_refusal, summary
from loraplane.worker.config import ConfigError
from loraplane.worker.server import protocol as p

QUOTE_CHARS = 200
# Validation errors a 422 lists at most (the rest are counted).
SHOWN_ERRORS = 8
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def excerpt(value: str) -> str:
    """``repr(value)``, cut to `QUOTE_CHARS` characters with the full length named."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}… ({len(value)} characters)"


def error_body(status: int, message: str, param: str | None, kind: str) -> dict[str, Any]:
    return p.ErrorResponse(
        error=p.ErrorDetail(message=message, type=kind, param=param, code=status)
    ).model_dump()


# A field a client may mean under another name: the path it wrote -> the name here.
_MEANT = {
    ("sampling_params", "max_tokens"): "max_new_tokens",
    ("max_new_tokens",): "max_tokens",
    ("top_logprobs_num",): "logprobs",
    ("sampling_params",): "the sampling fields at the top level",
}


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """A 422 in the documented shape; pydantic's messages name the rule, never the input."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    refusal = body_refusal(errors, request.headers.get("content-type", ""))
    if refusal is not None:
        return _refused(422, refusal)
    param, message = summary(errors, keep_body=False, shown=SHOWN_ERRORS, meant=_MEANT)
    return JSONResponse(error_body(422, message, param, "invalid_request_error"), status_code=422)


def _refused(status: int, message: str) -> JSONResponse:
    """A refusal of the body as a whole (``param: body``)."""
    return JSONResponse(
        error_body(status, message, "body", "invalid_request_error"), status_code=status
    )


def _too_large(message: str) -> dict[str, Any]:
    return error_body(413, message, "body", "invalid_request_error")


async def http_error(_request: Request, exc: Exception) -> JSONResponse:
    """404, 405, 413 … in the documented shape."""
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "not_found", 401: "authentication_error"}.get(
        exc.status_code, "invalid_request_error"
    )
    param = "body" if exc.status_code in (408, 413) else None
    if exc.status_code == 400 and exc.detail == UNPARSED:
        return _refused(400, UNPARSED_MESSAGE)
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), param, kind),
        status_code=exc.status_code,
        headers=exc.headers,
    )


TOKEN_ENV = "LORAPLANE_WORKER_ADMIN_TOKEN"


def read_admin_token(path: str | None) -> str | None:
    """The admin token from `path` (surrounding whitespace dropped), else from `TOKEN_ENV`;
    None when neither is set. An empty or unreadable file is a `ConfigError`."""
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--admin-token-file {path}: {exc.strerror or exc}") from exc
    if not token:
        raise ConfigError(f"--admin-token-file {path}: the file is empty")
    return token


_bearer = HTTPBearer(auto_error=False, description="the worker's admin token, when configured")


def admin_dependency(token: str | None) -> Callable[..., Awaitable[None]]:
    """A route dependency: with `token` set, a request without ``Authorization: Bearer
    <token>`` is refused with 401 (documented in the OpenAPI schema as a bearer scheme)."""

    async def require_admin(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        if token is None:
            return
        given = credentials.credentials if credentials is not None else None
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise StarletteHTTPException(
                401,
                "Authorization: this endpoint needs the worker's admin token "
                "(Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_admin


def install(app: FastAPI, *, max_body_bytes: int) -> None:
    """The 422 handler and the body limit (the outermost layer: nothing reads a body first)."""
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes, setting="--max-request-bytes", refusal=_too_large
    )
