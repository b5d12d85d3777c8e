"""Token ids to the text a client sees, in the front end: incremental decoding and stop strings.

The engine core sends token ids only. `Detokenizer` turns one sequence's ids into text as they
arrive, decoding only a short window of the newest tokens each time (vLLM's
``detokenize_incrementally``): the window starts at ``prefix_offset``, the tokens already read
before ``read_offset`` give the text the window's decode must start with, and the rest is new.
A window whose decode ends in U+FFFD (a character whose bytes are split over tokens) is held
back until its next token completes it. The text equals the decode of all ids at once.

`TextStream` is one request's text as its client sees it: it matches the request's stop strings
(cutting the text before the first match), holds back the characters a stop string that has
only begun could still take, and turns the core's token events into `SeqEvent`s with text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from loraplane.worker.engine.sequence import SeqEvent

Decode = Callable[[Sequence[int]], str]

INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete


class Detokenizer:
    """One sequence's output ids, decoded incrementally."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # the complete characters decoded so far
        self._prefix_offset = 0  # where the decode window starts
        self._read_offset = 0  # ids before this are in `text`
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])

    def add(self, token_ids: Iterable[int]) -> str:
        """Take new ids; the text they complete (empty while a character is incomplete)."""
        self.ids.extend(token_ids)
        if len(self.ids) == self._read_offset:
            return ""
        window = self._decode(self.ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or window.endswith(INCOMPLETE):
            return ""
        return self._advance(window)

    def flush(self) -> str:
        """The sequence ended: the rest of its text, incomplete characters included."""
        if len(self.ids) == self._read_offset:
            return ""
        return self._advance(self._decode(self.ids[self._prefix_offset :]))

    def _advance(self, window: str) -> str:
        delta = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        self.text += delta
        return delta


class TextStream:
    """One request's text: its detokenizer, its stop strings and what was sent already.

    ``event`` takes what the engine core reported for the request after a step (token ids,
    and the end if it ended: EOS, a stop token, ``max_tokens``, an abort) and returns what the
    client gets, or None if nothing. When a stop string matches, the event it returns is the
    request's last (``finish_reason`` "stop", ``matched_stop`` the string) and ``stopped`` is
    set: the caller then aborts the request in the core and drops what the core still sends.
    """

    def __init__(self, decode: Decode, stop: tuple[str, ...]) -> None:
        self.detokenizer = Detokenizer(decode)
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already sent
        self.finished = False
        self.stopped = False  # ended by a stop string the core does not know of

    def event(self, core: SeqEvent) -> SeqEvent | None:
        if self.finished:
            return None
        if core.error is not None:
            self.finished = True
            return core
        checked = len(self.text)
        self.detokenizer.add(core.token_ids)
        if core.finished:
            self.detokenizer.flush()
        self.text = self.detokenizer.text
        finished, reason, matched = core.finished, core.finish_reason, core.matched_stop
        if self.stop and len(self.text) > checked:
            start = max(0, checked - self._hold - 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                index, matched = min(hits)
                self.text = self.text[:index]
                finished, reason, self.stopped = True, "stop", not core.finished
        end = len(self.text) if finished else max(len(self.text) - self._hold, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        self.finished = finished
        if not (delta or core.token_ids or finished or core.prompt_logprobs):
            return None
        return SeqEvent(
            delta,
            core.token_ids,
            finished,
            reason,
            matched,
            prompt_tokens=core.prompt_tokens,
            completion_tokens=core.completion_tokens,
            logprobs=core.logprobs,
            prompt_logprobs=core.prompt_logprobs,
        )
