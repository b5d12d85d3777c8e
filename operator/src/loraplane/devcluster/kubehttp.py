"""A very small Kubernetes API client over HTTPS (urllib + the admin client certificate).

The local pod runner needs a handful of raw JSON calls (list, watch, patch status with a
merge patch, TokenRequest). Making them directly keeps the runner independent of the
generated `kubernetes` client, whose low-level calling conventions change between major
versions.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeHTTP:
    def __init__(self, server: str, pki: Path) -> None:
        self.server = server.rstrip("/")
        self.tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def url(self, path: str, **query: Any) -> str:
        params = {k: v for k, v in query.items() if v is not None}
        return self.server + path + ("?" + urllib.parse.urlencode(params) if params else "")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 30.0,
        **query: Any,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url(path, **query), data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.tls) as response:
                result: dict[str, Any] = json.loads(response.read() or b"{}")
                return result
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def watch(
        self, path: str, resource_version: str, timeout_s: int = 300, **query: Any
    ) -> Iterator[dict[str, Any]]:
        """Watch events ({type, object}) from `resource_version` until the server ends the watch."""
        url = self.url(
            path,
            watch="true",
            resourceVersion=resource_version,
            timeoutSeconds=timeout_s,
            allowWatchBookmarks="true",
            **query,
        )
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s + 30, context=self.tls) as response:
            for line in response:
                if line.strip():
                    event: dict[str, Any] = json.loads(line)
                    yield event
