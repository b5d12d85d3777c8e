"""Sampling parameters (OpenAI / SGLang semantics) and the sampler of one sequence's logits."""

from __future__ import annotations

import math
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


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from `logits` [vocab] (fp32, CPU)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature  # [vocab]
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
