"""Per-forward LoRA metadata: which rows use which adapter slot.

Tokens are grouped into segments of rows that share a slot. Rows with no adapter belong
to no segment, so they cost no LoRA work and their outputs are never touched. When the
rows of one slot are not contiguous, `row_order` gathers them (tokens sorted by slot,
stably, so the order inside a slot is the batch order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

NO_ADAPTER = -1


@dataclass(slots=True)
class LoRABatchInfo:
    token_slots: torch.Tensor  # int32 [T]: slot per row, -1 = no adapter
    seg_indptr: torch.Tensor  # int32 [S+1]
    seg_slots: torch.Tensor  # int32 [S]
    row_order: torch.Tensor | None  # int64 [rows in segments]; None = rows are 0..n-1 in order
    slot_ranks: torch.Tensor  # int32 [K]
    slot_scalings: torch.Tensor  # float32 [K]
    seg_ranks: torch.Tensor  # int32 [S]: slot_ranks[seg_slots], gathered once per forward
    seg_scalings: torch.Tensor  # float32 [S]: slot_scalings[seg_slots]
    max_seg_len: int
    num_rows: int
    num_lora_rows: int

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int],
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        device: torch.device | str,
    ) -> LoRABatchInfo | None:
        """Segments for `token_slots`, or None when no row has an adapter (base path)."""
        order = sorted(
            (i for i, s in enumerate(token_slots) if s != NO_ADAPTER), key=lambda i: token_slots[i]
        )
        if not order:
            return None
        indptr = [0]
        slots: list[int] = []
        for j, i in enumerate(order):
            if not slots or token_slots[i] != slots[-1]:
                if slots:
                    indptr.append(j)
                slots.append(token_slots[i])
        indptr.append(len(order))
        identity = order == list(range(len(order)))
        lens = [b - a for a, b in pairwise(indptr)]
        seg_slots = torch.tensor(slots, dtype=torch.int32, device=device)
        return cls(
            token_slots=torch.tensor(list(token_slots), dtype=torch.int32, device=device),
            seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            seg_slots=seg_slots,
            row_order=None if identity else torch.tensor(order, dtype=torch.int64, device=device),
            slot_ranks=slot_ranks,
            slot_scalings=slot_scalings,
            seg_ranks=slot_ranks.index_select(0, seg_slots),
            seg_scalings=slot_scalings.index_select(0, seg_slots),
            max_seg_len=max(lens),
            num_rows=len(token_slots),
            num_lora_rows=len(order),
        )

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.numel())
