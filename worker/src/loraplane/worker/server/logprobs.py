"""Log probabilities in the shapes clients expect: OpenAI completions (legacy), OpenAI chat,
SGLang's ``meta_info`` triples. The engine sends `TokenLogprob`s (token ids and floats);
the text of a token here is the decode of that token alone (as vLLM and SGLang give it).

JSON has no infinities: a logprob of ``-inf`` (a token the model rules out) is sent as
``-9999.0``, OpenAI's value for "very unlikely".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from loraplane.worker.engine.logprobs import TokenLogprob

FLOOR = -9999.0


def finite(logprob: float) -> float:
    """``logprob`` as JSON can carry it (``FLOOR`` for ``-inf`` or NaN)."""
    return logprob if math.isfinite(logprob) else FLOOR


class LogprobText:
    """Token texts (cached by id) and the response shapes built from them."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._decode([token])
        return text

    # --- OpenAI completions (legacy) ---------------------------------------------------

    def completion(
        self, entries: Sequence[TokenLogprob | None], tokens: Sequence[int], offset: int
    ) -> dict[str, Any]:
        """``choices[].logprobs`` for ``tokens`` (``entries[i]`` None: no logprob, the prompt's
        first token), their offsets counted from ``offset`` characters of text."""
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(tokens, entries, strict=True):
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            # (tokens of one text, e.g. bytes of split characters, keep the likeliest's)
            top: dict[str, float] = {}
            for t, lp in entry.top:
                top.setdefault(self.text(t), finite(lp))
            top.setdefault(text, finite(entry.logprob))  # (the token itself, as OpenAI)
            out["top_logprobs"].append(top)
        return out

    # --- OpenAI chat -------------------------------------------------------------------

    def chat(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """``choices[].logprobs.content`` of ``entries``."""
        return [
            {**self._chat_token(e.token, e.logprob), "top_logprobs": [
                self._chat_token(t, lp) for t, lp in e.top
            ]}
            for e in entries
        ]  # fmt: skip

    def _chat_token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    # --- SGLang /generate --------------------------------------------------------------

    def triples(
        self, entries: Sequence[TokenLogprob | None], tokens: Sequence[int], with_text: bool
    ) -> list[tuple[float | None, int, str | None]]:
        """``[logprob, token id, text or None]`` per token (logprob None where ``entries``
        has none: the prompt's first token)."""
        return [
            (
                None if e is None else finite(e.logprob),
                token,
                self.text(token) if with_text else None,
            )
            for token, e in zip(tokens, entries, strict=True)
        ]

    def top_triples(
        self, entries: Sequence[TokenLogprob | None], with_text: bool
    ) -> list[list[tuple[float | None, int, str | None]] | None]:
        """Per position, its most likely tokens as triples (None where ``entries`` has none)."""
        return [
            None
            if e is None
            else [(finite(lp), t, self.text(t) if with_text else None) for t, lp in e.top]
            for e in entries
        ]
