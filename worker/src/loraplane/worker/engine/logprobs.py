"""Log probabilities of a step's tokens, for the requests that ask for them.

A token's logprob is that of the model's own distribution at its position: ``log_softmax``
of the logits in float32, before temperature, top-k, top-p (vLLM's default, "raw"
logprobs), whatever the request sampled with. The top alternatives come from the same
distribution. Only the rows of requests that asked are computed (the sampler's fast path
is untouched otherwise): a step's sampled tokens (``SamplingParams.logprobs``) and, in a
prefill, the prompt's tokens (``SamplingParams.prompt_logprobs``), each from the logits of
the position before it; the first prompt token has none.

The values stay on the logits' device until ``DeviceLogprobs.read`` (after the step's ids
are read), so an overlapped step (ADR 0014) launches without waiting for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loraplane.worker.models.batch import upload

# The most alternatives a request may ask for at each position (OpenAI's limit too).
MAX_TOP_LOGPROBS = 20

# Rows put through one log_softmax at a time: a long prompt's float32 copy of its logits
# is then [ROWS_PER_PASS, vocab], not [prompt, vocab].
ROWS_PER_PASS = 256


class TokenLogprob(NamedTuple):
    """One position: the token there, its logprob, and the ``top`` most likely tokens of that
    position as ``(token id, logprob)``, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class LogprobRows:
    """What to compute: row ``rows[i]`` of a step's logits scores token ``targets[i]``, with
    ``tops[i]`` alternatives. ``targets`` may be on the device (a step's sampled ids)."""

    rows: list[int]
    targets: torch.Tensor  # int64 [len(rows)]
    tops: list[int]


class DeviceLogprobs:
    """``LogprobRows`` computed, still on the logits' device until ``read``."""

    def __init__(self, logits: torch.Tensor, want: LogprobRows) -> None:
        self.tops = want.tops
        width = max(want.tops, default=0)
        chosen, top_vals, top_ids = [], [], []
        for start in range(0, len(want.rows), ROWS_PER_PASS):
            rows = want.rows[start : start + ROWS_PER_PASS]
            index = upload(torch.tensor(rows, dtype=torch.int64), logits.device)
            lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [r, vocab]
            targets = want.targets[start : start + ROWS_PER_PASS]
            if targets.device != logits.device:
                targets = upload(targets, logits.device)
            chosen.append(lp.gather(1, targets[:, None])[:, 0])  # [r]
            if width:
                vals, ids = torch.topk(lp, min(width, lp.shape[-1]), dim=-1)  # [r, width]
                top_vals.append(vals)
                top_ids.append(ids)
        self.targets = want.targets
        self.chosen = torch.cat(chosen) if chosen else torch.empty(0)
        self.top_vals = torch.cat(top_vals) if top_vals else None
        self.top_ids = torch.cat(top_ids) if top_ids else None

    def read(self) -> list[TokenLogprob]:
        """Each row's ``TokenLogprob``, in ``LogprobRows`` order (on the host)."""
        targets = self.targets.tolist()
        chosen = self.chosen.tolist()
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = []
        for i, (token, logprob) in enumerate(zip(targets, chosen, strict=True)):
            k = self.tops[i]
            top: tuple[tuple[int, float], ...] = ()
            if k and vals is not None and ids is not None:
                top = tuple(zip(ids[i][:k], vals[i][:k], strict=True))
            out.append(TokenLogprob(token, logprob, top))
        return out


def reference_logprobs(
    logits: torch.Tensor, targets: Sequence[int], top: int
) -> list[TokenLogprob]:
    """The torch reference of ``DeviceLogprobs`` over every row of ``logits [n, vocab]``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i, token in enumerate(targets):
        vals, ids = torch.topk(lp[i], top) if top else (lp[i][:0], lp[i][:0].long())
        pairs = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
        out.append(TokenLogprob(token, float(lp[i, token]), pairs))
    return out
