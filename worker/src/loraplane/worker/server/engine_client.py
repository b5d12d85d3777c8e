"""What the HTTP front end (`WorkerServer`) asks of an engine, and the in-thread way to ask it.

Two implementations: `ProcessEngineClient` (server.engine_process; the default of
`worker serve`) runs the engine core in a process of its own; `InThreadEngineClient` wraps an
`Engine` whose step loop runs on a thread of this process (the probes, the tests that build an
Engine directly, `bench serve --in-process`, `worker serve --no-engine-process`). Both give a
request's sink `SeqEvent`s with text: the engine sends token ids and each request's
`TextStream` (engine.detokenizer) decodes them and matches its stop strings, aborting the
request in the engine when one matches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from loraplane.worker.engine.detokenizer import TextStream
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.merge import LoRAUpdateResult
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.engine.tokenizer import TextTokenizer

Sink = Callable[[SeqEvent], None]


class EngineClient(Protocol):
    """The engine as the front end sees it. ``submit`` raises UnknownAdapterError for an
    adapter that is not routable; a sink may be called on any thread."""

    tokenizer: TextTokenizer

    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def kv_pool_tokens(self) -> int:
        """KV positions of one DP group's pool: a request needing more is refused."""
        ...

    @property
    def alive(self) -> bool: ...
    @property
    def error(self) -> BaseException | str | None: ...
    @property
    def group_adapters(self) -> list[dict[str, str]]: ...

    def resolve_adapter(self, name: str) -> str: ...
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: Sink,
    ) -> object: ...
    def abort(self, handle: object) -> None: ...
    def load_adapter(
        self, name: str, path: str, pinned: bool = False, evict: Sequence[str] = ()
    ) -> Future[LoRAUpdateResult]: ...
    def unload_adapter(self, name: str) -> Future[LoRAUpdateResult]: ...
    def lora_state(self) -> dict[str, Any]: ...
    def listed_adapters(self) -> list[dict[str, Any]]: ...
    def stop(self) -> None: ...


def text_sink(
    tokenizer: TextTokenizer, params: SamplingParams, sink: Sink, on_stop: Callable[[], None]
) -> Sink:
    """A sink for the engine's token events that hands ``sink`` events with text; calls
    ``on_stop`` when a stop string ended the request before the engine did."""
    stream = TextStream(tokenizer.decode, params.stop)

    def take(event: SeqEvent) -> None:
        out = stream.event(event)
        if out is not None:
            sink(out)
            if stream.stopped:
                on_stop()

    return take


class InThreadEngineClient:
    """An `Engine` stepping on a thread of this process (started here unless ``start=False``)."""

    def __init__(self, engine: Engine, *, start: bool = True) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if start:
            engine.start()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.executor.model_config.vocab_size

    @property
    def kv_pool_tokens(self) -> int:
        return self.engine.kv_pool_tokens

    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    @property
    def group_adapters(self) -> list[dict[str, str]]:
        return list(self.engine.routes().group_adapters)

    def resolve_adapter(self, name: str) -> str:
        return self.engine.resolve_adapter(name)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: Sink,
    ) -> object:
        # a stop string can match before `submit` returns: the abort then follows it
        handle: list[Any] = []
        lock = threading.Lock()

        def on_stop() -> None:
            with lock:
                if handle:
                    self.engine.abort(handle[0])
                else:
                    handle.append(None)

        seq = self.engine.submit(
            request_id,
            prompt_ids,
            params,
            adapter,
            text_sink(self.tokenizer, params, sink, on_stop),
        )
        with lock:
            if handle:
                self.engine.abort(seq)
            handle[:] = [seq]
        return seq

    def abort(self, handle: object) -> None:
        self.engine.abort(handle)  # type: ignore[arg-type]

    def load_adapter(
        self, name: str, path: str, pinned: bool = False, evict: Sequence[str] = ()
    ) -> Future[LoRAUpdateResult]:
        return self.engine.load_adapter(name, path, pinned, evict)

    def unload_adapter(self, name: str) -> Future[LoRAUpdateResult]:
        return self.engine.unload_adapter(name)

    def lora_state(self) -> dict[str, Any]:
        return self.engine.lora_state()

    def listed_adapters(self) -> list[dict[str, Any]]:
        return self.engine.listed_adapters()

    def stop(self) -> None:
        self.engine.stop()
