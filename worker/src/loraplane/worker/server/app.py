"""The worker's FastAPI app: SGLang-named endpoints over one engine (an `EngineClient`)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplane.worker.engine.engine import UnknownAdapterError
from loraplane.worker.engine.logprobs import TokenLogprob
from loraplane.worker.engine.merge import LoRAUpdateResult
from loraplane.worker.engine.sampling import SamplingError, SamplingParams
from loraplane.worker.engine.sequence import UNKNOWN_ADAPTER, SeqEvent
from loraplane.worker.engine.tokenizer import TextTokenizer, TokenizerError
from loraplane.worker.server import guards
from loraplane.worker.server import protocol as p
from loraplane.worker.server.engine_client import EngineClient
from loraplane.worker.server.faults import FaultInjector
from loraplane.worker.server.logprobs import LogprobText

if TYPE_CHECKING:
    from loraplane.worker.server.engine_process import CoreFaults
from loraplane.worker.server.metrics import WorkerMetrics


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": p.ErrorResponse, "description": "bad request (the message names the field)"},
    404: {"model": p.ErrorResponse, "description": "unknown adapter or model"},
}


@functools.cache
def _longest_token(tokenizer: TextTokenizer) -> int:
    return max((len(token) for token in tokenizer.tokenizer.get_vocab()), default=1)


def prompt_char_limit(tokenizer: TextTokenizer, max_model_len: int) -> int:
    """Characters a prompt of `max_model_len` tokens can hold at most (every token its longest)."""
    return max_model_len * max(1, _longest_token(tokenizer))


def _allowed(path: str, roots: tuple[str, ...]) -> bool:
    if not roots:
        return True
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(Path(r).resolve()) for r in roots)


class LoopPoster:
    """Hands requests' events from the engine client's thread to the event loop.

    ``loop.call_soon_threadsafe`` wakes the loop through its self-pipe: once per token of
    every running request (thousands a second) that is a system call and a loop iteration
    each. Here the first event of a burst schedules one wake-up, which delivers every event
    that arrived before it ran: about one a step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[SeqEvent], SeqEvent]] = []

    def post(self, queue: asyncio.Queue[SeqEvent], event: SeqEvent) -> None:
        with self._lock:
            self._pending.append((queue, event))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


@dataclass(frozen=True, slots=True)
class Collected:
    """A request's whole answer: its text, token ids, last event and logprobs (if asked)."""

    text: str
    ids: list[int]
    last: SeqEvent
    logprobs: list[TokenLogprob]
    prompt_logprobs: tuple[TokenLogprob, ...]


def _failed(event: SeqEvent) -> ApiError:
    """The answer to a request the engine ended with an error (before a streamed answer
    starts; after, the stream breaks off)."""
    if event.error_kind == UNKNOWN_ADAPTER:  # (unloaded after the front end routed it)
        return ApiError(404, event.error or "unknown adapter", "model", "not_found")
    return ApiError(500, event.error or "engine error", None, "server_error")


class WorkerServer:
    """Request handling that does not depend on FastAPI routing (kept testable)."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        served_model: str,
        model_root: str,
        allowed_lora_roots: tuple[str, ...],
        metrics: WorkerMetrics,
        faults: FaultInjector | CoreFaults | None,
        max_body_bytes: int = guards.DEFAULT_MAX_BODY_BYTES,
        admin_token: str | None = None,
    ) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.admin_token = admin_token
        self.served_model = served_model
        self.model_root = model_root
        self.allowed_lora_roots = allowed_lora_roots
        self.metrics = metrics
        self.faults = faults
        self.created = int(time.time())
        self._poster: LoopPoster | None = None

        self.logprob_text = LogprobText(engine.tokenizer.decode)

    # --- adapters ------------------------------------------------------------------------

    def adapter_for(self, model: str | None, lora_path: str | None) -> str | None:
        """The adapter a request names, None for the base model. ``lora_path`` (SGLang's
        field) and ``model`` may both be given when ``model`` names the base model or the
        same adapter; naming two adapters is refused."""
        if lora_path:
            self._check_adapter(lora_path, "lora_path")
            named = self._adapter_of_model(model)
            if named is not None and named != lora_path:
                raise ApiError(
                    400,
                    f"lora_path: {guards.excerpt(lora_path)} and model {guards.excerpt(model or '')}"
                    " name different adapters; give the adapter in one of them",
                    "lora_path",
                )
            return lora_path
        return self._adapter_of_model(model)

    def response_model(self, model: str | None, adapter: str | None) -> str:
        """The ``model`` an answer names: the request's when it names what ran, else the
        adapter ``lora_path`` chose (``adapter_for`` has checked both already)."""
        if model and (adapter is None or self._named_adapter(model) == adapter):
            return model
        return adapter if adapter is not None else self.served_model

    def _adapter_of_model(self, model: str | None) -> str | None:
        """The adapter ``model`` names, checked to be loaded; None for the base model."""
        name = self._named_adapter(model)
        if name is not None:
            self._check_adapter(name, "model")
        return name

    def _named_adapter(self, model: str | None) -> str | None:
        """The adapter name in ``model`` (``<adapter>`` or ``<base>:<adapter>``), None for the
        base model; a 404 for another base model."""
        if not model or model == self.served_model:
            return None
        base, sep, rest = model.partition(":")
        if not sep:
            return model
        if base != self.served_model:
            raise ApiError(
                404,
                f"model: {guards.excerpt(model)} names base {guards.excerpt(base)}, "
                f"but this worker serves {self.served_model!r}",
                "model",
                "not_found",
            )
        return rest

    def _check_adapter(self, name: str, field: str) -> None:
        if len(name) > guards.QUOTE_CHARS:  # longer than any adapter name: not quoted whole
            raise ApiError(
                404, f"{field}: no adapter is named {guards.excerpt(name)}", field, "not_found"
            )
        try:
            self.engine.resolve_adapter(name)
        except UnknownAdapterError as exc:
            raise ApiError(404, f"{field}: {exc.args[0]}", field, "not_found") from exc

    async def load(self, body: p.LoadLoRAAdapterRequest) -> JSONResponse:
        message: str | None = None
        if body.lora_name == self.served_model:
            # `model=<name>` routes to the base model, so such an adapter could never be reached
            message = f"lora_name: {body.lora_name!r} is the name of the served base model; choose another adapter name"
        elif not _allowed(body.lora_path, self.allowed_lora_roots):
            message = f"lora_path: {guards.excerpt(body.lora_path)} is outside the allowed adapter roots {list(self.allowed_lora_roots)}"
        if message is not None:
            return self._update_response(
                LoRAUpdateResult(False, message, self._first_group_adapters())
            )
        result = await asyncio.wrap_future(
            self.engine.load_adapter(body.lora_name, body.lora_path, body.pinned, body.evict)
        )
        return self._update_response(result)

    async def unload(self, body: p.UnloadLoRAAdapterRequest) -> JSONResponse:
        result = await asyncio.wrap_future(self.engine.unload_adapter(body.lora_name))
        return self._update_response(result)

    def _first_group_adapters(self) -> dict[str, str]:
        return dict(self.engine.group_adapters[0])

    @staticmethod
    def _update_response(result: LoRAUpdateResult) -> JSONResponse:
        body = p.LoRAUpdateResponse(
            success=result.success,
            error_message=result.error_message,
            loaded_adapters=result.loaded_adapters,
        )
        return JSONResponse(body.model_dump(), status_code=200 if result.success else 400)

    # --- generation ----------------------------------------------------------------------

    def sampling(
        self,
        req: p._Sampling,
        max_new_tokens: int | None,
        field: str,
        *,
        prefix: str = "",
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        prompt_logprobs_start: int = 0,
    ) -> SamplingParams:
        """The engine's parameters of a request; ``logprobs`` and ``prompt_logprobs``: the
        alternatives per token of its output's and its prompt's logprobs (None: none).
        ``field``: the request's length field; ``prefix``: where its sampling fields are
        (``sampling_params.`` in /generate)."""
        stop = req.stop if isinstance(req.stop, list) else ([] if req.stop is None else [req.stop])
        if any(not s for s in stop):
            raise ApiError(
                400,
                f"{prefix}stop: an empty stop string would end every completion at its first "
                "token; leave it out",
                f"{prefix}stop",
            )
        vocab = self.engine.vocab_size
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise ApiError(
                400,
                f"{prefix}stop_token_ids: {bad[:5]} are outside the vocabulary 0..{vocab - 1}",
                f"{prefix}stop_token_ids",
            )
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens
                if max_new_tokens is not None
                else self.engine.max_model_len,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k,  # type: ignore[arg-type]
                seed=req.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                prompt_logprobs_start=prompt_logprobs_start,
            )
        except SamplingError as exc:  # (its message starts with the field it refuses)
            named = str(exc).split(" ", 1)[0]
            raise ApiError(
                400, str(exc), f"{prefix}{named}" if named in type(req).model_fields else field
            ) from exc

    async def prompt_ids(self, text: str | None, ids: list[int] | None, field: str) -> list[int]:
        if ids is not None:
            vocab = self.engine.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(
                    400,
                    f"{field}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}",
                    field,
                )
            prompt = list(ids)
        elif text is not None:
            self.check_chars(len(text), field)
            prompt = await asyncio.to_thread(self.engine.tokenizer.encode, text)
        else:
            raise ApiError(400, f"{field}: give a text prompt or token ids", field)
        return self._check_length(prompt, field)

    def check_chars(self, chars: int, field: str) -> None:
        """Refuse, before tokenizing, a prompt of more characters than `max_model_len` tokens of
        this tokenizer's longest token hold: it cannot fit, and tokenizing it costs seconds."""
        limit = prompt_char_limit(self.engine.tokenizer, self.engine.max_model_len)
        if chars > limit:
            raise ApiError(
                400,
                f"{field}: the prompt has {chars} characters; this worker's max_model_len is "
                f"{self.engine.max_model_len} tokens, which hold at most {limit} characters",
                field,
            )

    def _check_length(self, prompt: list[int], field: str) -> list[int]:
        if not prompt:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        limit = self.engine.max_model_len
        if len(prompt) >= limit:
            raise ApiError(
                400,
                f"{field}: the prompt has {len(prompt)} tokens; this worker's max_model_len is {limit}",
                field,
            )
        return prompt

    def _check_kv_fits(self, prompt: int, max_new_tokens: int) -> None:
        """Refuse a request whose KV positions (prompt and max_tokens, cut at max_model_len)
        exceed the whole KV pool of a DP group: it could never run (ADR 0015)."""
        need = min(prompt + max_new_tokens, self.engine.max_model_len)
        pool = self.engine.kv_pool_tokens
        if need > pool:
            raise ApiError(
                400,
                f"max_tokens: the request needs {need} KV positions (a {prompt}-token prompt "
                f"and max_tokens {max_new_tokens}); this worker's KV pool holds {pool}: "
                f"lower max_tokens to at most {pool - prompt}",
                "max_tokens",
            )

    def start(
        self, prompt: list[int], params: SamplingParams, adapter: str | None, rid: str
    ) -> tuple[object, asyncio.Queue[SeqEvent]]:
        loop = asyncio.get_running_loop()
        if self._poster is None or self._poster.loop is not loop:
            self._poster = LoopPoster(loop)
        post = self._poster.post
        queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

        def sink(event: SeqEvent) -> None:
            post(queue, event)

        if not self.engine.alive:
            raise ApiError(503, "the engine is not running", None, "server_error")
        self._check_kv_fits(len(prompt), params.max_new_tokens)
        try:
            seq = self.engine.submit(rid, prompt, params, adapter, sink)
        except UnknownAdapterError as exc:
            raise ApiError(404, str(exc), "model", "not_found") from exc
        return seq, queue

    async def events(self, seq: object, queue: asyncio.Queue[SeqEvent]) -> AsyncIterator[SeqEvent]:
        """The request's events until its end. Events that queued up while the stream was
        being written come as one (their text and tokens joined), so a front end that falls
        behind the engine writes fewer, larger chunks instead of falling further behind."""
        finished = False
        try:
            while not finished:
                event = await queue.get()
                while not (event.finished or event.error) and not queue.empty():
                    event = event.merged(queue.get_nowait())
                if event.error:
                    raise _failed(event)
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.engine.abort(seq)

    async def collect(self, seq: object, queue: asyncio.Queue[SeqEvent]) -> Collected:
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: tuple[TokenLogprob, ...] = ()
        last: SeqEvent | None = None
        async for event in self.events(seq, queue):
            text.append(event.text_delta)
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            prompt_logprobs = event.prompt_logprobs or prompt_logprobs
            last = event
        assert last is not None
        return Collected("".join(text), ids, last, logprobs, prompt_logprobs)


def refuse_unsupported(body: p._Refusing, prefix: str = "") -> None:
    """400 naming a field this worker does not implement, when it asks for something."""
    found = body.unsupported()
    if found is None:
        return
    field, value = found
    neutral = " or ".join(repr(n) for n in body.NEUTRAL[field]) or "null"
    shown = json.dumps(value, default=str)
    if len(shown) > guards.QUOTE_CHARS:
        shown = f"{shown[: guards.QUOTE_CHARS]}… ({len(shown)} characters)"
    raise ApiError(
        400,
        f"{prefix}{field}: {shown} is not supported by this worker; leave it out or give {neutral}",
        prefix + field,
    )


def chat_messages(messages: list[p.ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template, each content one string (text parts joined by \\n)."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                field = f"messages.{i}.content.{j}"
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"{field}.type: {guards.excerpt(part.type)} parts are not supported; "
                        "give text parts ({'type': 'text', 'text': ...})",
                        f"{field}.type",
                    )
                if part.text is None:
                    raise ApiError(
                        400, f"{field}.text: a text part needs its text", f"{field}.text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        out.append({**message.model_dump(), "content": content})
    return out


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(event: SeqEvent) -> p.Usage:
    return p.Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
    )


def create_app(server: WorkerServer) -> FastAPI:
    app = FastAPI(
        title="loraplane worker",
        version="0.1.0",
        description="One model with many LoRA adapters; SGLang- and OpenAI-compatible endpoints.",
    )

    guards.install(app, max_body_bytes=server.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        body = guards.error_body(exc.status, exc.message, exc.param, exc.kind)
        return JSONResponse(body, status_code=exc.status)

    def streaming(gen: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
        return StreamingResponse(
            gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # --- generation ----------------------------------------------------------------------

    @app.post(
        "/generate",
        response_model=p.GenerateResponse,
        response_model_exclude_unset=True,
        responses=_ERRORS,
        tags=["generation"],
    )
    async def generate(body: p.GenerateRequest) -> Any:
        """SGLang native generation; `stream: true` answers SSE with the cumulative text.
        `return_logprob` adds the tokens' logprobs to `meta_info` as SGLang does."""
        refuse_unsupported(body)
        refuse_unsupported(body.sampling_params, "sampling_params.")
        if not body.return_logprob and body.top_logprobs_num:
            raise ApiError(
                400,
                f"top_logprobs_num: {body.top_logprobs_num} asks for log probabilities, which "
                "return_logprob: true turns on; set it, or leave top_logprobs_num out",
                "top_logprobs_num",
            )
        if body.text is not None and body.input_ids is not None:
            raise ApiError(400, "input_ids: give text or input_ids, not both", "input_ids")
        adapter = server.adapter_for(None, body.lora_path)
        prompt = await server.prompt_ids(
            body.text, body.input_ids, "text" if body.input_ids is None else "input_ids"
        )
        start = len(prompt) - 1 if body.logprob_start_len == -1 else body.logprob_start_len
        if body.return_logprob and start >= len(prompt):
            raise ApiError(
                400,
                f"logprob_start_len: {start} is past the prompt's last token (the prompt has "
                f"{len(prompt)} tokens); give 0..{len(prompt) - 1}, or -1 for the last",
                "logprob_start_len",
            )
        top = body.top_logprobs_num if body.return_logprob else None
        params = server.sampling(
            body.sampling_params,
            body.sampling_params.max_new_tokens,
            "sampling_params.max_new_tokens",
            prefix="sampling_params.",
            logprobs=top,
            prompt_logprobs=top,
            prompt_logprobs_start=start,
        )
        rid = body.rid or uuid.uuid4().hex
        seq, queue = server.start(prompt, params, adapter, rid)
        text_of = server.logprob_text
        with_text = body.return_text_in_logprobs

        def meta(
            event: SeqEvent,
            ids: list[int],
            logprobs: list[TokenLogprob],
            prompt_logprobs: tuple[TokenLogprob, ...],
        ) -> dict[str, Any]:
            finish = None
            if event.finished:
                finish = {"type": event.finish_reason, "matched": event.matched_stop}
            out: dict[str, Any] = {
                "id": rid,
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "finish_reason": finish,
            }
            if body.return_logprob:
                # (the prompt's first token has no logprob: None in its place)
                inputs = [None] * (start == 0) + list(prompt_logprobs)
                out["input_token_logprobs"] = text_of.triples(inputs, prompt[start:], with_text)
                out["output_token_logprobs"] = text_of.triples(logprobs, ids, with_text)
                if top:
                    out["input_top_logprobs"] = text_of.top_triples(inputs, with_text)
                    out["output_top_logprobs"] = text_of.top_triples(logprobs, with_text)
            return out

        if body.stream:

            async def gen() -> AsyncIterator[str]:
                text, ids = "", cast(list[int], [])
                logprobs: list[TokenLogprob] = []
                prompt_logprobs: tuple[TokenLogprob, ...] = ()
                async for event in server.events(seq, queue):
                    text += event.text_delta
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                    prompt_logprobs = event.prompt_logprobs or prompt_logprobs
                    info = meta(event, ids, logprobs, prompt_logprobs)
                    yield _sse({"text": text, "output_ids": ids, "meta_info": info})
                yield "data: [DONE]\n\n"

            return streaming(gen)
        got = await server.collect(seq, queue)
        info = meta(got.last, got.ids, got.logprobs, got.prompt_logprobs)
        return {"text": got.text, "output_ids": got.ids, "meta_info": info}

    @app.post(
        "/v1/completions", response_model=p.CompletionResponse, responses=_ERRORS, tags=["openai"]
    )
    async def completions(body: p.CompletionRequest) -> Any:
        """OpenAI completions; the adapter is `model: "<base>:<adapter>"`, `model: "<adapter>"` or `lora_path`.
        `logprobs: N` gives each token's logprob and its N likeliest alternatives; `echo` puts
        the prompt before the completion (with `logprobs`, its tokens' too: the first null),
        and with `max_tokens: 0` scores a prompt without generating."""
        refuse_unsupported(body)
        adapter = server.adapter_for(body.model, body.lora_path)
        if isinstance(body.prompt, str):
            prompt = await server.prompt_ids(body.prompt, None, "prompt")
        else:
            prompt = await server.prompt_ids(None, body.prompt, "prompt")
        want = body.logprobs
        params = server.sampling(
            body,
            16 if body.max_tokens is None else body.max_tokens,  # (OpenAI's default for null)
            "max_tokens",
            logprobs=want,
            prompt_logprobs=want if body.echo else None,
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        model = server.response_model(body.model, adapter)
        seq, queue = server.start(prompt, params, adapter, rid)
        created = int(time.time())
        echoed = ""
        if body.echo:
            echoed = (
                body.prompt
                if isinstance(body.prompt, str)
                else server.engine.tokenizer.decode(prompt)
            )

        def logprobs_of(
            ids: list[int],
            entries: list[TokenLogprob],
            prompt_entries: tuple[TokenLogprob, ...] | None,
            offset: int,
        ) -> dict[str, Any] | None:
            """`choices[].logprobs` of `ids` (after the prompt's when `prompt_entries`)."""
            if want is None:
                return None
            tokens: list[int] = []
            lps: list[TokenLogprob | None] = []
            if prompt_entries is not None:  # (the first prompt token has no logprob)
                tokens, lps = list(prompt), [None, *prompt_entries]
            return server.logprob_text.completion([*lps, *entries], [*tokens, *ids], offset)

        if body.stream:

            async def gen() -> AsyncIterator[str]:
                offset, first = 0, True
                async for event in server.events(seq, queue):
                    text, echo_entries = event.text_delta, None
                    if first and body.echo:
                        text, echo_entries = echoed + text, event.prompt_logprobs or ()
                    first = False
                    logprobs = logprobs_of(
                        list(event.token_ids), list(event.logprobs), echo_entries, offset
                    )
                    if logprobs is not None and logprobs["tokens"]:
                        offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if text or event.finished or (logprobs is not None and logprobs["tokens"]):
                        chunk: dict[str, Any] = {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [
                                {
                                    "index": 0,
                                    "text": text,
                                    "logprobs": logprobs,
                                    "finish_reason": event.finish_reason
                                    if event.finished
                                    else None,
                                }
                            ],
                        }
                        if event.finished:
                            chunk["usage"] = _usage(event).model_dump()
                        yield _sse(chunk)
                yield "data: [DONE]\n\n"

            return streaming(gen)
        got = await server.collect(seq, queue)
        echo_entries = got.prompt_logprobs if body.echo else None
        return p.CompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=[
                p.CompletionChoice(
                    text=echoed + got.text,
                    logprobs=logprobs_of(got.ids, got.logprobs, echo_entries, 0),  # type: ignore[arg-type]
                    finish_reason=cast(Any, got.last.finish_reason),
                    matched_stop=got.last.matched_stop,
                )
            ],  # type: ignore[arg-type]
            usage=_usage(got.last),
        )

    @app.post(
        "/v1/chat/completions",
        response_model=p.ChatCompletionResponse,
        responses=_ERRORS,
        tags=["openai"],
    )
    async def chat_completions(body: p.ChatCompletionRequest) -> Any:
        """OpenAI chat completions; the prompt is the model's chat template over `messages`
        (a message's content: a string or a list of text parts, joined with newlines).
        `logprobs: true` gives each token's logprob, with `top_logprobs` alternatives."""
        refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(
                400,
                f"top_logprobs: {body.top_logprobs} needs logprobs: true; set it, or leave "
                "top_logprobs out",
                "top_logprobs",
            )
        adapter = server.adapter_for(body.model, body.lora_path)
        messages = chat_messages(body.messages)
        server.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            prompt = await asyncio.to_thread(server.engine.tokenizer.apply_chat_template, messages)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        prompt = server._check_length(prompt, "messages")
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        want = (body.top_logprobs or 0) if body.logprobs else None
        params = server.sampling(body, max_tokens, "max_tokens", logprobs=want)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        model = server.response_model(body.model, adapter)
        seq, queue = server.start(prompt, params, adapter, rid)
        created = int(time.time())

        def logprobs_of(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> Any:
            if want is None:
                return None
            return {"content": server.logprob_text.chat(entries)}

        if body.stream:

            async def gen() -> AsyncIterator[str]:
                base = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                }
                yield _sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    }
                )
                async for event in server.events(seq, queue):
                    with_logprobs = want is not None and bool(event.logprobs)
                    if event.text_delta or event.finished or with_logprobs:
                        chunk: dict[str, Any] = {
                            **base,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"content": event.text_delta}
                                    if event.text_delta
                                    else {},
                                    "logprobs": logprobs_of(event.logprobs)
                                    if with_logprobs
                                    else None,
                                    "finish_reason": event.finish_reason
                                    if event.finished
                                    else None,
                                }
                            ],
                        }
                        if event.finished:
                            chunk["usage"] = _usage(event).model_dump()
                        yield _sse(chunk)
                yield "data: [DONE]\n\n"

            return streaming(gen)
        got = await server.collect(seq, queue)
        return p.ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=[
                p.ChatChoice(
                    message=p.ChatResponseMessage(content=got.text),
                    logprobs=logprobs_of(got.logprobs),
                    finish_reason=got.last.finish_reason,  # type: ignore[arg-type]
                    matched_stop=got.last.matched_stop,
                )
            ],
            usage=_usage(got.last),
        )

    # --- adapters ------------------------------------------------------------------------

    admin = [Depends(guards.admin_dependency(server.admin_token))]
    unauthorized: dict[int | str, dict[str, Any]] = {
        401: {"model": p.ErrorResponse, "description": "the admin token is missing or wrong"}
    }
    update_responses: dict[int | str, dict[str, Any]] = {
        400: {
            "model": p.LoRAUpdateResponse,
            "description": "failed (merged fail-first over DP groups)",
        },
        **unauthorized,
    }

    @app.post(
        "/load_lora_adapter",
        response_model=p.LoRAUpdateResponse,
        responses=update_responses,
        tags=["adapters"],
        dependencies=admin,
    )
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest) -> Any:
        """Load (or replace with a new version) an adapter on every DP group; fail-first merge."""
        return await server.load(body)

    @app.post(
        "/unload_lora_adapter",
        response_model=p.LoRAUpdateResponse,
        responses=update_responses,
        tags=["adapters"],
        dependencies=admin,
    )
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest) -> Any:
        """Unload an adapter from every DP group; a partial failure leaves it inconsistent."""
        return await server.unload(body)

    @app.get(
        "/v1/models/{model:path}", response_model=p.ModelCard, responses=_ERRORS, tags=["openai"]
    )
    async def model_card(model: str) -> p.ModelCard:
        """One entry of `/v1/models` (the base model, or an adapter by its name)."""
        for card in (await models()).data:
            if card.id == model:
                return card
        raise ApiError(
            404, f"model: no model or adapter is named {guards.excerpt(model)}", "model",
            "not_found",
        )  # fmt: skip

    @app.get("/v1/models", response_model=p.ModelList, tags=["openai"])
    async def models() -> p.ModelList:
        cards = [
            p.ModelCard(
                id=server.served_model,
                created=server.created,
                root=server.model_root,
                max_model_len=server.engine.max_model_len,
            )
        ]
        for a in server.engine.listed_adapters():
            cards.append(
                p.ModelCard(
                    id=a["name"],
                    created=server.created,
                    root=a["path"],
                    parent=server.served_model,
                    pinned=a["pinned"],
                    inconsistent=a["inconsistent"],
                )
            )
        return p.ModelList(data=cards)

    @app.get(
        "/lora_state",
        response_model=p.LoRAStateResponse,
        responses=unauthorized,
        tags=["adapters"],
        dependencies=admin,
    )
    async def lora_state() -> Any:
        """Slots, pins, LRU order and per-DP-group adapters of this worker."""
        # (a round trip to the engine core: off the event loop)
        return await asyncio.to_thread(server.engine.lora_state)

    @app.get(
        "/health",
        response_model=p.HealthResponse,
        responses={503: {"model": p.ErrorResponse}},
        tags=["ops"],
    )
    async def health() -> Any:
        if not server.engine.alive:
            raise ApiError(
                503, f"the engine is not running: {server.engine.error}", None, "server_error"
            )
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
        )

    if server.faults is not None:
        faults = server.faults

        @app.post(
            "/debug/fault",
            response_model=p.FaultResponse,
            responses={**_ERRORS, **unauthorized},
            tags=["debug"],
            dependencies=admin,
        )
        async def debug_fault(body: p.FaultRequest) -> Any:
            """Test only: make `dp_group` fail its next `count` loads or unloads with `message`."""
            try:
                faults.arm(body.op, body.dp_group, body.count, body.message)
            except ValueError as exc:
                raise ApiError(400, str(exc), "dp_group") from exc
            return {"armed": faults.snapshot()}

    return app
