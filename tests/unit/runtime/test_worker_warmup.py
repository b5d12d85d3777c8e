"""The worker's warm-up (``engine.warmup``): what it runs, and that a user sees no trace of it
but the time it takes (no adapter loaded after it, the same tokens as a worker without it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tests.engine_requests import generate

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.executor import LocalExecutor
from loraplane.worker.engine.runner import RunnerConfig
from loraplane.worker.engine.warmup import plan_for, stage_ranks, warm_up
from loraplane.worker.server.factory import ServeConfig
from loraplane.worker.server.serve import build_server

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8]]


def test_the_plan_covers_every_bucket_stage_width_and_rank() -> None:
    plan = plan_for(max_seqs=64, max_len=4096, max_loras_per_batch=6, max_lora_rank=64)
    assert plan.decode_sizes == (1, 2, 4, 8, 16, 24, 32, 48, 64)  # every graph bucket
    assert plan.sampler_sizes == (1, 64)  # chunked and one program a row
    assert plan.ranks == (16, 32, 64)  # every stage rank
    assert plan.adapter_counts == (1, 2, 4, 6)  # stage widths 1, 2, 4 and K
    assert plan.stage_positions == ()  # (the executor's: plan_for's caller passes it)
    assert plan_for(64, 4096, 6, 64, stage_positions=16).stage_positions == (6, 6, 6)  # <= K
    # 2 positions of rank 64 hold 8 of rank 16 and 4 of rank 32 (lora.stage.positions_at)
    staged = plan_for(64, 4096, 16, 64, stage_positions=2)
    assert staged.stage_positions == (8, 4, 2) and staged.positions_at(32) == 4
    # staged or not, row blocks of 16, 32 and 64, multiple of 16 or not
    assert plan.prefill_tokens == (16, 29, 192, 205, 320, 333)
    moe = plan_for(64, 4096, 4, 64, experts=(128, 8))  # Qwen3-30B-A3B: 24 and 48 pairs an expert
    assert moe.prefill_tokens == (16, 29, 192, 205, 320, 333, 384, 397, 768, 781)
    assert stage_ranks(48) == (16, 32, 48) and stage_ranks(8) == (8,)
    short = plan_for(max_seqs=3, max_len=10, max_loras_per_batch=None, max_lora_rank=64)
    assert short.decode_sizes == (1, 2, 3) and short.ranks == () and short.adapter_counts == ()
    assert short.prefill_tokens == (16, 27)  # what 3 rows of 9 prompt tokens hold


def test_more_slots_than_running_rows_warm_what_a_step_can_hold(suite) -> None:  # type: ignore[no-untyped-def]
    """K above --max-running: a step holds at most max_running sequences, so at most that
    many adapters; the warm-up must keep to those KV rows (it wrote past them once)."""
    plan = plan_for(max_seqs=2, max_len=64, max_loras_per_batch=4, max_lora_rank=16)
    assert plan.adapter_counts == (1, 2) and plan.prefill_tokens == (16, 29, 126)
    model_dir, _ = suite["llama"]
    executor = LocalExecutor(
        RunnerConfig(str(model_dir), lora_backend="torch", max_seqs=2, max_len=64),
        LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=16),
    )
    report = warm_up(executor, plan)
    assert report.phases.keys() >= {"LoRA rank 16, 2 adapter(s)", "prefill 126 tokens"}
    assert executor.runner.lora is not None
    assert executor.runner.lora.slot_values()[0] == [0, 0, 0, 0]


def test_on_by_default_only_on_a_gpu() -> None:
    assert ServeConfig(model="m", device="cuda").warms_up
    assert not ServeConfig(model="m").warms_up
    assert ServeConfig(model="m", warmup=True).warms_up
    assert not ServeConfig(model="m", device="cuda", warmup=False).warms_up


@pytest.fixture(scope="module")
def servers(suite) -> Iterator[dict[bool, Any]]:  # type: ignore[no-untyped-def]
    model_dir, _ = suite["llama"]
    built: dict[bool, Any] = {}
    try:
        for warmup in (True, False):
            config = ServeConfig(
                model=str(model_dir),
                warmup=warmup,
                max_running=4,
                max_loras_per_batch=2,
                max_loaded_loras=2,
                max_lora_rank=32,
                max_model_len=64,
                engine_process=not warmup,  # the warmed engine is looked into, on a thread here
            )
            built[warmup] = build_server(config)
        yield built
    finally:
        for server in built.values():
            server.engine.stop()


def test_a_warmed_worker_starts_with_no_adapter_and_serves_the_same_tokens(  # type: ignore[no-untyped-def]
    suite, servers
) -> None:
    warmed, cold = servers[True], servers[False]
    state = warmed.engine.lora_state()
    assert state["loaded"] == 0 and state["adapters"] == []
    assert state["slots"] == [None, None]
    lora = warmed.engine.engine.executor.runner.lora
    assert all(a is None for a in lora.slot_adapters) and lora.slot_values()[0] == [0, 0]
    assert warmed.engine.engine.executor.host == {}  # the blank adapter was dropped
    seconds = "loraplane_worker_warmup_seconds"
    assert warmed.metrics.registry.get_sample_value(seconds) > 0
    assert cold.metrics.registry.get_sample_value(seconds) == 0

    adapters = dict(suite["llama"][1])
    for server in (warmed, cold):
        for name in ("a8", "a32"):
            assert server.engine.load_adapter(name, str(adapters[name])).result().success
    assert generate(warmed, PROMPTS, [None]) == generate(cold, PROMPTS, [None])
    assert generate(warmed, PROMPTS, ["a8", "a32", None]) == generate(
        cold, PROMPTS, ["a8", "a32", None]
    )


def test_start_up_adapters_are_checked_before_the_model_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A --lora the worker would refuse fails its start at once, not after the model's load
    and warm-up (a minute on a GPU): here there is no model at all to load."""
    from loraplane.worker.config import ConfigError

    missing = str(tmp_path / "no-model")
    for loras, roots, reason in (
        ((("no-model", "/adapters/a"),), (), "is the name of the served base model"),
        ((("a", "/elsewhere/a"),), ("/adapters",), "outside the allowed adapter roots"),
    ):
        config = ServeConfig(model=missing, warmup=True, loras=loras, allowed_lora_roots=roots)
        with pytest.raises(ConfigError, match=reason):
            build_server(config)


class _StageOnly:
    """An executor that runs nothing: it keeps the stage positions the warm-up's steps
    would assign (``lora.stage.Stage``, as a decode graph or a staged eager step assigns
    them) and records the LoRA decode graph each decode step would replay."""

    dp_size = 1

    def __init__(self, max_seqs: int, positions: int, max_rank: int, slots: int = 0) -> None:
        from types import SimpleNamespace

        from loraplane.worker.lora.stage import Stage

        class _Wrapper:
            def stage_copy(self, position: int, slot: int, rank: int) -> None:
                pass

        self.model_config = SimpleNamespace(vocab_size=100)
        self.max_seqs, self.max_len, self.stage_positions = max_seqs, 64, positions
        self.rank = 0
        self.stage = Stage(
            positions, [_Wrapper()], lambda _slot: self.rank, max_rank, limit=slots or None
        )
        self.graphs: set[tuple[Any, ...]] = set()

    def step(self, work: list[list[Any]]) -> list[Any]:
        from loraplane.worker.engine.graphs import graph_buckets
        from loraplane.worker.lora.batch_info import segments_of, static_shape
        from loraplane.worker.lora.stage import stage_width

        rows = work[0]
        slots = [w.slot for w in rows]
        segments = segments_of(slots)
        positions = self.stage.assign(segments[2]) if segments[2] else None
        decode = all(len(w.tokens) == 1 for w in rows)
        if decode and segments[2]:
            bucket = next(b for b in graph_buckets(self.max_seqs) if b >= len(rows))
            width = stage_width(positions.values(), self.stage.positions) if positions else 0
            rank = self.stage.rank if positions else 0
            self.graphs.add((bucket, static_shape(segments, bucket), width, rank))
        return []

    def load_slot(self, slot: int, name: str) -> None:
        self.stage.forget(slot)

    def clear_slot(self, slot: int) -> None:
        self.stage.forget(slot)

    def hold_blank(self, name: str, rank: int) -> None:
        self.rank = rank

    def drop_adapter(self, name: str) -> None:
        pass


def _reachable_graphs(
    max_seqs: int, slots: int, positions: int, ranks: tuple[int, ...]
) -> set[tuple[Any, ...]]:
    """Every LoRA decode graph key a batch of at most ``max_seqs`` rows over ``slots`` slots
    can meet: each multiset of rows (a slot or none per row), at each stage width its
    adapters' positions can give and each stage rank (``positions`` of the largest rank,
    more of a smaller one), or unstaged past the positions."""
    from itertools import combinations_with_replacement

    from loraplane.worker.engine.graphs import graph_buckets
    from loraplane.worker.engine.warmup import stage_widths
    from loraplane.worker.lora.batch_info import segments_of, static_shape
    from loraplane.worker.lora.stage import positions_at

    keys = set()
    for n in range(1, max_seqs + 1):
        bucket = next(b for b in graph_buckets(max_seqs) if b >= n)
        for rows in combinations_with_replacement(range(-1, slots), n):
            segments = segments_of(list(rows))
            count = len(segments[2])
            if not count:
                continue
            shape = static_shape(segments, bucket)
            for rank in ranks:
                room = positions_at(positions, ranks[-1], rank, slots)
                if count > room:
                    keys.add((bucket, shape, 0, 0))
                keys |= {(bucket, shape, width, rank) for width in stage_widths(count, room)}
    return keys


@pytest.mark.parametrize(
    ("max_seqs", "slots", "positions"),
    [(8, 4, 2), (6, 3, 3), (5, 2, 0), (40, 3, 2), (8, 8, 1), (8, 6, 4)],
)
def test_the_warm_up_captures_every_lora_decode_graph_a_batch_can_need(
    max_seqs: int, slots: int, positions: int
) -> None:
    """Stage positions of rank 32 (so twice as many at 16), with the window that keeps a
    batch of 4 or fewer adapters at most 4 positions wide."""
    plan = plan_for(max_seqs, 64, slots, 32, stage_positions=positions)
    executor = _StageOnly(max_seqs, positions, 32, slots)
    warm_up(executor, plan)  # type: ignore[arg-type]
    reachable = _reachable_graphs(max_seqs, slots, positions, plan.ranks)
    assert reachable - executor.graphs == set()
    assert executor.graphs - reachable == set()  # (the test's enumeration misses nothing)


class _DPKeys(_StageOnly):
    """``_StageOnly`` of a DP-attention worker of ``dp`` groups, whose ranks do not stage: the
    LoRA decode graph of a step is keyed by the bucket of its largest group and the static
    shape of every group's slots padded to that bucket (``DecodeGraphs._dp_lora_shape``)."""

    def __init__(self, max_seqs: int, dp: int) -> None:
        super().__init__(max_seqs, 0, 32)
        self.dp_size = dp

    def step(self, work: list[list[Any]]) -> list[Any]:
        assert len(work) == self.dp_size
        if all(all(len(w.tokens) == 1 for w in rows) for rows in work):
            self.graphs |= {_dp_key(self.max_seqs, [[w.slot for w in rows] for rows in work])}
        return []


def _dp_key(max_seqs: int, groups: list[list[int]]) -> tuple[Any, ...]:
    from loraplane.worker.engine.graphs import graph_buckets
    from loraplane.worker.lora.batch_info import segments_of, static_shape

    rows = max(len(g) for g in groups)
    bucket = next(b for b in graph_buckets(max_seqs) if b >= rows)
    padded = [s for g in groups for s in (*g, *[-1] * (bucket - len(g)))]
    segments = segments_of(padded)
    return (bucket, static_shape(segments, len(padded)) if segments[2] else None)


@pytest.mark.parametrize(("max_seqs", "slots"), [(6, 2), (4, 3), (2, 3)])
def test_the_warm_up_captures_every_dp_lora_decode_graph_a_step_can_need(
    max_seqs: int, slots: int
) -> None:
    """Two DP groups, each with any batch of at most ``max_seqs`` rows (or none): every LoRA
    graph key their steps can meet is one the warm-up's steps met (with 2 rows a group, 3
    adapters in a step: more than one group's rows hold)."""
    from itertools import combinations_with_replacement, product

    plan = plan_for(max_seqs, 64, slots, 32, dp=2)
    executor = _DPKeys(max_seqs, 2)
    warm_up(executor, plan)  # type: ignore[arg-type]
    batches = [
        list(rows)
        for n in range(max_seqs + 1)
        for rows in combinations_with_replacement(range(-1, slots), n)
    ]
    steps = {_dp_key(max_seqs, [a, b]) for a, b in product(batches, batches) if a or b}
    reachable = {key for key in steps if key[1] is not None}
    captured = {key for key in executor.graphs if key[1] is not None}
    assert reachable - captured == set()
    assert captured - reachable == set()  # (the test's enumeration misses nothing)


@pytest.mark.parametrize(("max_seqs", "slots"), [(24, 32), (48, 40), (12, 16)])
def test_the_warm_up_captures_the_lora_graphs_of_buckets_with_fewer_rows_than_slots(
    max_seqs: int, slots: int
) -> None:
    """More slots than a bucket's rows (no stage): a graph's segment count is capped at the
    bucket, so 17 to 24 adapters at bucket 24 meet a graph of their own. Every batch shape
    (rows, distinct adapters, rows with an adapter, the longest segment) is enumerated: the
    warm-up met the LoRA graph of each."""
    from loraplane.worker.engine.graphs import graph_buckets
    from loraplane.worker.lora.batch_info import segments_of, static_shape

    plan = plan_for(max_seqs, 64, slots, 32, stage_positions=0)
    executor = _StageOnly(max_seqs, 0, 32)
    warm_up(executor, plan)  # type: ignore[arg-type]
    reachable = set()
    for n in range(1, max_seqs + 1):
        bucket = next(b for b in graph_buckets(max_seqs) if b >= n)
        for k in range(1, min(n, slots) + 1):
            for m in range(k, n + 1):  # rows with an adapter
                for longest in range(-(-m // k), m - k + 2):
                    rest = m - longest  # over the k - 1 other adapters, 1 to `longest` each
                    sizes = (
                        [longest] + [rest // (k - 1) + (i < rest % (k - 1)) for i in range(k - 1)]
                        if k > 1
                        else [longest]
                    )
                    rows = [-1] * (n - m) + [s for s, size in enumerate(sizes) for _ in range(size)]
                    reachable.add((bucket, static_shape(segments_of(rows), bucket), 0, 0))
    assert reachable - executor.graphs == set()


class _PromptKeys(_StageOnly):
    """``_StageOnly`` with prompt-step graphs: records the graph key (bucket, adapters' class)
    of every prompt step it runs while they are on (``PromptGraphs.supports`` and ``run``)."""

    def __init__(self, max_seqs: int, buckets: tuple[int, ...]) -> None:
        super().__init__(max_seqs, 0, 32)
        self.prompt_graph_buckets = buckets
        self.on = True
        self.prompt_keys: set[tuple[int, int | None]] = set()

    def use_prompt_graphs(self, on: bool) -> None:
        self.on = on

    def step(self, work: list[list[Any]]) -> list[Any]:
        from loraplane.worker.lora.batch_info import segments_of, static_shape

        rows = work[0]
        tokens = sum(len(w.tokens) for w in rows)
        prompt = any(len(w.tokens) > 1 for w in rows)
        if self.on and prompt and tokens < self.prompt_graph_buckets[-1]:
            bucket = next(b for b in self.prompt_graph_buckets if b > tokens)
            segments = segments_of([w.slot for w in rows for _ in w.tokens])
            count = static_shape(segments, bucket)[0] if segments[2] else None
            self.prompt_keys.add((bucket, count))
        return super().step(work)


@pytest.mark.parametrize(("max_seqs", "slots"), [(8, 3), (64, 32), (4, 4)])
def test_the_warm_up_captures_every_prompt_graph_a_step_can_reach(
    max_seqs: int, slots: int
) -> None:
    """Every bucket a step of at most ``max_seqs`` rows of 63 tokens reaches, without an
    adapter and with each power of two of adapters up to K's; and the warm-up's other steps
    (with the graphs off) capture none."""
    from loraplane.worker.engine.prompt_graphs import prompt_buckets

    buckets = tuple(prompt_buckets(1024))
    plan = plan_for(max_seqs, 64, slots, 32, prompt_buckets=buckets)
    executor = _PromptKeys(max_seqs, buckets)
    warm_up(executor, plan)  # type: ignore[arg-type]
    most = max_seqs * 63
    reachable = [b for last, b in zip((0, *buckets[:-1]), buckets, strict=True) if last <= most]
    classes = {None} | {1 << (c - 1).bit_length() for c in range(1, slots + 1)}
    assert executor.prompt_keys == {(b, c) for b in reachable for c in classes}
    assert executor.on  # (on again for serving)
