"""What one forward pass runs on: tokens, positions, page-table rows and the DP layout."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

# Queries per tile of the prompt attention kernel (``kernels.extend_attention``'s ``block_m``):
# 64 query rows x 64 keys per step, d 128 in bf16, is the flash-attention forward's usual
# H100 block.
PROMPT_TILE = 64


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


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``. On CUDA through page-locked memory and without
    waiting: a copy from pageable memory that waits (``non_blocking=False``) first waits
    for every kernel queued on the stream, which would stall an overlapped step (ADR 0014)
    behind the step still running."""
    if torch.device(device).type == "cuda":
        # (into a fresh page-locked buffer: ``host.pin_memory()`` first asks the driver
        # whether ``host`` is pinned already: 59 us a call under torch.profiler on an H100 host)
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        return pinned.copy_(host).to(device, non_blocking=True)
    return host.to(device)


def prompt_tiles(chunks: list[SeqChunk], block_m: int) -> list[tuple[int, int, int, int]]:
    """The chunks of two or more tokens cut into tiles of at most ``block_m`` consecutive
    queries, each ``(first local row, page-table row, first position, queries)``: the work
    list of ``kernels.extend_attention`` (``ForwardBatch.prompt_tiles`` uploads it; a prompt
    graph copies it into its static buffer)."""
    return [
        (c.token_offset + i, c.cache_row, c.start + i, min(block_m, c.length - i))
        for c in chunks
        if c.length > 1
        for i in range(0, c.length, block_m)
    ]


@dataclass(frozen=True, slots=True)
class SingleTokens:
    """A batch's chunks of one token, on one device: local rows, int64 [S] each."""

    rows: torch.Tensor
    cache_rows: torch.Tensor
    positions: torch.Tensor


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
    # Rows past the batch's tokens that no chunk covers (a captured mixed step's padding,
    # engine/prompt_graphs.py): their attention output is zeroed, not left unwritten.
    padded: bool = False
    # the chunks of one token, on the device the attention asked for (``single_tokens``)
    _singles: SingleTokens | None = field(default=None, init=False, repr=False)
    # the prompt chunks' tiles and causal masks, per (device, block_m) and device
    _tiles: tuple[torch.device, int, torch.Tensor] | None = field(
        default=None, init=False, repr=False
    )
    _masks: tuple[torch.device, list[torch.Tensor | None]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return all(c.length == 1 for c in self.chunks)

    def single_tokens(self, device: torch.device) -> SingleTokens:
        """The chunks of one token (in a mixed step, the running sequences' decodes): their
        local rows, page-table rows and positions, built once per batch and device (every
        layer attends them; gathering the rows' values per layer would be two more launches
        a layer)."""
        singles = self._singles
        if singles is None or singles.rows.device != device:
            host = torch.tensor(
                [c.token_offset for c in self.chunks if c.length == 1], dtype=torch.int64
            )
            rows = upload(host, device)
            singles = self._singles = SingleTokens(
                rows, self.cache_rows.to(device)[rows], self.positions.to(device)[rows]
            )
        return singles

    def prompt_tiles(self, device: torch.device, block_m: int = PROMPT_TILE) -> torch.Tensor:
        """int32 [tiles, 4]: the chunks of two or more tokens cut into tiles of at most
        ``block_m`` consecutive queries, each ``(first local row, page-table row, first
        position, queries)``: the work list of ``kernels.extend_attention``, built once per
        batch (one small host-to-device copy), not per layer."""
        cached = self._tiles
        if cached is not None and cached[0] == device and cached[1] == block_m:
            return cached[2]
        if block_m < 1:
            raise ValueError(f"prompt_tiles: block_m must be >= 1, got {block_m}")
        tiles = prompt_tiles(self.chunks, block_m)
        rows = upload(torch.tensor(tiles, dtype=torch.int32).reshape(len(tiles), 4), device)
        self._tiles = (device, block_m, rows)
        return rows

    def prompt_masks(self, device: torch.device) -> list[torch.Tensor | None]:
        """Per chunk, the causal mask bool [length, start + length] of a chunk of two or more
        tokens past a cached prefix (None for the others: from position 0, a chunk is causal
        as it stands): the CPU path's masks, built once per batch, not per layer."""
        cached = self._masks
        if cached is not None and cached[0] == device:
            return cached[1]
        masks: list[torch.Tensor | None] = []
        for c in self.chunks:
            if c.length < 2 or c.start == 0:
                masks.append(None)
                continue
            total = c.start + c.length
            qpos = torch.arange(c.start, total, device=device)
            kpos = torch.arange(total, device=device)
            masks.append(kpos[None, :] <= qpos[:, None])  # [Lq, Lk]
        self._masks = (device, masks)
        return masks

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
            input_ids=upload(self.input_ids, device),
            positions=upload(self.positions, device),
            cache_rows=upload(self.cache_rows, device),
            logit_rows=upload(self.logit_rows, device),
        )
