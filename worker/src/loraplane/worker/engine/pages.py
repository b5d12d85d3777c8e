"""Which KV pages each running sequence holds, and the prefixes kept for reuse: one pool of
pages per DP group.

Plain Python (the tensors are ``models/kv_cache.py``'s). A sequence is admitted only with a
*reservation* of every page it can ever need, ``pages_for(min(prompt + max_new_tokens,
max_model_len))``, so no step runs out of pages mid-decode (ADR 0015); it takes pages as its
tokens reach them, and gives back the taken pages and the rest of its reservation when it ends
(finished or aborted).

**Prefix cache.** A full page of a prompt is a *block*, keyed by its tokens, the block before
it (by id: the key is a hash chain without collisions) and the adapter version the KV was
computed under (``Sequence.adapter_key``; None for the base model): KV computed under adapter
A (its q/k/v deltas) is not KV under B, the base or A's next version. Once a sequence's
prefill is launched its full prompt pages are registered as blocks; a later sequence of the
same adapter version whose prompt starts with the same blocks takes those pages (shared,
reference-counted) and skips their prefill. A block no sequence holds stays cached until
its page is needed: pages are taken from the free list first, then from the least recently
used idle blocks (leaves before the blocks they extend).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# (id of the block before, or 0 for the first; adapter version key; the page's tokens)
BlockKey = tuple[int, str | None, tuple[int, ...]]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` positions."""
    return -(-tokens // page_size)


@dataclass(eq=False, slots=True)
class PageLease:
    """One sequence's pages (in position order) and the pages still reserved for it."""

    pages: list[int] = field(default_factory=list)
    reserved: int = 0
    cached: int = 0  # leading positions whose KV came from the prefix cache
    registered: int = 0  # leading pages that are blocks of the prefix cache
    last_block: int = 0  # id of the block of page ``registered - 1`` (0: none)


@dataclass(eq=False, slots=True)
class _Block:
    key: BlockKey
    page: int
    id: int
    refs: int = 0  # leases holding the page


class PagePool:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"a KV page pool needs num_pages >= 1 and page_size >= 1, "
                f"got {num_pages} and {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self.reserved = 0  # pages promised to leases and not taken yet
        self._blocks: dict[BlockKey, _Block] = {}
        self._by_page: dict[int, _Block] = {}
        self._idle: OrderedDict[int, _Block] = OrderedDict()  # held by no lease, LRU first
        self._next_id = 1
        self.evictions = 0  # idle blocks whose page was taken back

    @property
    def available(self) -> int:
        """Pages a new lease may reserve: free ones and those of idle cached blocks."""
        return len(self.free) + len(self._idle) - self.reserved

    @property
    def used(self) -> int:
        """Pages held by sequences (taken, not merely reserved)."""
        return self.num_pages - len(self.free) - len(self._idle)

    @property
    def cached(self) -> int:
        """Pages of cached prefix blocks that no sequence holds (reused or evicted on demand)."""
        return len(self._idle)

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` positions can ever fit this pool."""
        return pages_for(tokens, self.page_size) <= self.num_pages

    def _match(self, adapter: str | None, prompt: Sequence[int]) -> list[_Block]:
        """The cached blocks the prompt starts with (leaving its last token to compute: its
        logits are the first sampled token's)."""
        blocks: list[_Block] = []
        if not self.prefix_cache:
            return blocks
        ps, parent = self.page_size, 0
        for i in range((len(prompt) - 1) // ps):
            block = self._blocks.get((parent, adapter, tuple(prompt[i * ps : (i + 1) * ps])))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        return blocks

    def cost(self, tokens: int, adapter: str | None = None, prompt: Sequence[int] = ()) -> int:
        """Pages of ``available`` a lease of this sequence would use (its prefix hits count
        only when they are idle)."""
        hits = self._match(adapter, prompt)
        return pages_for(tokens, self.page_size) - len(hits) + sum(1 for b in hits if not b.refs)

    def lease(
        self, tokens: int, adapter: str | None = None, prompt: Sequence[int] = ()
    ) -> PageLease | None:
        """A lease for a sequence of ``tokens`` positions: the pages of the cached blocks its
        ``prompt`` starts with (under ``adapter``'s version) and a reservation of the rest; or
        None while too few pages are free (the sequence waits)."""
        hits = self._match(adapter, prompt)
        need = pages_for(tokens, self.page_size) - len(hits)
        if need + sum(1 for b in hits if not b.refs) > self.available:
            return None
        for block in hits:
            if not block.refs:
                del self._idle[block.page]
            block.refs += 1
        self.reserved += need
        return PageLease(
            pages=[b.page for b in hits],
            reserved=need,
            cached=len(hits) * self.page_size,
            registered=len(hits),
            last_block=hits[-1].id if hits else 0,
        )

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        page, block = self._idle.popitem(last=False)
        del self._blocks[block.key]
        del self._by_page[page]
        self.evictions += 1
        return page

    def cover(self, lease: PageLease, tokens: int) -> tuple[int, ...]:
        """The lease's pages after taking, from its reservation, those that positions
        ``0..tokens - 1`` need."""
        missing = pages_for(tokens, self.page_size) - len(lease.pages)
        if missing > lease.reserved:
            raise RuntimeError(
                f"a sequence needs {missing} more KV pages for {tokens} positions and has "
                f"{lease.reserved} reserved: its reservation was too small"
            )
        for _ in range(max(0, missing)):
            lease.pages.append(self._take())
            lease.reserved -= 1
            self.reserved -= 1
        return tuple(lease.pages)

    def register(self, lease: PageLease, adapter: str | None, prompt: Sequence[int]) -> None:
        """Make the lease's full prompt pages blocks of the prefix cache (once the step that
        writes their KV is launched: a later step reads them after it, in stream order). A
        block cached meanwhile by another sequence stays that one's; this page stays private."""
        if not self.prefix_cache:
            return
        ps, parent = self.page_size, lease.last_block
        for i in range(lease.registered, min(len(prompt) // ps, len(lease.pages))):
            key = (parent, adapter, tuple(prompt[i * ps : (i + 1) * ps]))
            block = self._blocks.get(key)
            if block is None:
                block = _Block(key, lease.pages[i], self._next_id, refs=1)
                self._next_id += 1
                self._blocks[key] = block
                self._by_page[block.page] = block
            parent = block.id
            lease.registered, lease.last_block = i + 1, parent

    def release(self, lease: PageLease) -> None:
        """Give back the lease's pages (its blocks stay cached while idle) and the rest of
        its reservation."""
        for page in reversed(lease.pages):  # (leaves first: they are evicted before parents)
            block = self._by_page.get(page)
            if block is None:
                self.free.append(page)
                continue
            block.refs -= 1
            if not block.refs:
                self._idle[page] = block
        self.reserved -= lease.reserved
        lease.pages, lease.reserved = [], 0
