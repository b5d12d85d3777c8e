"""Which rank does what: tp, dp, attn-TP (= tp / dp) and MoE-TP, over torch.distributed.

Rank layout of one worker with `tp` ranks and `dp` DP-attention groups: global rank r is in
DP group `r // attn_tp_size` at attn-TP rank `r % attn_tp_size`. The dense MLP, the routed
experts (MoE-TP = tp, no expert parallelism) and the LM head shard over all `tp` ranks;
attention shards over the `attn_tp_size` ranks of its DP group. With one rank every
collective is the identity, so the single-process model is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loraplane.worker.config import ConfigError


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    dp_attention: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ConfigError(f"tp and dp must be >= 1, got tp={self.tp} dp={self.dp}")
        if self.tp % self.dp:
            raise ConfigError(
                f"tp ({self.tp}) must be divisible by dp ({self.dp}): each DP-attention group "
                f"gets tp / dp ranks of attention tensor parallelism"
            )
        if self.dp > 1 and not self.dp_attention:
            raise ConfigError(
                f"dp={self.dp} needs --dp-attention; without it run {self.dp} separate workers "
                "(separate replicas of the pool) instead"
            )

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp


class ParallelState:
    """This rank's place in the worker and the collectives it joins."""

    def __init__(self, config: ParallelConfig, rank: int = 0) -> None:
        self.config = config
        self.tp_size = config.tp
        self.tp_rank = rank
        self.dp_size = config.dp
        self.attn_tp_size = config.attn_tp
        self.dp_rank = rank // self.attn_tp_size
        self.attn_tp_rank = rank % self.attn_tp_size
        self.moe_tp_size = config.tp
        self.moe_tp_rank = rank
        self.tp_group: Any = None
        self.attn_tp_group: Any = None
        if self.tp_size > 1:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed must be initialized before a ParallelState with tp > 1"
                )
            self.tp_group = dist.group.WORLD
            # Every rank must create every group, in the same order.
            for g in range(self.dp_size):
                ranks = list(range(g * self.attn_tp_size, (g + 1) * self.attn_tp_size))
                group = dist.new_group(ranks)
                if g == self.dp_rank:
                    self.attn_tp_group = group

    @classmethod
    def single(cls) -> ParallelState:
        return cls(ParallelConfig())

    @property
    def dp_attention(self) -> bool:
        """Attention runs DP-local and the MLP, experts and LM head TP-global over gathered rows.

        Only with more than one DP group: `--dp-attention` with dp = 1 is plain TP (attention
        TP = TP, nothing to gather). Every DP-attention decision reads this, not the config.
        """
        return self.config.dp_attention and self.dp_size > 1

    @property
    def is_single(self) -> bool:
        """One rank: no collective runs in a forward."""
        return self.tp_size == 1 and self.dp_size == 1

    # --- collectives -------------------------------------------------------------------

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_attn_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn_tp_size > 1:
            dist.all_reduce(x, group=self.attn_tp_group)
        return x

    def all_gather_tp(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Gather an equally-shaped tensor from every TP rank, in rank order."""
        if self.tp_size == 1:
            return [x]
        out = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(out, x.contiguous(), group=self.tp_group)
        return out

    def all_gather_object_tp(self, obj: Any) -> list[Any]:
        if self.tp_size == 1:
            return [obj]
        out: list[Any] = [None] * self.tp_size
        dist.all_gather_object(out, obj, group=self.tp_group)
        return out

    def dp_group_leaders(self) -> list[int]:
        """The first rank of every DP group: the one whose local tokens represent the group."""
        return [g * self.attn_tp_size for g in range(self.dp_size)]
