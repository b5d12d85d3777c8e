"""One request in the engine: its prompt, its adapter version, what it generated so far."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane.worker.engine.logprobs import TokenLogprob
from loraplane.worker.engine.pages import PageLease
from loraplane.worker.engine.sampling import SamplingParams

_ids = itertools.count()

# `SeqEvent.error_kind` of a request for an adapter the engine no longer holds (unloaded
# after the front end routed it): the front end answers 404 naming the adapter.
UNKNOWN_ADAPTER = "unknown_adapter"


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """What a request's consumer receives after a step: new tokens (and, from the front end's
    `TextStream`, new text), or the end. The engine itself sends no text."""

    text_delta: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None  # UNKNOWN_ADAPTER, or None: the engine failed
    # what the request asked for (`engine.logprobs`): each of `token_ids`' logprob, and, in
    # the event of its prefill, its prompt tokens' from `prompt_logprobs_start` on
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    def merged(self, later: SeqEvent) -> SeqEvent:
        """This event followed by ``later`` as one: their text, tokens and tokens' logprobs
        in order, the prompt's logprobs of whichever has them, the later one's end and
        counts (an error ends the request: the later error wins)."""
        if later.error is not None or self.error is not None:
            return later if later.error is not None else self
        return SeqEvent(
            self.text_delta + later.text_delta,
            self.token_ids + later.token_ids,
            later.finished,
            later.finish_reason,
            later.matched_stop,
            later.prompt_tokens,
            later.completion_tokens,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter_name: str | None  # the name the client used
    adapter_key: str | None  # the version it runs with (executor name)
    sink: Callable[[SeqEvent], None]  # called on the engine thread
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    generated: int = 0  # tokens sampled, including a final stop token
    dp_group: int = -1
    cache_row: int = -1
    slot: int = -1
    cached: int = 0  # tokens of this sequence in its KV pages
    kv_tokens: int = 0  # KV positions reserved at admission (``Engine.kv_tokens``)
    kv: PageLease | None = None  # its pages while it runs
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    aborted: bool = False
    arrived: float = field(default_factory=time.perf_counter)  # when the engine got it
    first_token_seen: bool = False  # whether a token of it reached its sink

    @property
    def shareable_prompt(self) -> list[int]:
        """The prompt tokens whose cached KV (the prefix cache's) this sequence may take: none
        when it scores its prompt, since a cached position's logprob is never computed."""
        return [] if self.params.prompt_logprobs is not None else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be fed (the next step samples no real token
        unless it feeds the rest of the prompt)."""
        return self.cached < len(self.prompt_ids)

    def next_tokens(self, limit: int | None = None) -> tuple[int, ...]:
        """Tokens to feed this step: the prompt first (at most ``limit`` of its tokens a step:
        chunked prefill), then the last sampled token."""
        if self.prefilling:
            end = len(self.prompt_ids) if limit is None else self.cached + limit
            return tuple(self.prompt_ids[self.cached : end])
        return (self.output_ids[-1],)
