"""Sampling parameters and the sampler."""

from dataclasses import replace

import pytest
import torch

from loraplane.worker.engine import sampling
from loraplane.worker.engine.sampling import SamplingError, SamplingParams, draw_seed, sample_rows

pytestmark = pytest.mark.unit


@pytest.fixture(params=[3, 1024], ids=["candidates", "whole"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Runs a test with 3 candidates (a row of 4-5 tokens with a top_k of 1-2 or a narrow
    top_p is drawn among them) and with the default (every row over the whole vocabulary)."""
    monkeypatch.setattr(sampling, "CANDIDATES", request.param)
    return int(request.param)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """``n`` tokens from one row of logits, each with its own draw (a batch of ``n`` rows)."""
    rows = logits.expand(n, -1)
    return sample_rows(rows, [params] * n, list(range(n)))


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 1.0, 5.0, 0.0]])
    assert sample_rows(logits, [SamplingParams(temperature=0)] * 2, [0, 0]) == [1, 0]
    assert sample_rows(logits, [SamplingParams(temperature=1.0, top_k=1)] * 2, [0, 0]) == [1, 0]


def test_sampled_tokens_follow_the_softmax() -> None:
    """At temperature 1 a token comes up as often as its probability says (4000 draws)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = _draws(probs.log(), SamplingParams(temperature=1.0), 4000)
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / len(got)
    assert (freq - probs).abs().max() < 0.03, freq
    # a lower temperature sharpens it: the best token more often than its probability
    cold = _draws(probs.log(), SamplingParams(temperature=0.25), 2000)
    assert cold.count(0) / len(cold) > 0.8


def test_top_k_restricts_to_the_k_best(path: int) -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0])
    assert set(_draws(logits, SamplingParams(temperature=5.0, top_k=2), 200)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p(path: int) -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(logits, SamplingParams(top_p=0.7), 300)) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.01), 50)) == {0}


def test_rows_of_one_step_keep_their_own_settings(path: int) -> None:
    """Greedy, top-k, top-p and plain rows in one batch: each row by its own parameters."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4, -1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=3.0, top_k=2),
        SamplingParams(top_p=0.01),
        SamplingParams(temperature=3.0),
    ]
    seen: list[set[int]] = [set() for _ in params]
    for step in range(300):
        for i, token in enumerate(sample_rows(logits, params, [step] * 4)):
            seen[i].add(token)
    assert seen == [{0}, {0, 1}, {0}, {0, 1, 2, 3}]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    """A seeded sequence's tokens depend on its seed and their index only: the same alone or
    among other rows, and they vary from token to token."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = [sample_rows(logits, [seeded], [i])[0] for i in range(20)]
    others = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    batch = torch.cat([others[:2], logits, others[2:]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=8)]
    params = [*params, seeded, *params]
    batched = [sample_rows(batch, params, [i] * 5)[2] for i in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1
    assert [sample_rows(logits, [replace(seeded, seed=9)], [i])[0] for i in range(20)] != alone
    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": -1}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_returns_each_sequences_token(dtype) -> None:
    from loraplane.worker.engine.executor import SeqWork, step_result

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[2, 7] = logits[2, 31] = 10.0  # a tie: the first index wins, as on the host before
    logits[3, 11] = 40.0  # at temperature 1 that token has all the mass but 1e-15
    sampling = SamplingParams(temperature=1.0, seed=5)
    work = [
        SeqWork(i, 0, (1,), params=sampling if i == 3 else SamplingParams(temperature=0))
        for i in range(4)
    ]
    rows = logits.float().tolist()
    want = [row.index(max(row)) for row in rows]
    assert want[2] == 7 and want[3] == 11
    assert step_result(logits, work).tokens == want
    # a sampling row is not its argmax when the argmax has little mass
    flat = torch.zeros(4, 50, dtype=dtype)
    flat[:, 0] = 0.1
    tokens = [step_result(flat, [replace(w, index=k) for w in work]).tokens for k in range(20)]
    assert {t[0] for t in tokens} == {0} and len({t[3] for t in tokens}) > 5


def test_a_nucleus_wider_than_the_candidates_draws_from_the_whole_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """top_p rows draw among their best ``CANDIDATES`` tokens; a flatter row, whose nucleus
    runs past them, still gets its whole nucleus (and nothing past it)."""
    monkeypatch.setattr(sampling, "CANDIDATES", 2)
    flat = torch.log(torch.tensor([0.3, 0.25, 0.25, 0.2]))
    assert set(_draws(flat, SamplingParams(top_p=0.7), 300)) == {0, 1, 2}
    peaked = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    assert set(_draws(peaked, SamplingParams(top_p=0.7), 300)) == {0, 1}


def test_a_seeded_token_does_not_depend_on_the_rows_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded top_p row draws the same tokens alone and beside rows that take other paths
    (a top_k above the candidates, a flat row whose nucleus is wider than them, a greedy
    row): its noise is drawn by token id, and its path depends on its own row."""
    monkeypatch.setattr(sampling, "CANDIDATES", 4)
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(5)) * 2
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    assert 4 < int((probs.cumsum(0) - probs < 0.9).sum()) < 60  # the nucleus: 4 < n < 60
    alone = [sample_rows(logits, [seeded], [i])[0] for i in range(30)]
    flat = torch.zeros(1, 100)
    batch = torch.cat([logits, flat, logits, logits])
    others = [
        SamplingParams(temperature=1.0, top_k=60),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
    ]
    beside = [
        sample_rows(batch, [others[0], others[1], seeded, others[2]], [i] * 4)[2] for i in range(30)
    ]
    assert alone == beside
    assert len(set(alone)) > 3


def test_top_p_applies_to_the_top_k_renormalized(path: int) -> None:
    """top_k first, then softmax over those k, then top_p: with [.4, .3, .2, .1], top_k 2
    leaves .571 / .429, whose nucleus at 0.5 is the first token alone."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert set(_draws(logits, SamplingParams(top_k=2, top_p=0.5), 200)) == {0}
    assert set(_draws(logits, SamplingParams(top_k=2, top_p=0.6), 300)) == {0, 1}


def test_ties_at_the_edge_are_kept_whatever_their_order(path: int) -> None:
    """Tokens tied with the k-th value, or with the last token of the nucleus, are all kept
    (which ones an order would cut is not defined)."""
    tied_k = torch.tensor([5.0, 3.0, 3.0, 3.0, 0.0])
    assert set(_draws(tied_k, SamplingParams(temperature=10.0, top_k=2), 400)) == {0, 1, 2, 3}
    # (with 4 candidates the ties end inside them: the candidates' own tie rule)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "CANDIDATES", 4)
        tied = torch.tensor([5.0, 3.0, 3.0, 0.0, -1.0])
        assert set(_draws(tied, SamplingParams(temperature=10.0, top_k=2), 300)) == {0, 1, 2}
    tied_p = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))
    assert set(_draws(tied_p, SamplingParams(top_p=0.5), 400)) == {0, 1, 2, 3}
    assert set(_draws(tied_p, SamplingParams(top_p=0.39), 100)) == {0}


def test_rows_of_the_candidates_and_of_the_whole_vocabulary_keep_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One batch: a flat row whose nucleus is wider than the candidates (the whole
    vocabulary) and a peaked one drawn among them; each row gets tokens of its own nucleus."""
    monkeypatch.setattr(sampling, "CANDIDATES", 2)
    rows = torch.log(torch.tensor([[0.8, 0.1, 0.05, 0.05], [0.3, 0.25, 0.25, 0.2]]))
    params = [SamplingParams(top_p=0.7)] * 2
    seen: list[set[int]] = [set(), set()]
    for step in range(300):
        for i, token in enumerate(sample_rows(rows, params, [step] * 2)):
            seen[i].add(token)
    assert seen == [{0}, {0, 1, 2}]


def test_tiny_temperatures_and_non_finite_logits() -> None:
    """A temperature below GREEDY_BELOW decodes greedily (dividing by it would overflow); a
    +inf logit wins as the argmax would have it; a NaN one is never drawn."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-38).greedy
    assert sample_rows(logits, [SamplingParams(temperature=1e-38)] * 3, [0] * 3) == argmax
    odd = logits.clone()
    odd[:, 7] = float("inf")
    odd[:, 9] = float("nan")
    params = [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(seed=3)]
    assert sample_rows(odd, params, [0] * 3) == [7, 7, 7]
    odd[:, 7] = 0.0
    drawn = {t for i in range(200) for t in sample_rows(odd, params, [i] * 3)}
    assert 9 not in drawn and len(drawn) > 5
    # a top_p too small for float32 keeps the best token (it rounded to 0: none, token 0)
    tiny = [SamplingParams(top_p=1e-50, seed=i) for i in range(3)]
    assert sample_rows(logits, tiny, [0] * 3) == argmax


def test_seeded_draws_follow_the_softmax_too() -> None:
    """4000 seeds, one draw each: a seeded token comes up as often as its probability says
    (the seeded noise is Exp(1), token by token), and the noise of a token is its own."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4000)]
    got = sample_rows(logits, params, [0] * 4000)
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / len(got)
    assert (freq - probs).abs().max() < 0.03, freq
    ids = torch.arange(1000).expand(3, -1)
    noise = sampling.seeded_exponential([1, 2, 3], ids)
    assert abs(float(noise.mean()) - 1.0) < 0.05 and float(noise.min()) > 0
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    again = sampling.seeded_exponential([1, 2, 3], shuffled.expand(3, -1))
    assert torch.equal(again, noise[:, shuffled])
    assert not torch.equal(noise[0], noise[1])


def test_a_top_k_past_the_vocabulary_is_no_top_k(path: int) -> None:
    """top_k at or above the vocabulary keeps every token: with top_p 0.85 over
    [.5, .3, .1, .1] the nucleus is all four (the last tied with the edge), as without it."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    for top_k in (-1, 4, 10):
        got = set(_draws(logits, SamplingParams(top_p=0.85, top_k=top_k), 400))
        assert got == {0, 1, 2, 3}, top_k


def test_an_unknown_sampler_is_refused_naming_the_flag() -> None:
    from loraplane.worker.config import ConfigError
    from loraplane.worker.server.factory import ServeConfig

    with pytest.raises(
        ConfigError, match="--sampler 'fast' is not supported; expected one of auto, torch, triton"
    ):
        ServeConfig(model="-", sampler="fast")
    with pytest.raises(SamplingError, match="sampler must be one of"):
        sample_rows(torch.zeros(1, 4), [SamplingParams(seed=1)], [0], "fast")


def test_the_noise_is_never_zero() -> None:
    """Every uniform the hash can give lies strictly inside (0, 1) (all 2**23 of them, each
    with the low bits that round up most), so ``q = -log(u)`` is positive: a ``q`` of 0 lets
    its token win whatever its probability (24 bits did that for 1 hash value in 2**24)."""
    x = (torch.arange(2**23, dtype=torch.int64) << 9) | 511
    u = sampling._uniform(x)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert float((-torch.log(u)).min()) > 0
    assert torch.equal(u.unique(), u)  # 2**23 distinct values, in order


def test_an_idle_groups_empty_step_samples_nothing() -> None:
    for sampler in sampling.SAMPLERS:
        assert sample_rows(torch.zeros(0, 10), [], [], sampler) == []


def test_auto_samples_with_torch_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` (the default) takes the fused sampler only where the logits are on a GPU: on
    a CPU it would run Triton's interpreter."""

    def fused(*args: object) -> list[int]:
        raise AssertionError("the fused sampler ran on a CPU")

    monkeypatch.setattr(sampling, "_sample_fused", fused)
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(top_k=5, seed=2)]
    assert sample_rows(logits, params, [0, 0]) == sample_rows(logits, params, [0, 0], "torch")
    with pytest.raises(AssertionError, match="fused sampler ran"):
        sample_rows(logits, params, [0, 0], "triton")
