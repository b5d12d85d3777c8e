"""A step's log probabilities (engine.logprobs, executor.step_result): the rows asked for,
the values of a torch log_softmax, and nothing for the rows that did not ask."""

from __future__ import annotations

import pytest
import torch

from loraplane.worker.engine.executor import SeqWork, build_batch, step_result
from loraplane.worker.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, reference_logprobs
from loraplane.worker.engine.sampling import SamplingError, SamplingParams
from loraplane.worker.engine.sequence import SeqEvent

pytestmark = pytest.mark.unit

VOCAB = 50


def _work() -> list[SeqWork]:
    """A prefill scoring its prompt from position 0, a plain decode row, a decode row with
    logprobs, and a prefill scoring its prompt from position 3 with no output logprobs."""
    return [
        SeqWork(0, 0, (4, 8, 15, 16), params=SamplingParams(temperature=0, logprobs=2,
                prompt_logprobs=3)),
        SeqWork(1, 7, (23,), params=SamplingParams(temperature=0)),
        SeqWork(2, 5, (42,), params=SamplingParams(temperature=0, logprobs=0)),
        SeqWork(3, 0, (1, 2, 3, 4, 5), params=SamplingParams(temperature=0, prompt_logprobs=0,
                prompt_logprobs_start=3)),
    ]  # fmt: skip


def test_the_batch_asks_for_the_scored_prompts_rows_and_each_last_row() -> None:
    batch, _ = build_batch(_work(), "cpu")
    # row 0: its prompt's positions 0..3 (the logits before tokens 1..3, then its next);
    # row 1: its one token; row 2: its one token; row 3: positions 2..4 of tokens at 6..10
    assert batch.logit_rows.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    plain, _ = build_batch([_work()[1]], "cpu")
    assert plain.logit_rows.tolist() == [0]


def test_a_steps_logprobs_are_a_log_softmax_of_the_rows_asked_for() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, VOCAB) * 3
    work = _work()
    result = step_result(logits, work, "torch")
    last = logits[[3, 4, 5, 8]]
    assert result.tokens == last.argmax(-1).tolist()  # greedy, from each sequence's last row
    # the sampled tokens': rows 0 and 2 asked (2 and 0 alternatives), rows 1 and 3 did not
    assert result.logprobs[1] is None and result.logprobs[3] is None
    for i, top in ((0, 2), (2, 0)):
        (want,) = reference_logprobs(last[i : i + 1], [result.tokens[i]], top)
        got = result.logprobs[i]
        assert got is not None and got.token == result.tokens[i]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert len(got.top) == top
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-6)
        if top:  # greedy: the sampled token is the likeliest
            assert got.top[0][0] == got.token
    # the prompts': row 0 from position 1 (tokens 8, 15, 16), row 3 from position 3 (4, 5)
    assert result.prompt_logprobs[1] is None and result.prompt_logprobs[2] is None
    scored = result.prompt_logprobs[0]
    assert scored is not None
    want = reference_logprobs(logits[0:3], [8, 15, 16], 3)
    assert [e.token for e in scored] == [8, 15, 16]
    assert [e.logprob for e in scored] == pytest.approx([w.logprob for w in want], abs=1e-6)
    assert [[t for t, _ in e.top] for e in scored] == [[t for t, _ in w.top] for w in want]
    late = result.prompt_logprobs[3]
    assert late is not None and [e.token for e in late] == [4, 5]
    want = reference_logprobs(logits[6:8], [4, 5], 0)
    assert [e.logprob for e in late] == pytest.approx([w.logprob for w in want], abs=1e-6)
    assert all(e.top == () for e in late)


def test_rows_that_ask_for_nothing_get_nothing() -> None:
    logits = torch.randn(2, VOCAB)
    work = [SeqWork(0, 3, (1,)), SeqWork(1, 3, (2,), params=SamplingParams(temperature=0))]
    result = step_result(logits, work, "torch")
    assert result.tokens == logits.argmax(-1).tolist()
    assert result.logprobs == [] and result.prompt_logprobs == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs_start": -2}, "prompt_logprobs_start"),
    ],
)
def test_bad_logprob_parameters_name_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_events_joined_keep_every_tokens_logprob_and_the_prompts() -> None:
    """Events queued behind a slow stream are joined into one: nothing of theirs is lost."""
    prompt = (TokenLogprob(7, -1.5, ()),)
    first = SeqEvent(
        "a", (1,), logprobs=(TokenLogprob(1, -0.5, ((1, -0.5),)),), prompt_logprobs=prompt
    )
    second = SeqEvent(
        "b", (2,), True, "length", logprobs=(TokenLogprob(2, -0.25, ()),), completion_tokens=2
    )
    joined = first.merged(second)
    assert joined.text_delta == "ab" and joined.token_ids == (1, 2)
    assert [e.token for e in joined.logprobs] == [1, 2]
    assert joined.prompt_logprobs == prompt
    assert joined.finished and joined.finish_reason == "length" and joined.completion_tokens == 2
