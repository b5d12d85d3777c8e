"""The HTTP client for one worker's API (SGLang names). The only module that talks to workers.

Every call answers; transport errors and malformed answers become failed results or
``WorkerUnreachable`` naming the worker, never exceptions the caller did not ask for.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loraplane.rules.merge import UpdateResult


class WorkerUnreachable(Exception):
    pass


# What a request to a worker can raise before any answer: a transport error, or an endpoint
# httpx cannot use (registration checks endpoints; this keeps one bad row from failing more).
NO_ANSWER = (httpx.HTTPError, httpx.InvalidURL)


class WorkerTimeout(Exception):
    """A connected worker did not answer in time: busy, not gone."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What a worker reports: base model id, adapters per DP group, slot limits."""

    served_model: str | None
    adapters: frozenset[str]  # lora names listed by /v1/models
    groups: tuple[
        frozenset[str], ...
    ]  # per DP group (from /lora_state; else /v1/models for every group)
    inconsistent: frozenset[str] = frozenset()
    lora_state: Mapping[str, Any] | None = None
    pinned: frozenset[str] = field(default_factory=frozenset)

    def present_on(self, lora_name: str) -> list[int]:
        return [i for i, group in enumerate(self.groups) if lora_name in group]


class WorkerClient:
    def __init__(
        self, http: httpx.AsyncClient, *, load_timeout_s: float, probe_timeout_s: float
    ) -> None:
        self.http = http
        self.load_timeout_s = load_timeout_s
        self.probe_timeout_s = probe_timeout_s

    async def _update(self, worker: str, url: str, body: dict[str, Any]) -> UpdateResult:
        try:
            response = await self.http.post(url, json=body, timeout=self.load_timeout_s)
        except NO_ANSWER as exc:
            return UpdateResult(
                False, f"worker {worker}: {type(exc).__name__}: {exc or 'no answer'}"
            )
        try:
            payload = response.json()
        except ValueError:
            return UpdateResult(
                False, f"worker {worker}: HTTP {response.status_code}: {response.text[:200]}"
            )
        if isinstance(payload, Mapping) and "success" not in payload:  # an error body, not a result
            error = payload.get("error")
            detail = error.get("message") if isinstance(error, Mapping) else payload.get("detail")
            return UpdateResult(
                False, f"worker {worker}: HTTP {response.status_code}: {detail or payload}"
            )
        result = UpdateResult.from_json(payload, origin=f"worker {worker}")
        if response.status_code >= 400 and result.success:
            return UpdateResult(
                False, f"worker {worker}: HTTP {response.status_code}", result.loaded_adapters
            )
        return result

    async def load(
        self,
        worker: str,
        endpoint: str,
        lora_name: str,
        lora_path: str,
        pinned: bool,
        evict: Sequence[str] = (),
    ) -> UpdateResult:
        """Load an adapter; ``evict``: adapters the worker unloads to make room once it has
        read the new one (a load that fails there evicts none)."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        if evict:
            body["evict"] = list(evict)
        return await self._update(worker, f"{endpoint}/load_lora_adapter", body)

    async def unload(self, worker: str, endpoint: str, lora_name: str) -> UpdateResult:
        return await self._update(
            worker, f"{endpoint}/unload_lora_adapter", {"lora_name": lora_name}
        )

    async def _get_json(self, worker: str, url: str) -> Any:
        try:
            response = await self.http.get(url, timeout=self.probe_timeout_s)
        except NO_ANSWER as exc:
            raise WorkerUnreachable(
                f"worker {worker}: {type(exc).__name__}: {exc or 'no answer'}"
            ) from exc
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise WorkerUnreachable(
                f"worker {worker}: GET {url} answered HTTP {response.status_code}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise WorkerUnreachable(f"worker {worker}: GET {url} answered non-JSON") from exc

    async def health(self, worker: str, endpoint: str) -> None:
        try:
            response = await self.http.get(f"{endpoint}/health", timeout=self.probe_timeout_s)
        except NO_ANSWER as exc:
            raise WorkerUnreachable(
                f"worker {worker}: {type(exc).__name__}: {exc or 'no answer'}"
            ) from exc
        if response.status_code != 200:
            raise WorkerUnreachable(
                f"worker {worker}: /health answered HTTP {response.status_code}"
            )

    async def observe(self, worker: str, endpoint: str, dp_size: int) -> Observation:
        """Read /v1/models and /lora_state; raises WorkerUnreachable."""
        models = await self._get_json(worker, f"{endpoint}/v1/models")
        if not isinstance(models, Mapping) or not isinstance(models.get("data"), list):
            raise WorkerUnreachable(f"worker {worker}: /v1/models answered no model list")
        served: str | None = None
        adapters: set[str] = set()
        pinned: set[str] = set()
        for entry in models["data"]:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
                continue
            if entry.get("parent") is None:
                served = served or entry["id"]
            else:
                adapters.add(entry["id"])
                if entry.get("pinned"):
                    pinned.add(entry["id"])
        state = await self._get_json(worker, f"{endpoint}/lora_state")
        groups: tuple[frozenset[str], ...]
        inconsistent: frozenset[str] = frozenset()
        group_list = None
        if isinstance(state, Mapping):
            group_list = state.get("dp_groups", state.get("groups"))
        if isinstance(state, Mapping) and isinstance(group_list, list):
            by_group = {
                int(g.get("dp_group", i)): frozenset(str(a) for a in g.get("adapters") or [])
                for i, g in enumerate(group_list)
                if isinstance(g, Mapping)
            }
            size = max(dp_size, len(by_group))
            groups = tuple(by_group.get(i, frozenset()) for i in range(size))
            inconsistent = frozenset(str(a) for a in state.get("inconsistent") or [])
        else:
            groups = tuple(frozenset(adapters) for _ in range(dp_size))
        return Observation(
            served, frozenset(adapters), groups, inconsistent, state, frozenset(pinned)
        )

    async def stream(
        self, worker: str, endpoint: str, path: str, body: dict[str, Any], timeout_s: float
    ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Open a proxied request; the caller must close the response."""
        # connecting is quick or the worker is gone; answering may take as long as generating
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self.probe_timeout_s))
        request = self.http.build_request("POST", f"{endpoint}{path}", json=body, timeout=timeout)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise WorkerUnreachable(f"worker {worker}: ConnectTimeout: {exc}") from exc
            raise WorkerTimeout(
                f"worker {worker} did not answer within {timeout_s:g} s "
                f"({type(exc).__name__}); raise router.request_timeout_s or ask for fewer tokens"
            ) from exc
        except NO_ANSWER as exc:
            raise WorkerUnreachable(
                f"worker {worker}: {type(exc).__name__}: {exc or 'no answer'}"
            ) from exc
        return response, response.aiter_raw()


def elapsed_since(start: float) -> float:
    return round(time.perf_counter() - start, 6)
