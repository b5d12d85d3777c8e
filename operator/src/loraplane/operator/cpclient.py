"""The control plane's HTTP API (docs/controlplane-api.md), as the operator uses it.

Only HTTP: the operator never imports the control plane's code. Every mutating call
carries an `Idempotency-Key` derived from the object's uid and generation, so a
restarted operator repeating a call does not repeat the operation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx


class ControlPlaneUnavailable(Exception):
    """The control plane could not be reached (retry later)."""


class ControlPlaneError(Exception):
    """An error answer: `status`, the API's `code`, `field` and `message`."""

    def __init__(self, status: int, code: str, message: str, field: str | None, body: Any) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.body = body


class ControlPlaneClient:
    """A small synchronous client; `base_url` is resolved on each call (it may move)."""

    def __init__(
        self,
        base_url: Callable[[], str],
        token: str | None,
        timeout_s: float = 150.0,
        transport: httpx.BaseTransport | None = None,
        on_reachable: Callable[[bool], None] | None = None,
    ) -> None:
        self._base_url = base_url
        # Told after each call whether the control plane answered (a 5xx counts as not).
        self._on_reachable = on_reachable or (lambda _up: None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        key: str | None = None,
        ok_statuses: tuple[int, ...] = (),
    ) -> Any:
        try:
            answer = self._request(method, path, json, params, key, ok_statuses)
        except ControlPlaneUnavailable:
            self._on_reachable(False)
            raise
        except ControlPlaneError:
            self._on_reachable(True)
            raise
        self._on_reachable(True)
        return answer

    def _request(
        self,
        method: str,
        path: str,
        json: Any,
        params: dict[str, str] | None,
        key: str | None,
        ok_statuses: tuple[int, ...],
    ) -> Any:
        try:
            url = self._base_url().rstrip("/") + path
        except LookupError as exc:
            raise ControlPlaneUnavailable(str(exc)) from exc
        headers = {"Idempotency-Key": key[:200]} if key else {}
        try:
            response = self._http.request(method, url, json=json, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code < 400 or response.status_code in ok_statuses:
            return response.json() if response.content else None
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"code": "http_error", "message": response.text[:500]}}
        error = (body or {}).get("error") or {}
        if response.status_code >= 500 and error.get("code") not in ("fanout_failed",):
            raise ControlPlaneUnavailable(
                f"{method} {path}: {response.status_code} {error.get('message') or response.text[:200]}"
            )
        raise ControlPlaneError(
            response.status_code,
            str(error.get("code", "http_error")),
            str(error.get("message", response.text[:500])),
            error.get("field"),
            body,
        )

    # pools
    def put_pool(self, namespace: str, name: str, body: dict[str, Any], key: str) -> Any:
        return self._call("PUT", f"/v1/pools/{namespace}/{name}", json=body, key=key)

    def list_pools(self) -> list[dict[str, Any]]:
        answer = self._call("GET", "/v1/pools")
        return list((answer or {}).get("items") or [])

    def delete_pool(self, namespace: str, name: str) -> None:
        self._call("DELETE", f"/v1/pools/{namespace}/{name}", ok_statuses=(404,))

    # workers
    def register_worker(self, body: dict[str, Any], key: str) -> Any:
        return self._call("POST", "/v1/workers", json=body, key=key)

    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        answer = self._call("GET", "/v1/workers", params={"namespace": namespace, "pool": pool})
        return list(answer.get("items") or [])

    def delete_worker(self, name: str) -> None:
        self._call("DELETE", f"/v1/workers/{name}", ok_statuses=(404,))

    # adapters
    def get_adapter(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            answer: dict[str, Any] = self._call("GET", f"/v1/adapters/{namespace}/{name}")
        except ControlPlaneError as exc:
            if exc.status == 404:
                return None
            raise
        return answer

    def register_adapter(self, body: dict[str, Any], key: str) -> Any:
        return self._call("POST", "/v1/adapters", json=body, key=key)

    def load_adapter(self, namespace: str, name: str, placement: Any, key: str) -> Any:
        return self._call(
            "POST", f"/v1/adapters/{namespace}/{name}/load", json={"placement": placement}, key=key
        )

    def patch_adapter(self, namespace: str, name: str, body: dict[str, Any], key: str) -> Any:
        return self._call("PATCH", f"/v1/adapters/{namespace}/{name}", json=body, key=key)

    def new_version(self, namespace: str, name: str, source: dict[str, Any], key: str) -> Any:
        return self._call(
            "POST", f"/v1/adapters/{namespace}/{name}/version", json={"source": source}, key=key
        )

    def delete_adapter(self, namespace: str, name: str, key: str) -> Any:
        return self._call("DELETE", f"/v1/adapters/{namespace}/{name}", key=key, ok_statuses=(404,))
