"""What one forward pass runs on: tokens, positions, page-table rows and the DP layout."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence in this forward: `length` tokens after `start` cached ones.

    `cache_row` is the sequence's row of the KV cache's page table; `pages` the KV pages of
    its positions `0..start + length - 1`, in order (None: the row's contiguous pages,
    ``KVCache.contiguous_pages``)."""

    cache_row: int
    start: int
    length: int
    token_offset: int  # first row of this chunk in the flat local batch
    pages: tuple[int, ...] | None = None


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T_local]
    positions: torch.Tensor  # int64 [T_local]
    cache_rows: torch.Tensor  # int64 [T_local]: page-table row of every token
    chunks: list[SeqChunk]
    logit_rows: torch.Tensor  # int64 [L_local]: local rows whose next-token logits are wanted
    # DP-attention layout: local token and logit-row counts of every DP group, in group order.
    dp_token_counts: list[int] = field(default_factory=list)
    dp_logit_counts: list[int] = field(default_factory=list)
    # local rows of the chunks of one token, on the device the attention asked for
    _single_rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return all(c.length == 1 for c in self.chunks)

    def single_token_rows(self, device: torch.device) -> torch.Tensor:
        """int64 [S]: the local rows of the chunks of one token (in a mixed step, the
        running sequences' decodes), built once per batch and device."""
        rows = self._single_rows
        if rows is None or rows.device != device:
            host = torch.tensor(
                [c.token_offset for c in self.chunks if c.length == 1], dtype=torch.int64
            )
            rows = self._single_rows = host.to(device, non_blocking=True)
        return rows

    @classmethod
    def from_chunks(
        cls,
        token_ids: list[list[int]],
        chunks: list[SeqChunk],
        *,
        all_logits: bool,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Flatten per-sequence new tokens; logits for every row or each chunk's last row."""
        flat_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        logit_rows: list[int] = []
        for ids, chunk in zip(token_ids, chunks, strict=True):
            assert len(ids) == chunk.length and chunk.token_offset == len(flat_ids)
            flat_ids.extend(ids)
            positions.extend(range(chunk.start, chunk.start + chunk.length))
            rows.extend([chunk.cache_row] * chunk.length)
            if all_logits:
                logit_rows.extend(range(chunk.token_offset, chunk.token_offset + chunk.length))
            elif chunk.length:
                logit_rows.append(chunk.token_offset + chunk.length - 1)

        def as_long(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(
            input_ids=as_long(flat_ids),
            positions=as_long(positions),
            cache_rows=as_long(rows),
            chunks=chunks,
            logit_rows=as_long(logit_rows),
        )

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with its tensors on ``device`` (itself when they are there already).

        Executors build batches on the host; the runner moves them only for an eager forward,
        since a CUDA-graph step copies the host values into its own static buffers."""
        if self.input_ids.device == device:
            return self
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            cache_rows=self.cache_rows.to(device),
            logit_rows=self.logit_rows.to(device),
        )
