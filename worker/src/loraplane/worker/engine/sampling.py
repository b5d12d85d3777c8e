"""Sampling parameters (OpenAI / SGLang semantics) and the sampler of a step's logits."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.worker.engine.logprobs import MAX_TOP_LOGPROBS
from loraplane.worker.models.batch import upload


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
    # Log probabilities (``engine.logprobs``): of each generated token, with this many most
    # likely alternatives (None: none); of the prompt's tokens from position
    # ``prompt_logprobs_start`` on, with this many alternatives (None: none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise SamplingError(
                    f"{name} must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got {value}"
                )
        if self.prompt_logprobs_start < 0:
            raise SamplingError(
                f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}"
            )

    @property
    def wants_logprobs(self) -> bool:
        """Whether this request asks for any log probabilities (``engine.logprobs``)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or below ``GREEDY_BELOW``, where ``logits /
        temperature`` would overflow), or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


# Temperatures below this decode greedily (vLLM's threshold too): dividing by them
# overflows float32 logits.
GREEDY_BELOW = 1e-5


GREEDY = SamplingParams(temperature=0.0)

# The least top_p the samplers use: the smallest normal float32. A smaller one (valid, > 0)
# would round to 0 in their float32 table, where no token is below it and none would be kept.
TOP_P_MIN = 1.1754943508222875e-38

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The noise key of a seeded sequence's ``index``-th token (splitmix64 of both), which
    ``seeded_exponential`` hashes with each token id.

    Each token's draw is a function of the request's seed and the token's index alone, so a
    seeded request gives the same tokens whatever it is batched with, on every rank, with no
    generator state kept between steps."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits


# A row with a top_k below CANDIDATES, or a top_p < 1 and no top_k, draws among its best
# CANDIDATES tokens (one torch.topk instead of a sort of the vocabulary: on an H200 at bs 128
# and a 128k vocabulary the sort took 1.71 ms of the first version's 2.93). A row whose kept
# tokens may run past them (a nucleus wider than them, or a tie that reaches the last one)
# and a row with a larger top_k take the whole vocabulary. A fixed count, not one per batch:
# which path a row takes depends on that row alone.
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
    key = upload(torch.tensor(keys, dtype=torch.int64), ids.device)[:, None]
    x = _mix32((ids.long() * 0x9E3779B1 + (key & _M32)) & _M32)
    x = _mix32(x ^ ((key >> 32) & _M32))
    return -torch.log(_uniform(x))


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) from 32-bit hash values, on their top 23 bits: ``k + 0.5`` for
    ``k < 2**23`` is exact in float32. (With 24 bits, ``2**24 - 0.5`` rounded to ``2**24``:
    ``u = 1``, ``q = 0``, and that token won whatever its probability.)"""
    return ((x >> 9).float() + 0.5) * 2.0**-23


# ``auto``: ``triton`` where the logits are on a GPU, ``torch`` elsewhere (on a CPU the fused
# sampler runs Triton's interpreter).
SAMPLERS = ("auto", "torch", "triton")
# The sampler of a ``sample_rows`` call that names none.
SAMPLER = "auto"


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    indices: Sequence[int],
    sampler: str | None = None,
) -> list[int]:
    """``sample_ids`` read back to the host."""
    return sample_ids(logits, params, indices, sampler).tolist()  # type: ignore[no-any-return]


def sample_ids(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    indices: Sequence[int],
    sampler: str | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits [n, vocab]``, row ``i`` by ``params[i]``: int64
    ``[n]`` on the logits' device (``sample_rows`` reads them back: ``n`` ints, not logits).

    Greedy rows take their argmax (the first index of a tie). The others sample in one batch:
    logits / temperature, the ``top_k`` best (with every token tied with the k-th), softmax
    over them, the smallest prefix of the sorted probabilities that reaches ``top_p`` (with
    every token tied with its last; the first token always kept), then an exponential race:
    ``argmax(p / q)`` with ``q ~ Exp(1)`` per token picks token ``t`` with probability
    ``p[t]``. The kept set does not depend on how ties are ordered. ``q`` comes from the
    device's default generator, or for a seeded row from a hash of ``draw_seed(seed,
    indices[i])`` and the token id (``seeded_exponential``): a seeded row's token depends on
    its logits, its parameters and ``indices[i]`` (how many tokens that sequence generated
    before), not on the rows beside it. A +inf logit wins (as the argmax would have it); NaN
    ones are never drawn.

    ``sampler``: ``torch`` (the steps above as torch ops) or ``triton`` (the same in one
    launch, ``kernels.sampling``: equal up to rounding, an unseeded row's ``q`` hashed from a
    random key); ``auto``: ``triton`` on a GPU, ``torch`` elsewhere; None: ``SAMPLER``. On a
    CPU, ``triton`` runs Triton's interpreter.
    """
    sampler = sampler or SAMPLER
    if sampler == "auto":
        sampler = "triton" if logits.is_cuda else "torch"
    if sampler == "triton":
        return _sample_fused(logits, params, indices)
    if sampler != "torch":
        raise SamplingError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if logits.device.type == "cpu":
        logits = logits.float()  # (on a CPU, argmax over bf16 is slower than the conversion)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits.argmax(-1)
    picked = _sample(_rows(logits, rows), [params[i] for i in rows], [indices[i] for i in rows])
    if len(rows) == len(params):
        return picked
    tokens = logits.argmax(-1)
    tokens[rows] = picked
    return tokens


def _fused_table(
    params: Sequence[SamplingParams], rows: list[int], indices: Sequence[int], top_ks: list[int]
) -> torch.Tensor:
    """The fused sampler's table (``kernels.sampling.TABLE_COLUMNS``) for ``rows``, on the
    host: one int64 row each of its index, top_k (``top_ks``: 0 for none), the float32 bits of
    its temperature and top_p (sign-extended) and its noise key. Built column by column
    through ``array``: per-value ``struct`` calls and a nested list took 0.16 ms at bs 128."""
    picked = [params[i] for i in rows]
    n_unseeded = sum(p.seed is None for p in picked)
    unseeded = iter(torch.randint(2**62, (n_unseeded,)).tolist() if n_unseeded else ())
    table = array("q", rows)
    table.extend(top_ks)
    table.extend(array("i", array("f", [p.temperature for p in picked]).tobytes()).tolist())
    top_ps = array("f", [max(p.top_p, TOP_P_MIN) for p in picked])
    table.extend(array("i", top_ps.tobytes()).tolist())
    table.extend(
        [
            draw_seed(p.seed, indices[i]) if p.seed is not None else next(unseeded)
            for i, p in zip(rows, picked, strict=True)
        ]
    )
    columns = len(table) // len(rows)  # (TABLE_COLUMNS)
    return torch.frombuffer(table, dtype=torch.int64).view(columns, len(rows)).T.contiguous()


def _sample_fused(
    logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> torch.Tensor:
    """``sample_rows`` in one to three launches (``kernels.sampling.sample_table``), after
    one argmax launch when some rows are greedy."""
    from loraplane.worker.kernels.sampling import sample_table

    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not params:  # (an idle DP group's step)
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if len(rows) < len(params):
        tokens = logits.argmax(-1)
        if not rows:
            return tokens
    else:
        tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    vocab = logits.shape[-1]
    top_ks = [k if 0 < k < vocab else 0 for k in (params[i].top_k for i in rows)]
    table = _fused_table(params, rows, indices, top_ks)
    sample_table(logits, upload(table, logits.device), tokens, top_ks)
    return tokens


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` (``rows`` ascending and distinct), or ``t`` itself when they are all of
    its rows (no copy)."""
    return t if len(rows) == t.shape[0] else t[rows]


def _sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    count = min(vocab, CANDIDATES)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    # the rows' settings in one host-to-device copy: temperature, top_k (0: none), top_p
    table = upload(
        torch.tensor(
            [[p.temperature, k, max(p.top_p, TOP_P_MIN)] for p, k in zip(params, ks, strict=True)]
        ),
        dev,
    )
    big = torch.finfo(torch.float32).max
    scores = (logits.float() / table[:, 0:1]).nan_to_num(-math.inf, big, -math.inf)
    # rows drawn among the best `count` tokens: a top_k below it, or a top_p and no top_k
    fits = [0 < k < count or (not k and p.top_p < 1.0) for p, k in zip(params, ks, strict=True)]
    narrow = [i for i, f in enumerate(fits) if f and count < vocab]
    whole = [i for i, f in enumerate(fits) if not (f and count < vocab)]
    tokens = None
    if narrow:
        tokens, short = _candidates(
            _rows(scores, narrow), _rows(table, narrow), count, [ks[i] for i in narrow],
            [params[i] for i in narrow], [indices[i] for i in narrow],
        )  # fmt: skip
        if len(narrow) < len(params):
            tokens = tokens.new_empty(len(params)).index_copy_(
                0, upload(torch.tensor(narrow), dev), tokens
            )
        whole = sorted(whole + [narrow[j] for j in short])
    if whole:
        drawn = _whole(
            _rows(scores, whole), _rows(table, whole), [ks[i] for i in whole],
            [params[i] for i in whole], [indices[i] for i in whole],
        )  # fmt: skip
        if tokens is None:
            return drawn
        tokens[whole] = drawn
    assert tokens is not None
    return tokens


def _candidates(
    scores: torch.Tensor,
    table: torch.Tensor,
    count: int,
    ks: list[int],
    params: list[SamplingParams],
    indices: list[int],
) -> tuple[torch.Tensor, list[int]]:
    """Tokens of rows drawn among their best ``count`` candidates, and the rows (positions)
    whose kept tokens may run past them (they take ``_whole``; their token here is not
    used). ``table``: the rows' ``[temperature, top_k, top_p]``; ``ks``: their top_k (0:
    none, a top_k at or past the vocabulary among them), each below ``count``."""
    vals, ids = torch.topk(scores, count, dim=-1)  # descending
    k, top_p = table[:, 1:2], table[:, 2:3]
    with_k = [kk > 0 for kk in ks]
    spill: torch.Tensor | None = None
    if any(with_k):
        has_k = k > 0
        kth = vals.gather(1, (k.long() - 1).clamp(min=0))
        # a tie with the k-th value that reaches the last candidate may go on past it
        spill = has_k & (vals[:, -1:] >= kth)
        vals = vals.masked_fill(has_k & (vals < kth), -math.inf)  # ties with the k-th kept
    # each candidate's probability in its row's distribution: over the top_k, or over the
    # whole vocabulary (a logsumexp of every score, not only the candidates')
    if all(with_k):
        total = vals.logsumexp(-1, keepdim=True)
    elif not any(with_k):
        total = scores.logsumexp(-1, keepdim=True)
    else:
        total = torch.where(
            has_k, vals.logsumexp(-1, keepdim=True), scores.logsumexp(-1, keepdim=True)
        )
    probs = (vals - total).exp()
    if not all(p.top_p >= 1.0 for p in params):
        mass = probs.cumsum(-1)
        edge = _nucleus_edge(probs, mass, top_p)
        if not all(with_k):
            # without a top_k: a nucleus that does not reach top_p within the candidates (a
            # flat distribution), or whose last value ties into the last candidate
            open_end = (mass[:, -1:] < top_p) | (probs[:, -1:] >= edge)
            if spill is None:
                spill = open_end
            else:
                spill |= open_end & ~has_k
        probs = probs.masked_fill((top_p < 1.0) & (probs < edge), 0.0)
    tokens = ids.gather(1, _race(probs, ids, scores.shape[-1], params, indices)[:, None])[:, 0]
    return tokens, [] if spill is None else spill[:, 0].nonzero()[:, 0].tolist()


def _nucleus_edge(probs: torch.Tensor, mass: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]``: the smallest probability in each row's top_p nucleus, over ``probs``
    sorted descending with their running ``mass`` (the first token is always in it)."""
    inside = (mass - probs) < top_p
    return probs.masked_fill(~inside, math.inf).amin(-1, keepdim=True)


def _whole(
    scores: torch.Tensor,
    table: torch.Tensor,
    ks: list[int],
    params: list[SamplingParams],
    indices: list[int],
) -> torch.Tensor:
    """Tokens of rows drawn over the whole vocabulary (a sort of it when a row has a
    top_p < 1)."""
    k, top_p = table[:, 1:2], table[:, 2:3]
    if any(ks):
        kth = torch.topk(scores, max(ks), dim=-1).values.gather(1, (k.long() - 1).clamp(min=0))
        scores = scores.masked_fill((k > 0) & (scores < kth), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        ordered = torch.sort(probs, dim=-1, descending=True).values
        edge = _nucleus_edge(ordered, ordered.cumsum(-1), top_p)
        probs = probs.masked_fill((top_p < 1.0) & (probs < edge), 0.0)
    return _race(probs, None, scores.shape[-1], params, indices)


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
        if ids is None:
            cols = torch.arange(vocab, device=probs.device).expand(len(seeded), -1)
        else:
            cols = _rows(ids, seeded)
        q[seeded] = seeded_exponential(keys, cols)
    # (q of 0 would make 0 / q undefined; exponential_ can round to it)
    return (probs / q.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
