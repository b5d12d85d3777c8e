"""The paged KV cache (models/kv_cache.py, engine/pages.py, ADR 0015): requests on pages
scattered over a small pool get the tokens they get alone, requests wait for pages rather
than fail, pages of finished and aborted requests are reused, and a request that could never
fit is refused with its length and the pool's."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.engine_requests import start
from tests.unit.runtime.test_overlapped_steps import make_engine as overlapped_engine

from loraplane.worker.config import ConfigError
from loraplane.worker.engine.engine import Engine, RequestTooLongError
from loraplane.worker.engine.executor import LocalExecutor, SeqWork, StepResult
from loraplane.worker.engine.pages import PageLease, PagePool
from loraplane.worker.engine.residency import Residency
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.engine.scheduler import Scheduler
from loraplane.worker.engine.sequence import SeqEvent
from loraplane.worker.server import protocol as p
from loraplane.worker.server.app import ApiError, WorkerServer
from loraplane.worker.server.engine_client import InThreadEngineClient
from loraplane.worker.server.factory import ServeConfig
from loraplane.worker.server.metrics import WorkerMetrics
from loraplane.worker.server.serve import build_server

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [17, 4, 88], [250, 3, 3, 61, 7], [12, 140], [99, 98, 97], [7]]
TOKENS = 10


# --- the page pool (plain Python) ----------------------------------------------------------


def test_a_lease_takes_pages_as_its_tokens_reach_them_and_gives_all_back() -> None:
    pool = PagePool(6, 4)
    a = pool.lease(9)  # 3 pages reserved
    assert a is not None and pool.available == 3 and pool.used == 0
    assert pool.cover(a, 4) == (0,)  # one page taken from the reservation
    assert pool.cover(a, 5) == (0, 1) and pool.available == 3 and pool.used == 2
    assert pool.lease(13) is None  # 4 pages: only 3 are not promised; nothing changed
    assert pool.available == 3
    b = pool.lease(12)
    assert b is not None and pool.available == 0
    with pytest.raises(RuntimeError, match="needs 2 more KV pages for 13 positions and has 1"):
        pool.cover(a, 13)
    pool.release(a)
    assert pool.available == 3 and pool.used == 0
    # the freed pages are the next ones handed out
    assert set(pool.cover(b, 12)) == {0, 1, 2}


def test_a_pool_says_what_can_ever_fit() -> None:
    pool = PagePool(3, 16)
    assert pool.fits(48) and not pool.fits(49)
    with pytest.raises(ValueError, match="num_pages >= 1 and page_size >= 1, got 0 and 16"):
        PagePool(0, 16)


# --- the engine over a small pool ----------------------------------------------------------


class PageRecorder(LocalExecutor):
    """The real one-rank executor, keeping the pages each row of each step was given."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.steps: list[list[SeqWork]] = []

    def step(self, work: list[list[SeqWork]]) -> list[StepResult]:
        self.steps.append(list(work[0]))
        return super().step(work)


def make_engine(
    model_dir: Path,
    *,
    kv_pages: int | None,
    page_size: int,
    max_running: int = 4,
    recorder: type[PageRecorder] = PageRecorder,
) -> Engine:
    return overlapped_engine(
        model_dir,
        False,
        max_running,
        executor_cls=recorder,
        max_seqs=max_running,
        runner_kw={"page_size": page_size, "kv_pages": kv_pages},
    )


@pytest.fixture(scope="module")
def alone(suite: dict[str, Any]) -> Iterator[list[list[int]]]:
    """Each prompt's greedy tokens, one request at a time in a pool of full rows."""
    engine = make_engine(suite["llama"][0], kv_pages=None, page_size=16, max_running=1)
    try:
        out = []
        for i, prompt in enumerate(PROMPTS):
            tokens, done = start(engine, prompt, None, TOKENS, f"alone{i}")
            assert done.wait(120)
            out.append(tokens)
        yield out
    finally:
        engine.stop()


def test_requests_on_scattered_pages_get_their_tokens_and_wait_for_pages(
    suite: dict[str, Any], alone: list[list[int]]
) -> None:
    """Pages of 4 positions in a pool of 12: each request reserves 3-4 pages, so at most three
    run at once and the others wait for pages (not for rows: there are four). Every request
    gets the tokens it gets alone; the pages of the finished ones went to the later ones; at
    the end every page is free."""
    engine = make_engine(suite["llama"][0], kv_pages=12, page_size=4)
    try:
        with engine._lock:  # (one step admits what fits of them all)
            started = [
                start(engine, prompt, None, TOKENS, f"r{i}") for i, prompt in enumerate(PROMPTS)
            ]
        for _, done in started:
            assert done.wait(120), "a request did not finish"
        assert [out for out, _ in started] == alone
        executor: PageRecorder = engine.executor  # type: ignore[assignment]
        assert max(len(work) for work in executor.steps) == 3  # pages, not rows, bounded it
        owners: dict[int, set[int]] = {}
        for work in executor.steps:
            for w in work:
                assert w.pages is not None and len(w.pages) * 4 >= w.start + len(w.tokens)
                for page in w.pages:
                    owners.setdefault(page, set()).add(w.cache_row * 1000 + w.tokens[0])
        assert set(owners) <= set(range(12))
        assert any(len(o) > 1 for o in owners.values())  # a freed page was handed out again
        with engine._lock:
            assert engine.pools[0].used == 0 and engine.pools[0].available == 12
            state = p.LoRAStateResponse.model_validate(engine.lora_state()).model_dump()
        group = state["dp_groups"][0]  # (what GET /lora_state answers)
        assert group["kv_pages_used"] == 0 and group["kv_pages_total"] == 12
        assert group["kv_pages_cached"] > 0  # the prompts' full pages, cached, held by none
        assert state["prefix_cache"] == [
            {
                "adapter": None,
                "hits": 0,
                "misses": len(PROMPTS),
                "cached_tokens": 0,
                "prompt_tokens": sum(len(prompt) for prompt in PROMPTS),
            }
        ]
    finally:
        engine.stop()


def test_pages_of_aborted_requests_are_freed_and_reused(
    suite: dict[str, Any], alone: list[list[int]]
) -> None:
    """A pool that holds one request at a time: a request aborted mid-decode gives its pages
    back, and the request waiting behind it runs on them to the same tokens as alone."""
    engine = make_engine(suite["llama"][0], kv_pages=4, page_size=4)
    try:
        got_two = threading.Event()
        ended = threading.Event()
        seen: list[int] = []

        def sink(event: SeqEvent) -> None:
            seen.extend(event.token_ids)
            if len(seen) >= 2:
                got_two.set()
            if event.finished:
                ended.set()

        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        with engine._lock:
            first = engine.submit("long", [1, 2, 3, 4], params, None, sink)
            tokens, done = start(engine, PROMPTS[0], None, TOKENS, "after")
        assert got_two.wait(120)
        with engine._lock:
            assert engine.pools[0].available == 0 and len(engine.scheduler.waiting) == 1
        engine.abort(first)
        assert ended.wait(120) and done.wait(120)
        assert tokens == alone[0]
        executor: PageRecorder = engine.executor  # type: ignore[assignment]
        steps = executor.steps  # (one request at a time: the aborted one's steps, then the next)
        second = next(i for i, work in enumerate(steps) if work[0].tokens == tuple(PROMPTS[0]))
        aborted_pages = {page for work in steps[:second] for w in work for page in w.pages or ()}
        next_pages = {page for work in steps[second:] for w in work for page in w.pages or ()}
        assert aborted_pages and aborted_pages < next_pages == {0, 1, 2, 3}  # reused
        with engine._lock:
            assert engine.pools[0].used == 0 and engine.pools[0].available == 4
    finally:
        engine.stop()


def test_a_request_larger_than_the_pool_is_refused(suite: dict[str, Any]) -> None:
    """Refused by the engine and, with a 400 naming the lengths, by the front end; nothing
    is queued, and a request that fits still runs."""
    engine = make_engine(suite["llama"][0], kv_pages=4, page_size=4)  # 16 positions
    try:
        params = SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True)
        with pytest.raises(RequestTooLongError, match=r"needs 17 KV positions .* holds 16"):
            engine.submit("big", [1, 2, 3, 4], params, None, lambda e: None)
        server = WorkerServer(
            InThreadEngineClient(engine, start=False),
            served_model="tiny-llama",
            model_root=str(suite["llama"][0]),
            allowed_lora_roots=(),
            metrics=WorkerMetrics(1, 1, 1),
            faults=None,
        )

        async def submit() -> None:
            server.start([1, 2, 3, 4], params, None, "big")

        with pytest.raises(ApiError) as refused:
            asyncio.run(submit())
        assert refused.value.status == 400
        assert "needs 17 KV positions (a 4-token prompt and max_tokens 13)" in str(refused.value)
        assert "KV pool holds 16: lower max_tokens to at most 12" in str(refused.value)
        with engine._lock:
            assert not engine.scheduler.waiting and not engine._incoming
        tokens, done = start(engine, [1, 2, 3, 4], None, 12)
        assert done.wait(120) and len(tokens) == 12
    finally:
        engine.stop()


# --- the prefix cache ----------------------------------------------------------------------


def test_a_cached_prefix_is_reused_only_under_its_adapter_version() -> None:
    """Blocks are keyed by adapter version: the same prompt under another adapter, the base
    model or the adapter's next version finds nothing; under the same version it finds every
    full page but the one holding the prompt's last token."""
    pool = PagePool(16, 4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full pages
    first = pool.lease(20, "a", prompt)
    assert first is not None and first.cached == 0
    pool.cover(first, 13)
    pool.register(first, "a", prompt)
    for other in ("b", None, "a@v2"):
        assert pool._match(other, prompt) == []
    again = pool.lease(20, "a", prompt)
    assert again is not None and again.cached == 12 and again.pages == first.pages[:3]
    shorter = pool.lease(20, "a", prompt[:12])  # its last token is on page 3: 2 pages hit
    assert shorter is not None and shorter.cached == 8
    assert len(pool._match("a", [*prompt[:4], 0, *prompt[5:]])) == 1  # the first page only


def test_idle_cached_prefixes_are_evicted_under_pressure_least_recently_used_first() -> None:
    """A cached block no sequence holds keeps its page until a lease needs it: the pool
    counts it available, and takes the least recently used one's page when the free list is
    empty (the leaf before the block it extends); the evicted prefix is no longer found."""
    pool = PagePool(4, 2)
    old, new = [1, 2, 3, 4, 5], [7, 8, 9]
    for prompt in (old, new):
        lease = pool.lease(len(prompt), None, prompt)
        assert lease is not None
        pool.cover(lease, len(prompt))
        pool.register(lease, None, prompt)
        pool.release(lease)
    # old: blocks [1,2] and [3,4] (page 2 freed: [5] is not a full page); new: block [7,8]
    assert pool.cached == 3 and pool.used == 0 and pool.available == 4
    taker = pool.lease(6)  # 3 pages: the free one, then old's leaf, then old's first block
    assert taker is not None
    pool.cover(taker, 6)
    assert pool.evictions == 2 and pool.cached == 1
    assert pool._match(None, old) == [] and len(pool._match(None, [*new, 0])) == 1
    pool.release(taker)
    assert pool.available == 4 and pool.used == 0


class LogitRecorder(PageRecorder):
    """Also keeps every step's logits (one row per sequence)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.logits: list[torch.Tensor] = []
        forward = self.runner.forward

        def recording(*a: Any, **k: Any) -> torch.Tensor:
            out = forward(*a, **k)
            self.logits.append(out.detach().clone())
            return out

        self.runner.forward = recording  # type: ignore[method-assign]


def one_request(
    engine: Engine, prompt: list[int], adapter: str | None
) -> tuple[list[int], list[SeqWork], torch.Tensor]:
    """A greedy request alone: its tokens, its rows of work and its first token's logits."""
    executor: LogitRecorder = engine.executor  # type: ignore[assignment]
    before = len(executor.steps)
    tokens, done = start(engine, prompt, adapter, 4)
    assert done.wait(120)
    return tokens, [w[0] for w in executor.steps[before:]], executor.logits[before][0]


@pytest.fixture(scope="module")
def prefix_engines(suite: dict[str, Any]) -> Iterator[tuple[Engine, Engine, dict[str, Path]]]:
    """Two engines over pages of 4, with the adapters a8 and a16: one whose prefix cache the
    test fills, and one whose every request runs fresh (a new prompt each time)."""
    model_dir, adapters = suite["llama"][0], dict(suite["llama"][1])
    engines = []
    for _ in range(2):
        engine = make_engine(
            model_dir, kv_pages=None, page_size=4, max_running=2, recorder=LogitRecorder
        )
        for name in ("a8", "a16"):
            assert engine.load_adapter(name, str(adapters[name])).result(60).success
        engines.append(engine)
    try:
        yield engines[0], engines[1], adapters
    finally:
        for engine in engines:
            engine.stop()


def test_a_prefix_cached_under_one_adapter_is_not_reused_by_another_or_the_base(
    prefix_engines: tuple[Engine, Engine, dict[str, Path]], tmp_path: Path
) -> None:
    """The prompt's KV cached under a8: the same prompt under a16, the base model and a8's
    next version prefills it all again, and their first logits equal a fresh engine's; under
    a8 again the cached 12 positions are not recomputed (one token is), with the same
    logits and tokens as fresh."""
    engine, fresh, adapters = prefix_engines
    prompt = [5, 9, 200, 31, 17, 4, 88, 250, 3, 3, 61, 7, 12]  # 13 tokens: 3 full pages
    first, work, _ = one_request(engine, prompt, "a8")
    assert work[0].start == 0 and len(work[0].tokens) == 13
    for adapter in ("a16", None):
        tokens, work, logits = one_request(engine, prompt, adapter)
        want_tokens, _, want = one_request(fresh, prompt, adapter)
        assert work[0].start == 0 and len(work[0].tokens) == 13  # no prefix reused
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    tokens, work, logits = one_request(engine, prompt, "a8")
    want_tokens, _, want = one_request(fresh, prompt, "a8")
    assert work[0].start == 12 and work[0].tokens == (12,)  # the prefill of 12 skipped
    assert work[0].pages is not None and tokens == first == want_tokens
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    stats = {s["adapter"]: s for s in engine.lora_state()["prefix_cache"]}
    assert stats["a8"]["hits"] == 1 and stats["a8"]["cached_tokens"] == 12
    assert stats["a16"]["hits"] == 0 and stats[None]["hits"] == 0
    # a8's next version (the same weights from another path) finds nothing of version 1
    copy = tmp_path / "a8-v2"
    shutil.copytree(adapters["a8"], copy)
    assert engine.load_adapter("a8", str(copy)).result(60).success
    _, work, _ = one_request(engine, prompt, "a8")
    assert work[0].start == 0 and len(work[0].tokens) == 13


def test_a_request_scoring_its_prompt_takes_no_cached_prefix(
    prefix_engines: tuple[Engine, Engine, dict[str, Path]],
) -> None:
    """Prompt log probabilities are read from the prefill's logits: a request asking for
    them prefills its whole prompt though its prefix is cached, and gets one per token."""
    engine, _, _ = prefix_engines
    prompt = [7, 7, 19, 3, 41, 8, 8, 120, 5, 66, 2, 9, 30]  # 13 tokens: 3 full pages
    one_request(engine, prompt, "a16")  # (now cached under a16)
    executor: LogitRecorder = engine.executor  # type: ignore[assignment]
    before = len(executor.steps)
    events: list[SeqEvent] = []
    done = threading.Event()

    def sink(event: SeqEvent) -> None:
        events.append(event)
        if event.finished:
            done.set()

    scored = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine.submit("scored", prompt, scored, "a16", sink)
    assert done.wait(120)
    work = executor.steps[before][0]
    assert work.start == 0 and len(work.tokens) == 13  # no cached page taken
    assert len([lp for e in events for lp in e.prompt_logprobs or ()]) == 12


# --- admission and configuration -----------------------------------------------------------


@dataclass(eq=False)
class Req:
    prompt_ids: list[int]
    kv_tokens: int
    adapter_key: str | None = None
    dp_group: int = -1
    cache_row: int = -1
    slot: int = -1
    kv: PageLease | None = None

    @property
    def shareable_prompt(self) -> list[int]:
        return self.prompt_ids


def test_admission_reserves_pages_and_waits_in_order() -> None:
    """Rows free, but a request waits while its pages cannot be reserved; FIFO: the ones
    behind it wait too, even one that would fit. Finishing gives the pages back."""
    pool = PagePool(9, 4)
    s = Scheduler(1, 8, 8, Residency(1, 1), [pool])
    reqs = [Req([1] * 10, 16), Req([2] * 10, 16), Req([3] * 20, 32), Req([4] * 2, 4)]
    for r in reqs:
        s.add(r)
    assert s.schedule().admitted == reqs[:2]  # 8 pages reserved; the third needs 8 more
    assert pool.available == 1 and list(s.waiting) == reqs[2:]  # the fourth (1 page) waits
    s.finish(reqs[0])
    assert s.schedule().admitted == [] and pool.available == 5
    s.finish(reqs[1])
    assert s.schedule().admitted == reqs[2:] and pool.available == 0


def test_serve_flags_of_the_pool_are_checked() -> None:
    with pytest.raises(ConfigError, match="--kv-tokens must be >= 1, got 0"):
        ServeConfig(model="m", kv_tokens=0)
    with pytest.raises(ConfigError, match=r"--mem-fraction must be in \(0, 1\).*got 1.5"):
        ServeConfig(model="m", mem_fraction=1.5)
    with pytest.raises(ValueError, match="kv_pages must be >= 1"):
        RunnerConfig("m", kv_pages=0)


def test_a_worker_with_its_engine_in_a_process_sizes_reports_and_refuses(
    suite: dict[str, Any],
) -> None:
    """--kv-tokens through the engine-core process: the front end knows the pool (and
    refuses what exceeds it with a 400), and the pool's size and prefix lookups reach its
    metrics."""
    server = build_server(
        ServeConfig(
            model=str(suite["llama"][0]),
            kv_tokens=32,  # two pages of 16
            max_running=2,
            max_model_len=64,
            lora_backend="torch",
        )
    )
    try:
        assert server.engine.kv_pool_tokens == 32
        too_long = SamplingParams(max_new_tokens=29, temperature=0.0, ignore_eos=True)

        async def submit() -> None:
            server.start([1, 2, 3, 4], too_long, None, "big")

        with pytest.raises(ApiError, match="needs 33 KV positions") as refused:
            asyncio.run(submit())
        assert refused.value.status == 400
        tokens, done = start(server.engine, [1, 2, 3, 4], None, 28)
        assert done.wait(120) and len(tokens) == 28
        registry = server.metrics.registry
        pages = registry.get_sample_value(
            "loraplane_worker_kv_pages", {"dp_group": "0", "state": "total"}
        )
        lookups = registry.get_sample_value(
            "loraplane_worker_prefix_lookups_total", {"adapter": "none", "result": "miss"}
        )
        assert pages == 2 and lookups == 1
    finally:
        server.engine.stop()
