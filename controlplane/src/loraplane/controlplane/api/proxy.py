"""The router's request path: ``POST /v1/completions`` and ``/v1/chat/completions`` as one raw
ASGI handler that ``app.ControlPlaneApp`` serves ahead of FastAPI's middleware, routing and
dependency solving (the routes declared in ``api/openai.py`` list these paths in the OpenAPI
schema and hand a request they receive to the same handler).

What a client sees is the FastAPI app's: the same authentication (``deps.authenticate``,
``deps.check_scope``), the request-body limit (``BodyLimit``, applied by the app), and every
error answered by the app's own exception handlers, so error bodies and statuses are one code.

Per request the handler reads the body, resolves the route (``openai.resolve``: from memory,
else the database off the loop), opens the worker's request (``upstream.Upstream``) and answers. One task
per request watches for the client leaving (``_Watch``): from the worker request's start to the
end of the answer, a hang-up cancels the request's task, so the worker's request is closed and
the request stops counting on the worker, whatever the handler was waiting on. A stream is
relayed as the worker sends it, each upstream read one ``send``, with ``model`` put back as the
client named it on the bytes of each event when that is the same edit as through JSON
(``ModelSwap``); the read that brings the worker's end closes the answer in the same send.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from loraplane.controlplane.api.openai import (
    NamespaceHeader,
    Route,
    check_finite,
    mark_lost,
    mark_unreachable,
    pick_namespace,
    resolve,
    rewrite_model,
)
from loraplane.controlplane.auth import Principal
from loraplane.controlplane.deps import RouteCaller, ServicesDep, authenticate, check_scope
from loraplane.controlplane.errors import ApiError, bad_value
from loraplane.controlplane.services import Services
from loraplane.controlplane.upstream import Response as UpstreamResponse
from loraplane.controlplane.upstream import UpstreamError
from loraplane.controlplane.workers import WorkerTimeout, WorkerUnreachable
from loraplane.rules.text import not_text

router = APIRouter(tags=["router"])
PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Starlette's headers for an event stream, as StreamingResponse would send them
_SSE_HEADERS = StreamingResponse(iter(()), media_type="text/event-stream").raw_headers


def route_path(scope: Scope) -> str:
    """The path the app routes on (without the ASGI ``root_path``, as Starlette strips it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


class InferenceRoutes:
    """The raw ASGI handler of ``PATHS`` for ``app``, whose state holds the services and whose
    exception handlers answer every error."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = _Exchange(scope, receive, send)
        try:
            await _serve(self.app.state.services, exchange, route_path(scope))
        except Exception as exc:
            if exchange.started:
                raise
            response = await self._error_response(scope, receive, exc)
            if response is None:  # as Starlette's ServerErrorMiddleware answers it
                await PlainTextResponse("Internal Server Error", status_code=500)(
                    scope, receive, send
                )
                raise
            await response(scope, receive, send)

    async def _error_response(self, scope: Scope, receive: Receive, exc: Exception) -> Any:
        """The app's handler's answer to ``exc`` (its nearest class with a handler), or None."""
        for kind in type(exc).__mro__:
            handler = self.app.exception_handlers.get(kind)
            if handler is not None:
                response = handler(Request(scope, receive), exc)
                return await response if inspect.isawaitable(response) else response
        return None


class _Exchange:
    """One request's ASGI callables and whether its answer has started."""

    __slots__ = ("receive", "scope", "send", "started", "watch")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.started = False
        self.watch: _Watch | None = None

    async def answer(self, response: Response) -> None:
        self.started = True
        await response(self.scope, self.receive, self.send)


class _Watch:
    """Whether the client is gone, from the message after its body. While ``armed``, a
    hang-up cancels the request's task (``cancelled_it``), which then uncancels itself."""

    __slots__ = ("_handler", "armed", "cancelled_it", "gone", "task")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.armed = False
        self.cancelled_it = False
        self._handler = asyncio.current_task()
        self.task = asyncio.ensure_future(self._wait(receive))

    async def _wait(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self.armed and self._handler is not None:
            self.cancelled_it = True
            self._handler.cancel()

    def close(self) -> None:
        """Disarm; the task ends by itself once the answer is sent (ASGI's receive says
        ``http.disconnect`` then), without a cancellation, whose traceback would hold this
        request's objects in a reference cycle until the collector's next full pass."""
        self.armed = False

    def absorb(self) -> bool:
        """After a ``CancelledError``: True (and the task uncancelled) if the hang-up sent it."""
        if not self.cancelled_it:
            return False
        self.cancelled_it = False
        if self._handler is not None:
            self._handler.uncancel()
        return True


@dataclass(slots=True)
class _Counted:
    """Whether a request was counted in ``routed_requests`` (a worker answered or was tried)."""

    routed: bool = False


async def _serve(services: Services, exchange: _Exchange, path: str) -> None:
    authorization, namespace_header = _headers(exchange.scope)
    principal = check_scope(await authenticate(services, authorization), "route")
    body = await _read_body(exchange.receive)
    if body is None:  # the client left while sending it
        return
    counted = _Counted()
    try:
        await _proxy(services, exchange, path, principal, namespace_header, body, counted)
    except ApiError as exc:  # an error answered before any worker is counted by its code
        if not counted.routed:
            services.metrics.router_rejected.labels(exc.code).inc()
        raise
    finally:
        if exchange.watch is not None:
            exchange.watch.close()


def _headers(scope: Scope) -> tuple[str | None, str | None]:
    """The first ``Authorization`` and ``X-Loraplane-Namespace`` headers, as FastAPI reads them."""
    authorization = namespace = None
    for name, value in scope["headers"]:
        if name == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif name == b"x-loraplane-namespace" and namespace is None:
            namespace = value.decode("latin-1")
    return authorization, namespace


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(raw: bytes) -> tuple[dict[str, Any], str]:
    """The request's JSON object and its ``model``; refused by field otherwise."""
    try:
        body = json.loads(raw)
        check_finite(body, "body")
    except RecursionError as exc:
        raise bad_value("body", "JSON nested too deeply") from exc
    except ValueError as exc:
        raise bad_value("body", f"not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(body, dict):
        raise bad_value("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_value("body.model", "required: '<pool>:<adapter>', '<adapter>' or a pool name")
    if (reason := not_text(model)) is not None:
        raise bad_value("body.model", reason)
    if body.get("lora_path") is not None:  # the worker would prefer it to the routed adapter
        raise bad_value(
            "body.lora_path", "not accepted by the router: name the adapter in body.model"
        )
    return body, model


async def _proxy(
    services: Services,
    exchange: _Exchange,
    path: str,
    principal: Principal,
    namespace_header: str | None,
    raw: bytes,
    counted: _Counted,
) -> None:
    body, model = _parse(raw)
    namespace = pick_namespace(principal, namespace_header)
    route = await resolve(services, principal, namespace, model)
    stream = bool(body.get("stream"))
    watch = exchange.watch = _Watch(exchange.receive)
    routed = services.metrics.routed_requests
    for attempt in range(2):
        forwarded = {**body, "model": route.model}
        lease = _Lease(services, route)
        response = None
        watch.armed = True
        try:
            if watch.gone:  # the client left before the worker was asked
                raise asyncio.CancelledError
            response = await services.upstream.open(
                route.worker.name,
                route.worker.endpoint,
                path,
                forwarded,
                services.settings.router.request_timeout_s,
            )
            watch.armed = False
        except WorkerTimeout as exc:  # busy, not gone: the worker stays routable
            watch.armed = False
            lease.release()
            routed.labels(namespace, route.adapter_name, "504").inc()
            counted.routed = True
            raise ApiError(504, "upstream_timeout", str(exc)) from exc
        except WorkerUnreachable as exc:
            watch.armed = False
            lease.release()
            services.reconciler.poke()
            if attempt == 0:
                await asyncio.to_thread(mark_unreachable, services, route.worker.id, str(exc))
                services.routes.invalidate()
                route = await resolve(services, principal, namespace, model)
                continue
            routed.labels(namespace, route.adapter_name, "503").inc()
            counted.routed = True
            raise ApiError(503, "no_worker", str(exc)) from exc
        except asyncio.CancelledError:
            watch.armed = False
            lease.release()
            if not (watch.absorb() or watch.gone):
                raise
            # the client left before the worker answered: the worker's request is closed
            routed.labels(namespace, route.adapter_name, "499").inc()
            counted.routed = True
            await exchange.answer(Response(status_code=499))
            return
        except BaseException:  # whatever failed, this request no longer counts on the worker
            watch.armed = False
            lease.release()
            raise
        if response.status == 404 and route.lora_name is not None and attempt == 0:
            # the worker lost the adapter (it restarted): say so, let the reconciler repair,
            # and retry from the database, not from the route table
            response.close()
            lease.release()
            await asyncio.to_thread(mark_lost, services, route)
            services.routes.invalidate()
            services.reconciler.poke()
            route = await resolve(services, principal, namespace, model)
            continue
        if route.adapter_id is not None:
            services.usage.touch(route.adapter_id)
        routed.labels(namespace, route.adapter_name, str(response.status)).inc()
        counted.routed = True
        if stream and response.status == 200:
            swap = ModelSwap.of(route, model)
            await _relay(services, exchange, watch, response, route, swap, lease)
        else:
            await _answer_whole(exchange, watch, response, route, model, lease)
        return
    raise AssertionError("unreachable")


async def _answer_whole(
    exchange: _Exchange,
    watch: _Watch,
    response: UpstreamResponse,
    route: Route,
    model: str,
    lease: _Lease,
) -> None:
    """A worker's answer that is not a stream, read whole and passed on."""
    watch.armed = True
    try:
        content = await response.read()
    except (UpstreamError, TimeoutError) as exc:
        response.close()
        raise ApiError(
            502, "upstream_error", f"worker {route.worker.name} stopped answering: {exc!r}"
        ) from exc
    except asyncio.CancelledError:
        response.close()
        if watch.absorb():
            return
        raise
    finally:
        watch.armed = False
        response.release()
        lease.release()
    media = response.headers.get("content-type", "application/json")
    if response.status == 200:
        content = rewrite_model(content, model)
    await exchange.answer(Response(content, status_code=response.status, media_type=media))


async def _relay(
    services: Services,
    exchange: _Exchange,
    watch: _Watch,
    response: UpstreamResponse,
    route: Route,
    swap: ModelSwap,
    lease: _Lease,
) -> None:
    """The worker's stream passed on as it arrives; it always ends with the worker's response
    closed (or kept for the next request, read to the end) and the request no longer counted
    on the worker: read to the end, the client leaving, the worker failing, or shutdown. A
    worker that goes away mid-stream ends it with an error event (not a stream that just stops,
    which reads as complete)."""
    send = exchange.send
    exchange.started = True
    pending = b""  # a line not yet ended by its newline
    watch.armed = True
    try:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        while True:
            try:
                chunk = await response.readany()
            except (UpstreamError, TimeoutError) as exc:
                services.reconciler.poke()
                await send(_last(_error_event(route, exc)))
                return
            if not chunk:  # the worker's end, after a read that did not show it
                await send(_last(swap.lines(pending + b"\n") if pending else b""))
                return
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            end = response.at_eof()
            if end:
                out = swap.lines(data[:cut] + pending + b"\n" if pending else data)
                await send(_last(out))
                return
            if cut:
                out = swap.lines(data[:cut])
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except asyncio.CancelledError:
        if not watch.absorb():
            raise
    except OSError:  # the client went away mid-send
        pass
    finally:
        watch.armed = False
        if response.at_eof():  # a connection read to the end is kept for the next request
            response.release()
        else:
            response.close()
        lease.release()


def _last(body: bytes) -> Message:
    return {"type": "http.response.body", "body": body, "more_body": False}


def _error_event(route: Route, exc: BaseException) -> bytes:
    error = {
        "error": {
            "message": f"worker {route.worker.name} stopped mid-stream: "
            f"{type(exc).__name__}: {exc}",
            "type": "upstream_error",
            "code": 502,
        }
    }
    return f"data: {json.dumps(error)}\n\n".encode()


@dataclass(frozen=True, slots=True)
class ModelSwap:
    """Puts ``model`` back as the client named it in each ``data:`` event of a stream.

    An event's top-level ``"model"`` holding what the worker was sent is replaced on the bytes
    when that is certainly the edit JSON would make: the key appears once, not after a
    backslash, and before it the payload opens no object but its own. Any other
    event (the worker wrote the key differently, or nested) goes through JSON."""

    model: str  # as the client named it
    needles: tuple[tuple[bytes, bytes], ...]  # (as the worker writes it, what replaces it)

    @classmethod
    def of(cls, route: Route, model: str) -> ModelSwap:
        sent, named = json.dumps(route.model).encode(), json.dumps(model).encode()
        return cls(
            model,
            (
                (b'"model":' + sent, b'"model":' + named),
                (b'"model": ' + sent, b'"model": ' + named),
            ),
        )

    def lines(self, block: bytes) -> bytes:
        """``block``: whole lines, each ended by its newline."""
        if b"data: " not in block:
            return block
        lines = block.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                lines[index] = b"data: " + self.payload(line[6:])
        return b"\n".join(lines)

    def payload(self, payload: bytes) -> bytes:
        if payload[:1] == b"{" and payload.count(b'"model"') == 1:
            for needle, replacement in self.needles:
                at = payload.find(needle)
                if (
                    at > 0
                    and payload[at - 1] != 0x5C  # a backslash
                    and payload.find(b"{", 1, at) < 0  # nor inside an array: its object opens
                ):
                    return payload[:at] + replacement + payload[at + len(needle) :]
        return rewrite_model(payload, self.model)


class _Lease:
    """One request counted on its worker (``Inflight``) until ``release``; releasing twice is
    harmless, so every path out of a request can release."""

    __slots__ = ("inflight", "released", "route")

    def __init__(self, services: Services, route: Route) -> None:
        self.inflight = services.inflight
        self.route = route
        self.released = False
        self.inflight.add(route.worker.id, route.lora_name, 1)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inflight.add(self.route.worker.id, self.route.lora_name, -1)


class _Handed(Response):
    """A request FastAPI routed here, handed to ``InferenceRoutes``, which answers it itself."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await InferenceRoutes(scope["app"])(scope, receive, send)


async def _declared(
    request: Request,
    principal: RouteCaller,
    services: ServicesDep,
    namespace: NamespaceHeader = None,
) -> Response:
    return _Handed()


# The two routes as the OpenAPI schema lists them (a token with the route scope, the namespace
# header). ``app.ControlPlaneApp`` serves their paths ahead of FastAPI; this router mounted
# elsewhere answers through the same handler.
for _path, _name in (
    ("/v1/completions", "completions"),
    ("/v1/chat/completions", "chat_completions"),
):
    router.add_api_route(_path, _declared, methods=["POST"], name=_name)
