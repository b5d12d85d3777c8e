"""A paged KV cache: K and V in pages of ``page_size`` positions, a page table per sequence row.

Every layer holds K and V as ``[pages, page_size, kv_heads, d]``. A running sequence owns a
*row* of the page table ``[rows, pages_per_row]`` (int32, on the device): entry ``i`` is the
page holding its positions ``i * page_size ..``. A token at position ``p`` of row ``r`` lives at
slot ``table[r, p // page_size] * page_size + p % page_size`` of the flat ``[slots, kv_heads,
d]`` view; its slot is computed on the device from the table (``slots``), so a decode step
captured in a CUDA graph reads the table's current entries at every replay.

Which pages a row holds is decided by the engine (``engine/pages.py``) and sent with each
chunk (``SeqChunk.pages``); ``sync_table`` writes the entries that changed since the last step.
A chunk without pages (callers that manage rows themselves: tests, the parity check, benches,
the warm-up) gets its row's *contiguous* pages ``row * pages_per_row + i``: with a pool of
``rows * pages_per_row`` pages (the default) the layout of one ``max_len`` row per sequence.
In a smaller pool they wrap around, so rows share pages: only for steps whose results are
not read (the warm-up's).

The last page is a spare, never handed out: the padding rows of a CUDA-graph step write
there (row ``rows - 1`` of the table maps to it when the runner has graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplane.worker.models.batch import ForwardBatch, SeqChunk, upload

DEFAULT_PAGE_SIZE = 16


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
    ) -> None:
        """``max_seqs`` table rows of ``max_len`` positions; ``num_pages`` pages to hand out
        (None: ``max_seqs`` full rows), plus the spare page."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.pages_per_row = -(-max_len // page_size)
        self.num_pages = max_seqs * self.pages_per_row if num_pages is None else num_pages
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        self.spare_page = self.num_pages
        shape = (self.num_pages + 1, page_size, kv_heads, head_dim)  # [pages, page, kv, d]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seqs = max_seqs
        self.max_len = max_len
        # [rows, pages_per_row]: every entry the spare page until a chunk gives the row pages
        self.page_table = torch.full(
            (max_seqs, self.pages_per_row), self.spare_page, dtype=torch.int32, device=device
        )
        # what the device table holds per row (host mirror, so a step writes only changes)
        self._rows: list[tuple[int, ...]] = [() for _ in range(max_seqs)]

    def contiguous_pages(self, row: int, tokens: int) -> tuple[int, ...]:
        """Row ``row``'s pages in the one-row-per-sequence layout (``SeqChunk.pages`` None),
        modulo the pool."""
        first = row * self.pages_per_row
        n = -(-tokens // self.page_size)
        return tuple((first + i) % self.num_pages for i in range(n))

    def sync_table(self, chunks: Sequence[SeqChunk]) -> None:
        """Write the page-table entries that ``chunks`` changed (on the host's order, before
        the forward that reads them)."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for c in chunks:
            total = c.start + c.length
            pages = c.pages if c.pages is not None else self.contiguous_pages(c.cache_row, total)
            if len(pages) * self.page_size < total:
                raise ValueError(
                    f"the chunk of row {c.cache_row} covers positions up to {total} and its "
                    f"{len(pages)} pages of {self.page_size} hold {len(pages) * self.page_size}"
                )
            have = self._rows[c.cache_row]
            keep = len(have) if pages[: len(have)] == have else 0
            if keep == len(pages):
                continue
            rows.extend([c.cache_row] * (len(pages) - keep))
            cols.extend(range(keep, len(pages)))
            values.extend(pages[keep:])
            self._rows[c.cache_row] = tuple(pages)
        if rows:
            device = self.page_table.device
            index = upload(torch.tensor([rows, cols], dtype=torch.int64), device)
            self.page_table[index[0], index[1]] = upload(
                torch.tensor(values, dtype=torch.int32), device
            )

    def point_at_spare(self, row: int) -> None:
        """Map every entry of ``row`` to the spare page (the CUDA graphs' padding row)."""
        self.page_table[row] = self.spare_page
        self._rows[row] = (self.spare_page,) * self.pages_per_row

    def slots(self, batch: ForwardBatch) -> torch.Tensor:
        """Each token's slot in the flat ``[slots, kv_heads, d]`` view, int64 [T], on the device
        (reads the page table: capturable)."""
        ps = self.page_size
        page = self.page_table[
            batch.cache_rows, torch.div(batch.positions, ps, rounding_mode="floor")
        ]
        return page.to(torch.int64) * ps + batch.positions % ps

    def row_keys(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``row``'s first ``length`` positions, ``[length, kv_heads, d]`` each."""
        n = -(-length // self.page_size)  # pages
        pages = self.page_table[row, :n].to(torch.int64)
        k = self.k[layer][pages].flatten(0, 1)[:length]
        v = self.v[layer][pages].flatten(0, 1)[:length]
        return k, v
