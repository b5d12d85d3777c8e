"""The fused sampler (kernels/sampling.py) against the torch sampler (engine/sampling.py).

A seeded row's noise is a hash of its key and the token ids in both, so for the same rows
and parameters the two must pick the same tokens: the kernel's kept set (top_k with its ties,
the top_p nucleus over the top_k renormalized, with its ties), its race and its noise are the
torch path's. The torch path's own tests check those semantics against the softmax
(tests/unit/worker/test_worker_sampling.py). Here: equality over many rows and settings,
across blocks and radix passes, the unseeded draws' frequencies, and the odd inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.kernels.test_lora_kernels_segmented import DEVICE, DTYPES

from loraplane.worker.engine.sampling import SamplingParams, draw_seed, sample_rows
from loraplane.worker.kernels import sampling as fused

pytestmark = pytest.mark.kernels


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Language-model-like rows (std 3, so nuclei of a few to a few hundred tokens), with
    ties, signed zeros and values one ulp apart, which the order keys must sort right."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, 1] = x[:, 2] = x[:, 3]  # a three-way tie
    x[:, 4], x[:, 5] = 0.0, -0.0
    x[:, 6] = torch.nextafter(x[:, 7], torch.tensor(float("inf")))
    x[::3, 10:20] = x[::3, 10:11] + 6.0  # some rows: ten tied leaders
    return x


def _chunks_of(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small batch in chunks of ``tokens`` (0: one program a row), two blocks of lanes each
    (as the default's 8192 tokens are eight blocks of 1024 lanes)."""
    if tokens:
        monkeypatch.setattr(fused, "CHUNK_MIN", tokens)
        monkeypatch.setattr(fused, "CHUNK_BLOCK", tokens // 2)
        monkeypatch.setattr(fused, "CHUNKS_MIN", 2)


TEMPERATURES, TOP_KS, TOP_PS = (0.4, 1.0, 2.5), (-1, 2, 9, 60), (1.0, 0.95, 0.6, 0.05)
SETTINGS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, seed=1)
    for t, k, p in itertools.product(TEMPERATURES, TOP_KS, TOP_PS)
]
# Every pair of values of two parameters at least once (each top_k with each top_p, the
# temperature cycling through both): the kernel's block and chunk layouts run these 16.
PAIRWISE = [
    SamplingParams(temperature=TEMPERATURES[(i + j) % 3], top_k=k, top_p=p, seed=1)
    for i, k in enumerate(TOP_KS)
    for j, p in enumerate(TOP_PS)
]


@pytest.mark.parametrize(
    ("block", "candidates", "chunk"),
    [(128, fused.CANDIDATES, 0), (4096, fused.CANDIDATES, 0), (128, 0, 0), (128, 128, 64)],
    ids=["blocks-of-128", "one-block", "blocks-of-128-no-candidates", "chunks-of-64"],
)
def test_seeded_tokens_are_the_torch_samplers(
    block: int, candidates: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """48 settings x 6 rows (16 covering every pair of values, past the first layout): every
    token equal to the torch sampler's (over one block of the vocabulary, and over three,
    where the race and the masses run across blocks). top_k rows
    run on their candidates in registers, or (with no room for candidates) over the row;
    the other rows in one program each, or raced and checked once in chunks (five of 64
    tokens: the first check in other programs than the rest). In chunks, a top_k row's
    candidates are found chunk by chunk, 25 a chunk at most (past that, over the row)."""
    monkeypatch.setattr(fused, "BLOCK", block)
    monkeypatch.setattr(fused, "CANDIDATES", candidates)
    _chunks_of(chunk, monkeypatch)
    assert fused.chunking(6, 300) == ((5, chunk) if chunk else (1, 300))
    logits = _logits(6, 300, seed=block).to(DEVICE)
    differ = []
    settings = SETTINGS if (block, candidates, chunk) == (128, fused.CANDIDATES, 0) else PAIRWISE
    for n, base in enumerate(settings):
        params = [
            SamplingParams(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
                           seed=n * 7 + r)
            for r in range(6)
        ]  # fmt: skip
        for index in (n % 3,):
            want = sample_rows(logits, params, [index] * 6, "torch")
            got = sample_rows(logits, params, [index] * 6, "triton")
            differ += [
                (base, r, w, g) for r, (w, g) in enumerate(zip(want, got, strict=True)) if w != g
            ]
    assert not differ, differ[:5]


@pytest.mark.parametrize("chunk", [0, 512], ids=["rows", "chunks-of-512"])
def test_seeded_tokens_are_the_torch_samplers_past_its_candidates(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary past ``CANDIDATES`` (1024): the torch sampler draws top_k / top_p rows
    among its best 1024 tokens (and the whole vocabulary when a nucleus runs past them), the
    kernel over every token; the same tokens either way."""
    _chunks_of(chunk, monkeypatch)
    logits = _logits(4, 2100, seed=3).to(DEVICE)
    logits[3] /= 3  # a flatter row: at temperature 2.5 its nucleus of 0.95 passes 1024 tokens
    differ = []
    flat_nucleus = SamplingParams(temperature=2.5, top_p=0.95)  # (row 3's passes 1024)
    for n, base in enumerate([*SETTINGS[::5], flat_nucleus, SamplingParams(top_p=0.6)]):
        params = [
            SamplingParams(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
                           seed=n * 5 + r)
            for r in range(4)
        ]  # fmt: skip
        want = sample_rows(logits, params, [n] * 4, "torch")
        got = sample_rows(logits, params, [n] * 4, "triton")
        differ += [
            (base, r, w, g) for r, (w, g) in enumerate(zip(want, got, strict=True)) if w != g
        ]
    assert not differ, differ[:5]


@pytest.mark.parametrize("chunk", [0, 64], ids=["rows", "chunks-of-64"])
def test_top_k_rows_whose_candidates_do_not_fit(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A top_k past the lanes of a block (no bound from the lanes), and rows whose candidates
    pass the buffer (a block of ties at the k-th, a flat row): these rows pass over the row
    for the k-th score, from the lanes' bound where there is one; the same tokens. In
    chunks, the ties pass a chunk's share of the buffer (25) for a top_k of 3."""
    monkeypatch.setattr(fused, "BLOCK", 128)
    _chunks_of(chunk, monkeypatch)
    logits = _logits(4, 300, seed=5)
    logits[1, :200] = 20.0  # 200 tied above the rest: top_k 3 keeps them all (past 128)
    logits[2] = torch.randn(300) * 0.01  # flat: top_k 120 keeps 120 of ~250 candidates
    logits = logits.to(DEVICE)
    differ = []
    for n, (k, p) in enumerate(itertools.product((3, 120, 129, 250), (1.0, 0.7))):
        params = [SamplingParams(temperature=1.3, top_k=k, top_p=p, seed=n * 4 + r)
                  for r in range(4)]  # fmt: skip
        want = sample_rows(logits, params, [n] * 4, "torch")
        got = sample_rows(logits, params, [n] * 4, "triton")
        differ += [
            (k, p, r, w, g) for r, (w, g) in enumerate(zip(want, got, strict=True)) if w != g
        ]
    assert not differ, differ[:5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_logits_dtype_and_a_batch_with_greedy_rows(dtype: torch.dtype) -> None:
    """fp16 (and bf16 on a GPU) logits; greedy rows beside sampled ones keep their argmax."""
    logits = _logits(5, 700, seed=2).to(dtype).to(DEVICE)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=4),
        SamplingParams(temperature=1.2, seed=5),
    ]
    got = sample_rows(logits, params, [3] * 5, "triton")
    assert got == sample_rows(logits, params, [3] * 5, "torch")
    argmax = logits.float().argmax(-1).tolist()
    assert got[0] == argmax[0] and got[2] == argmax[2]


def test_unseeded_draws_follow_the_nucleus() -> None:
    """1000 unseeded rows in one launch: top_p 0.9 over [.5, .3, .15, .05] keeps the first
    three, drawn as .5 / .3 / .15 renormalized; each row gets a noise key of its own (from
    torch's generator, seeded here: the bound is four standard deviations)."""
    torch.manual_seed(1234)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1000, -1).contiguous().to(DEVICE)
    got = sample_rows(logits, [SamplingParams(top_p=0.9)] * 1000, [0] * 1000, "triton")
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / len(got)
    want = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - want).abs().max() < 0.065, freq
    assert freq[3] == 0


@pytest.mark.parametrize("chunk", [0, 16], ids=["rows", "chunks-of-16"])
def test_odd_logits(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """+inf wins, NaN is never drawn, -inf is never drawn, a row of ties draws any of them,
    a tie at the k-th value keeps every tied token; a row of -inf and a top_p that rounds to
    0 in float32 end (each check of the nucleus passes over the row again). In chunks too,
    where some chunks hold only -inf."""
    _chunks_of(chunk, monkeypatch)
    ends = torch.full((2, 50), float("-inf"), device=DEVICE)
    ends[1] = torch.arange(50.0, device=DEVICE).flip(0)
    far = torch.full((1, 50), float("-inf"), device=DEVICE)
    far[0, 40], far[0, 45] = -200.0, -200.5  # (-inf chunks beside a chunk far below 0)
    ends = torch.cat([ends, far])
    for top_p in (0.5, 1e-50):
        params = [SamplingParams(top_p=top_p, seed=2)] * 3
        got = sample_rows(ends, params, [0] * 3, "triton")
        assert got == sample_rows(ends, params, [0] * 3, "torch") and got[1] == 0
    for top_p in (1.0, 0.9):  # (both in a nucleus of 0.9: 0.62 and 0.38)
        params = [SamplingParams(top_p=top_p, seed=i) for i in range(30)]
        assert set(sample_rows(far.expand(30, -1), params, [0] * 30, "triton")) == {40, 45}
    x = torch.zeros(4, 50)
    x[0, 7], x[0, 9] = float("inf"), float("nan")
    x[1, :] = float("-inf")
    x[1, 3], x[1, 30] = 1.0, 1.0
    x[2, 20:25] = 5.0  # top_k 2 keeps the five tied
    x[3, 9] = float("nan")
    x = x.to(DEVICE)
    rounds = [
        sample_rows(
            x,
            [
                SamplingParams(top_p=0.5, seed=i),
                SamplingParams(temperature=2.0, seed=i),
                SamplingParams(temperature=50.0, top_k=2, seed=i),
                SamplingParams(temperature=1.0, top_p=0.99, seed=i),
            ],
            [i] * 4,
            "triton",
        )
        for i in range(60)
    ]
    # +0 and -0 are one value: at the k-th, both kept
    zeros = torch.tensor([[1.0, 0.0, -0.0, -1.0, -2.0]], device=DEVICE)
    drawn = {
        sample_rows(zeros, [SamplingParams(temperature=50.0, top_k=2, seed=i)], [0], "triton")[0]
        for i in range(40)
    }
    assert drawn == {0, 1, 2}
    assert {r[0] for r in rounds} == {7}
    assert {r[1] for r in rounds} == {3, 30}
    assert {r[2] for r in rounds} == set(range(20, 25))
    assert 9 not in {r[3] for r in rounds} and len({r[3] for r in rounds}) > 20


def test_the_table_is_checked() -> None:
    logits = torch.zeros(2, 10, device=DEVICE)
    out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    row = [0, 0, 0, 0, draw_seed(1, 0)]
    with pytest.raises(ValueError, match="sample_table: table must have 5 columns"):
        fused.sample_table(logits, torch.tensor([row[:4]], device=DEVICE), out)
    with pytest.raises(ValueError, match=r"sample_table: table must have dtype in \(torch.int64\)"):
        fused.sample_table(logits, torch.tensor([row], device=DEVICE).int(), out)
    with pytest.raises(
        ValueError, match=r"sample_table: out must have one entry per row of logits \(2\)"
    ):
        fused.sample_table(logits, torch.tensor([row], device=DEVICE), out[:1])
    with pytest.raises(
        ValueError, match=r"sample_table: top_ks must have one entry per table row \(1\), got 2"
    ):
        fused.sample_table(logits, torch.tensor([row], device=DEVICE), out, [0, 0])
    with pytest.raises(ValueError, match="sampler must be one of"):
        sample_rows(logits, [SamplingParams(seed=1)] * 2, [0, 0], "cuda")


@pytest.mark.parametrize("chunk", [0, 64], ids=["rows", "chunks-of-64"])
def test_past_the_round_cap_a_row_takes_its_best_token(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no nucleus check allowed (``MAX_ROUNDS`` 0) a top_p row takes its best token,
    which is in every nucleus; rows without a top_p still draw."""
    monkeypatch.setattr(fused, "MAX_ROUNDS", 0)
    _chunks_of(chunk, monkeypatch)
    logits = _logits(4, 300, seed=9).to(DEVICE)
    best = logits.max(-1).values
    for i in range(3):
        params = [SamplingParams(temperature=1.5, top_p=0.9, seed=i)] * 4
        got = torch.tensor(sample_rows(logits, params, [i] * 4, "triton"), device=DEVICE)
        assert torch.equal(logits.gather(1, got[:, None])[:, 0], best)  # (row 3: a tie of ten)
    free = [SamplingParams(temperature=5.0, seed=i) for i in range(4)]
    got = torch.tensor(sample_rows(logits, free, [0] * 4, "triton"), device=DEVICE)
    assert not torch.equal(logits.gather(1, got[:, None])[:, 0], best)
