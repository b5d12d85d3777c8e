"""The front end's text: incremental decoding (`Detokenizer`) and stop strings (`TextStream`)
give the client the same text as decoding every output id again after each token."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loraplane.worker.engine.detokenizer import Detokenizer, TextStream
from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.fixtures.tokenizer import write_tokenizer

pytestmark = pytest.mark.unit

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "café naïve façade — crème brûlée",
    "日本語のテキスト and 中文 mixed in",
    "emoji 🙂🚀 split over byte tokens 👩‍👩‍👧",
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, vocab_size=512, model_max_length=256)
    return TextTokenizer(out)


def metaspace_decoder(tmp_path: Path) -> Callable[[Sequence[int]], str]:
    """A sentencepiece-like tokenizer: "▁" for spaces, and decoding drops the leading one,
    so a window decoded alone loses its first space (the prefix window puts it back)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tok.train_from_iterator([t for t in TEXTS] * 4, trainer=trainer)
    path = tmp_path / "metaspace.json"
    tok.save(str(path))
    loaded = Tokenizer.from_file(str(path))
    return lambda ids: str(loaded.decode(list(ids)))


def feed(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_decoding_one_token_at_a_time_gives_the_whole_decode(
    tokenizer: TextTokenizer, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer.decode)
    deltas = feed(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_character_split_over_tokens_is_held_back_until_complete(
    tokenizer: TextTokenizer,
) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    assert len(ids) >= 3  # "a" and the emoji's 4 bytes in more than one token
    detok = Detokenizer(tokenizer.decode)
    assert detok.add(ids[:1]) == "a"
    assert [detok.add([t]) for t in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detok.add(ids[-1:]) == "🙂"
    assert detok.flush() == ""


def test_an_incomplete_tail_comes_out_at_the_end(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("ok🙂", add_special_tokens=False)[:-1]  # the emoji cut short
    detok = Detokenizer(tokenizer.decode)
    held = "".join(detok.add([t]) for t in ids)
    assert held == "ok"
    assert held + detok.flush() == tokenizer.decode(ids)
    assert detok.text.endswith("\ufffd")


def test_a_decoder_that_drops_a_leading_space_keeps_the_spaces(tmp_path: Path) -> None:
    decode = metaspace_decoder(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "metaspace.json"))
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert "".join(feed(Detokenizer(decode), ids)) == decode(ids)


def events(stream: TextStream, ids: list[int], *, max_tokens: int) -> list[SeqEvent]:
    """What the client gets when the core sends ``ids`` one a step and ends at max_tokens."""
    out: list[SeqEvent] = []
    for n, t in enumerate(ids[:max_tokens], 1):
        done = n == max_tokens
        core = SeqEvent("", (t,), done, "length" if done else None, completion_tokens=n)
        if (e := stream.event(core)) is not None:
            out.append(e)
        if stream.finished:
            break
    return out


def test_a_stop_string_spanning_tokens_cuts_the_text_and_stops_the_request(
    tokenizer: TextTokenizer,
) -> None:
    ids = tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    stream = TextStream(tokenizer.decode, ("ck bro",))
    got = events(stream, ids, max_tokens=len(ids))
    assert "".join(e.text_delta for e in got) == "The qui"
    last = got[-1]
    assert last.finished and last.finish_reason == "stop" and last.matched_stop == "ck bro"
    assert stream.stopped  # the core did not end it: the caller aborts it there
    assert last.completion_tokens < len(ids)
    for e in got[:-1]:  # nothing of a stop string that may still match was sent early
        assert not e.finished


def test_a_stop_string_on_the_last_token_wins_over_length(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    full = tokenizer.decode(ids)
    stream = TextStream(tokenizer.decode, (full[-3:],))
    got = events(stream, ids, max_tokens=len(ids))
    assert got[-1].finish_reason == "stop" and got[-1].matched_stop == full[-3:]
    assert "".join(e.text_delta for e in got) == full[:-3]
    assert not stream.stopped  # the core ended it too: nothing to abort


def old_engine_text(
    decode: Callable[[Sequence[int]], str], ids: list[int], stop: tuple[str, ...], max_tokens: int
) -> list[tuple[str, bool, str | None, int | str | None]]:
    """The text the engine sent before the front end decoded: every id decoded again after
    each token, stop strings matched on that, the tail a stop string could take held back."""
    out: list[tuple[str, bool, str | None, int | str | None]] = []
    output: list[int] = []
    text, emitted = "", 0
    for n, t in enumerate(ids[:max_tokens], 1):
        output.append(t)
        previous, text = len(text), decode(output)
        reason: str | None = None
        matched: int | str | None = None
        if stop:
            longest = max(len(s) for s in stop)
            start = max(0, min(previous, len(text)) - longest)
            hits = [(i, s) for s in stop if (i := text.find(s, start)) >= 0]
            if hits:
                index, matched = min(hits)
                text, reason = text[:index], "stop"
        if reason is None and n >= max_tokens:
            reason = "length"
        finished = reason is not None
        end = len(text)
        if not finished:
            if stop:
                end -= max(len(s) for s in stop) - 1
            while end > emitted and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, emitted)
        out.append((text[emitted:end], finished, reason, matched))
        emitted = end
        if finished:
            break
    return out


def test_the_client_text_is_the_same_as_decoding_everything_each_token(
    tokenizer: TextTokenizer,
) -> None:
    rng = random.Random(7)
    corpus = " ".join(TEXTS)
    for _ in range(60):
        start = rng.randrange(len(corpus) - 20)
        text = corpus[start : start + rng.randrange(10, 60)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        a = rng.randrange(len(full))
        stop = tuple({full[a : a + rng.randrange(1, 6)], "never there"} - {""})
        max_tokens = rng.randrange(1, len(ids) + 1)
        want = old_engine_text(tokenizer.decode, ids, stop, max_tokens)
        got = events(TextStream(tokenizer.decode, stop), ids, max_tokens=max_tokens)
        want_text = "".join(d for d, *_ in want)
        assert "".join(e.text_delta for e in got) == want_text, (text, stop, max_tokens)
        assert (got[-1].finish_reason, got[-1].matched_stop) == want[-1][2:], (text, stop)
