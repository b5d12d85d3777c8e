"""Sampling parameters (OpenAI / SGLang semantics) and the sampler of a step's logits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise SamplingError(f"max_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingError(f"top_k must be -1 (no limit) or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise SamplingError("stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


GREEDY = SamplingParams(temperature=0.0)

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded sequence's ``index``-th token (splitmix64 of both).

    Each token's draw is a function of the request's seed and the token's index alone, so a
    seeded request gives the same tokens whatever it is batched with, on every rank, with no
    generator state kept between steps."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits


# A row that keeps a subset of the vocabulary (top_k, or top_p < 1) draws among its best
# CANDIDATES tokens (or its top_k, when larger): a top-k of them instead of a sort of the whole
# vocabulary (on an H200 at bs 128 and a 128k vocabulary the sort took 1.71 ms of the
# sampler's 2.93). A top_p row whose nucleus runs past them sorts the whole vocabulary.
CANDIDATES = 1024


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding 32-bit values (the products
    wrap modulo 2**64; their low 32 bits are the 32-bit products)."""
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def seeded_exponential(keys: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """``Exp(1)`` noise ``[len(keys), n]`` float32 for tokens ``ids [len(keys), n]``: row
    ``i``'s value for a token is a hash of ``keys[i]`` (``draw_seed``) and the token id alone,
    so a seeded row draws the same whatever tokens are in play beside it (its candidates or
    the whole vocabulary) and whatever rows are batched with it, with no generator per row."""
    key = torch.tensor(keys, dtype=torch.int64, device=ids.device)[:, None]
    x = _mix32((ids.long() * 0x9E3779B1 + (key & _M32)) & _M32)
    x = _mix32(x ^ ((key >> 32) & _M32))
    u = (x.double() + 0.5) / 2.0**32  # uniform in (0, 1)
    return (-torch.log(u)).float()


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> list[int]:
    """One token id per row of ``logits [n, vocab]``, row ``i`` by ``params[i]``, where the
    logits are (one transfer of ``n`` ints to the host).

    Greedy rows take their argmax (the first index of a tie). The others sample in one batch:
    logits / temperature, the ``top_k`` best (exactly k: a tie at the k-th value keeps the
    first that ``torch.topk`` returns), softmax, the smallest prefix of the sorted
    probabilities that reaches ``top_p`` (the first token always kept), then an exponential
    race: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token picks token ``t`` with probability
    ``p[t]``. ``q`` comes from the device's default generator, or for a seeded row from a hash
    of ``draw_seed(seed, indices[i])`` and the token id (``seeded_exponential``): a seeded
    row's token depends on its logits, its parameters and ``indices[i]`` (how many tokens
    that sequence generated before), not on the rows beside it.
    """
    if logits.device.type == "cpu":
        logits = logits.float()  # (on a CPU, argmax over bf16 is slower than the conversion)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits.argmax(-1).tolist()  # type: ignore[no-any-return]
    picked = _sample(_rows(logits, rows), [params[i] for i in rows], [indices[i] for i in rows])
    if len(rows) == len(params):
        return picked.tolist()  # type: ignore[no-any-return]
    tokens = logits.argmax(-1)
    tokens[rows] = picked
    return tokens.tolist()  # type: ignore[no-any-return]


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, or ``t`` itself when ``rows`` are all of them in order (no copy)."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    # the rows' settings in one host-to-device copy: temperature, top_k (0: none), top_p
    table = torch.tensor([[p.temperature, k, p.top_p] for p, k in zip(params, ks, strict=True)]).to(
        dev
    )
    scores = logits.float() / table[:, 0:1]
    narrow = [i for i, p in enumerate(params) if ks[i] or p.top_p < 1.0]
    if len(narrow) == len(params):
        return _narrow(scores, ks, table, params, indices)
    wide = [i for i in range(len(params)) if i not in set(narrow)]
    probs = torch.softmax(_rows(scores, wide), dim=-1)  # the whole vocabulary
    tokens = _race(probs, None, vocab, [params[i] for i in wide], [indices[i] for i in wide])
    if narrow:
        tokens = tokens.new_empty(len(params)).index_copy_(
            0, torch.tensor(wide, device=dev), tokens
        )
        tokens[narrow] = _narrow(
            scores[narrow], [ks[i] for i in narrow], table[narrow],
            [params[i] for i in narrow], [indices[i] for i in narrow],
        )  # fmt: skip
    return tokens


def _narrow(
    scores: torch.Tensor,
    ks: list[int],
    table: torch.Tensor,
    params: list[SamplingParams],
    indices: list[int],
) -> torch.Tensor:
    """Rows with a top_k or a top_p < 1: drawn among their best candidates. ``table``: the
    rows' ``[temperature, top_k, top_p]``."""
    dev, vocab = scores.device, scores.shape[-1]
    count = min(vocab, max(CANDIDATES, *ks))
    vals, ids = torch.topk(scores, count, dim=-1)  # descending
    k, top_p = table[:, 1:2], table[:, 2:3]
    if any(ks):
        past_k = (k > 0) & (torch.arange(count, device=dev)[None, :] >= k)
        vals = vals.masked_fill(past_k, -math.inf)
    # each candidate's probability in its row's distribution: over the top_k, or over the
    # whole vocabulary (a logsumexp of every score, not only the candidates')
    if all(ks):
        total = vals.logsumexp(-1, keepdim=True)
    elif not any(ks):
        total = scores.logsumexp(-1, keepdim=True)
    else:
        total = torch.where(
            k > 0, vals.logsumexp(-1, keepdim=True), scores.logsumexp(-1, keepdim=True)
        )
    probs = (vals - total).exp()
    mass = probs.cumsum(-1)
    probs = probs.masked_fill((mass - probs >= top_p) & (top_p < 1.0), 0.0)
    tokens = ids.gather(1, _race(probs, ids, vocab, params, indices)[:, None])[:, 0]
    if all(ks):
        return tokens
    # without a top_k, the candidates hold less than top_p of the mass: a flat distribution
    # whose nucleus runs past them; those rows sort the whole vocabulary
    short = ((k[:, 0] == 0) & (mass[:, -1] < top_p[:, 0])).nonzero()[:, 0].tolist()
    if short:
        probs = torch.softmax(scores[short], dim=-1)
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered
        ordered = ordered.masked_fill(before >= top_p[short], 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, ordered)
        tokens[short] = _race(
            probs, None, vocab, [params[i] for i in short], [indices[i] for i in short]
        )
    return tokens


def _race(
    probs: torch.Tensor,
    ids: torch.Tensor | None,
    vocab: int,
    params: list[SamplingParams],
    indices: list[int],
) -> torch.Tensor:
    """Each row's winner (a column of ``probs``) of ``argmax(p / q)``, ``q ~ Exp(1)``; the
    columns are tokens ``ids`` (None: the whole vocabulary). A seeded row's ``q`` of a token
    is a function of ``draw_seed`` and the token id (``seeded_exponential``)."""
    q = torch.empty_like(probs).exponential_()
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if seeded:
        keys = [draw_seed(params[i].seed or 0, indices[i]) for i in seeded]
        cols = torch.arange(vocab, device=probs.device).expand(len(seeded), -1)
        q[seeded] = seeded_exponential(keys, cols if ids is None else ids[seeded])
    # (q of 0 would make 0 / q undefined; exponential_ can round to it)
    return (probs / q.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
