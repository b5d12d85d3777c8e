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


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> list[int]:
    """One token id per row of ``logits [n, vocab]``, row ``i`` by ``params[i]``, where the
    logits are (one transfer of ``n`` ints to the host).

    Greedy rows take their argmax (the first index of a tie). The others sample in one batch:
    logits / temperature, the ``top_k`` best (ties at the k-th value kept), softmax, the
    smallest prefix of the sorted probabilities that reaches ``top_p`` (the first token
    always kept), then an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token
    picks token ``t`` with probability ``p[t]``. ``q`` comes from the device's default
    generator, or for a seeded row from ``draw_seed(seed, indices[i])``: ``indices[i]`` is
    how many tokens that sequence generated before.
    """
    if logits.device.type == "cpu":
        logits = logits.float()  # (on a CPU, argmax over bf16 is slower than the conversion)
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample(logits[rows], [params[i] for i in rows], [indices[i] for i in rows])
        tokens[rows] = picked
    return tokens.tolist()  # type: ignore[no-any-return]


def _sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=dev)
    scores = logits.float() / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kth = torch.topk(scores, max(ks), dim=-1).values  # [rows, max k], descending
        k = torch.tensor(ks, device=dev)
        floor = kth.gather(1, (k - 1).clamp(min=0)[:, None])
        floor = torch.where(k[:, None] > 0, floor, float("-inf"))
        scores = scores.masked_fill(scores < floor, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(draw_seed(p.seed, indices[i]))
            race[i].exponential_(generator=gen)
    # (q of 0 would make 0 / q undefined; exponential_ can round to it)
    return (probs / race.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
