"""The worker's warm-up: the steps a fresh worker runs before it listens, so that its first
requests do not wait for Triton's compiles and the decode graphs' captures.

A fresh process compiles each Triton kernel variant at its first launch (the LoRA shrink,
expand and stacked epilogues, the experts' kernels, attention, the fused sampler: one per
batch class, stage width and rank, top_k or not, chunked or not) and captures a decode graph
per batch bucket and LoRA shape at its first step. With an empty Triton cache, which is every
new pod's, a request that meets them waits seconds (``bench/results/2026-12-02-h200-s25/``).
``warm_up`` runs them through the executor, on every rank, before the server listens; the
pod's readiness waits for it instead of a client:

* the base model: prefill steps of 16 to 333 tokens, more with routed experts (sizes that are and are not multiples
  of 16, which Triton compiles apart, and on a model with routed experts the sizes that
  give each expert's tile 32 and 64 pairs), then a greedy decode step at every decode
  graph bucket up to the worker's running cap (each bucket's LoRA-off graph is captured);
* the sampler: decode steps of temperature/top_p rows and of top_k rows with a seeded one, at
  one row (the chunked launches) and at the largest bucket;
* mixed steps (a prompt chunk beside one-token rows, which no graph pads to a bucket): the
  decode attention kernel's split count is a constexpr chosen by the count of one-token
  rows, so one step per split count a count up to ``max_seqs - 1`` gives
  (``single_row_counts``; every count where the executor's ranks run elsewhere);
* prompt-step graphs (``engine/prompt_graphs.py``, where the executor has them): a prompt
  step in every token bucket, without an adapter and with 1, 2, 4, ... up to K distinct
  adapters (a graph per bucket, power of two of adapters and stage width and rank: at each
  stage rank for the counts its stage holds, at every width above their own too, as for
  decode graphs; once for the counts past it, whose graphs are the same at every rank).
  Every other step of the warm-up runs with them off, eagerly, so the kernel variants of
  prompt steps too long for a graph are compiled too;
* LoRA: a blank adapter (every weight zero, ``lora.adapter.blank_adapter``) at every stage
  rank (16, 32, ... up to the worker's largest) in 1, 2, 4, ... up to K slots at once (every
  stage width, and the kernels past the stage): the same prefill steps with the adapters
  taking turns by row (past 256 rows a batch leaves the stage), then a decode step for every
  graph a batch of that many adapters can meet: every bucket, and in each the longest
  segment's classes (16 rows, 32, more: ``lora_decode_batches``); for batches the stage
  holds, also at every stage width above their own (a batch of one adapter whose stage
  position is the fourth computes a width of 4), decode graphs and eager prefills (an eager
  batch of up to 256 rows stages too). Then eager steps of every shrink variant an eager
  step can launch (``lora_shapes``): the kernel's row block follows the longest segment (16,
  32, 64 rows) and its K split (a constexpr) the grid of (segment blocks) x (segments)
  programs, by class (``split_class``), up to the longest segment a step of
  ``--chunked-prefill-size`` prompt tokens can hold. Under DP attention a LoRA graph is keyed by
  the TP-global slots of every group's rows padded to the bucket (ADR 0018): the decode
  steps are built over those ``dp x bucket`` rows instead (``dp_lora_decode_steps``), with
  up to ``dp x max_seqs`` distinct adapters. A graph the warm-up did not capture is
  captured when a request first needs it, and every request waits for that. The slots are
  cleared and the adapter dropped after, so no adapter is loaded when the server starts
  (adapters given with ``--lora`` are loaded after the warm-up).

The steps write KV-cache rows at positions that a sequence given the row later writes itself
before it reads them. Nothing the engine tracks (residency, metrics, step counts) changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from loraplane.worker.engine.executor import Executor, SeqWork
from loraplane.worker.engine.graphs import graph_buckets
from loraplane.worker.engine.sampling import GREEDY, SamplingParams
from loraplane.worker.kernels import _triton_utils
from loraplane.worker.kernels._triton_utils import cdiv, split_class
from loraplane.worker.lora.manager import EAGER_STAGE_MAX_ROWS
from loraplane.worker.lora.stage import MIN_STAGE_RANK, positions_at, stage_window

log = logging.getLogger(__name__)

# The adapter the warm-up loads (never visible: the engine is not running yet).
BLANK_NAME = "loraplane-warmup-blank"
# The longest segment's classes a LoRA decode graph is captured for (``static_shape``):
# at most 16 rows, at most 32, more.
SEGMENT_CLASSES = (16, 32)
# Tokens of a prefill step: Triton specializes an integer argument that is a multiple of 16,
# so each size comes as one and as not one; a LoRA batch's longest segment picks its row
# block (16, 32, 64: ``segment_block``), and past 256 rows (``EAGER_STAGE_MAX_ROWS``) it
# leaves the stage for the shrink and expand kernels.
PREFILL_TOKENS = (16, 29, 192, 205, 320, 333)
# On a model with routed experts, the pairs per expert pick the experts' tile (16, 32 or 64
# pairs: ``kernels.experts.expert_block_m``): prefills that land about mid-way in the upper two.
EXPERT_PAIRS = (24, 48)
_TOP_P = SamplingParams(temperature=0.7, top_p=0.9)
_TOP_K = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
_SEEDED = SamplingParams(temperature=0.8, top_k=50, seed=1)


@dataclass(frozen=True)
class WarmupPlan:
    decode_sizes: tuple[int, ...]  # greedy decode steps, one each
    sampler_sizes: tuple[int, ...]  # decode steps of sampled rows
    prefill_tokens: tuple[int, ...]  # one prefill step of each size, base and per LoRA count
    max_len: int  # positions per KV-cache row: a prompt is split over rows to fit
    max_seqs: int  # KV-cache rows per DP group: a step uses at most these
    ranks: tuple[int, ...] = ()  # blank adapters' ranks; () without LoRA
    adapter_counts: tuple[int, ...] = ()  # distinct adapters in a LoRA step
    # stage positions at each of ``ranks`` (lora.stage.positions_at); () where nothing stages
    stage_positions: tuple[int, ...] = ()
    # eager LoRA steps, (longest segment, segments) each: every shrink variant they can meet
    lora_shapes: tuple[tuple[int, int], ...] = ()
    # token buckets of the executor's prompt-step graphs (engine/prompt_graphs.py); ()
    # where every prompt step runs eagerly
    prompt_buckets: tuple[int, ...] = ()

    def positions_at(self, rank: int) -> int:
        """Stage positions of a stage of ``rank`` (0: nothing stages)."""
        return self.stage_positions[self.ranks.index(rank)] if self.stage_positions else 0


def plan_for(
    max_seqs: int,
    max_len: int,
    max_loras_per_batch: int | None,
    max_lora_rank: int,
    experts: tuple[int, int] | None = None,
    stage_positions: int = 0,
    dp: int = 1,
    chunked_prefill_size: int = 0,
    prompt_buckets: tuple[int, ...] = (),
) -> WarmupPlan:
    """What ``warm_up`` runs for a worker of ``max_seqs`` KV rows per DP group (its running
    cap) of ``max_len`` positions, with ``max_loras_per_batch`` slots (None: no LoRA), on a
    model with ``experts`` (routed experts, experts per token) or without (None), on an
    executor with ``stage_positions`` of the slot buffers' rank (``Executor.stage_positions``;
    a lower stage rank has more: ``lora.stage.positions_at``) and ``dp`` DP-attention
    groups, for an engine that feeds at most ``chunked_prefill_size`` prompt tokens a step
    (0: whole prompts), whose prompt steps of fewer tokens than a bucket of
    ``prompt_buckets`` replay graphs."""
    sizes = tuple(graph_buckets(max_seqs))
    capacity = max_seqs * (max_len - 1)  # prompt tokens one step can hold
    wanted = set(PREFILL_TOKENS)
    if experts is not None:
        num_experts, topk = experts
        for pairs in EXPERT_PAIRS:
            t = 16 * -(-pairs * num_experts // (16 * topk))
            wanted |= {t, t + 13}
    tokens = tuple(sorted({min(n, capacity) for n in wanted}))
    plan = WarmupPlan(
        sizes,
        tuple(sorted({sizes[0], sizes[-1]})),
        tokens,
        max_len,
        max_seqs,
        prompt_buckets=tuple(prompt_buckets),
    )
    if not max_loras_per_batch:
        return plan
    # a step holds at most max_seqs sequences per group, so at most that many adapters each
    most = min(max_loras_per_batch, dp * max_seqs)
    counts, n = [], 1
    while n < most:
        counts.append(n)
        n *= 2
    counts.append(most)
    # the longest segment (one adapter's rows) an eager step can hold: a step's prompt
    # tokens beside a decode row per running sequence
    longest = min(capacity, chunked_prefill_size + max_seqs) if chunked_prefill_size else capacity
    ranks = stage_ranks(max_lora_rank)
    return replace(
        plan,
        ranks=ranks,
        adapter_counts=tuple(counts),
        stage_positions=tuple(positions_at(stage_positions, max_lora_rank, r, most) for r in ranks)
        if stage_positions
        else (),
        lora_shapes=tuple(lora_shapes(max_seqs, max_len, min(most, max_seqs), longest)),
    )


def lora_shapes(
    max_rows: int, max_len: int, max_segments: int, longest: int
) -> list[tuple[int, int]]:
    """Eager LoRA steps (longest segment, segments) that launch every shrink variant an
    eager step of at most ``max_rows`` rows of ``max_len`` positions, ``max_segments``
    adapters and segments of at most ``longest`` rows can: the kernel's row block follows
    the longest segment (16, 32, 64: ``segment_block``) and its K splits the grid, (segment
    blocks) x (segments) programs a slice, by class (``split_class``). One step per (row
    block, class), the fewest tokens that reach it; the longest segment is one adapter's
    prompt chunk (rows of ``max_len - 1``), the others a one-token row each."""
    picks: dict[tuple[int, tuple[int, int, int]], tuple[int, int]] = {}
    wide = (
        _triton_utils.TARGET_PROGRAMS // 4 + 1
    )  # (grids of this many programs a slice or more never split)
    # (the fewest rows of each block class and block count: past 32 rows, b blocks of 64)
    lengths = [(16, 2), (32, 17)] + [(64, max(33, 64 * b - 63)) for b in range(1, wide + 1)]
    for block, length in lengths:
        if length > longest:
            break
        for segments in range(1, max_segments + 1):
            if cdiv(length, max_len - 1) + segments - 1 > max_rows:
                break
            key = (block, split_class(cdiv(length, block) * segments))
            picks.setdefault(key, (length, segments))
    return sorted(set(picks.values()))


def single_row_counts(max_rows: int, splits: Callable[[int], int] | None) -> list[int]:
    """Counts of one-token rows, 1 to ``max_rows``, that launch every variant of the decode
    attention kernel (``kernels.decode_attention``) a step's one-token rows can: one count
    per split count ``splits`` gives (the kernel's constexpr, by the row count; a mixed
    step's rows are not padded to a graph bucket), or every count where ``splits`` is not
    known (None)."""
    if splits is None:
        return list(range(1, max_rows + 1))
    first: dict[int, int] = {}
    for n in range(1, max_rows + 1):
        first.setdefault(splits(n), n)
    return sorted(first.values())


def attention_splits(executor: Executor) -> Callable[[int], int] | None:
    """The decode attention kernel's split count for a step of n one-token rows on
    ``executor``'s device (``kernels.attention.splits_for``); None where its ranks run in
    processes of their own (a multi-rank executor), which this one cannot ask."""
    runner = getattr(executor, "runner", None)
    if runner is None:
        return None
    device = runner.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return lambda _n: 1  # (the CPU attends with torch: no kernel, one step is enough)
    from loraplane.worker.kernels import attention

    kv_heads = runner.kv.k[0].shape[2]
    return lambda n: attention.splits_for(n, kv_heads, device)  # type: ignore[no-any-return]


def stage_ranks(max_lora_rank: int) -> tuple[int, ...]:
    """Every stage rank an adapter can get (``lora.stage.Stage.assign``: its rank rounded up
    to a power of two, at least ``MIN_STAGE_RANK``, at most the slots'), smallest first: the
    staged kernels and graphs differ by it."""
    ranks, r = {max_lora_rank}, MIN_STAGE_RANK
    while r < max_lora_rank:
        ranks.add(r)
        r *= 2
    return tuple(sorted(ranks))


def lora_decode_batches(buckets: tuple[int, ...], slots: list[int]) -> list[list[int]]:
    """Decode batches (each row's slot, in the engine's row order: no adapter first, then by
    slot) that meet every LoRA graph a batch of the distinct ``slots`` can: at each bucket
    of at least ``len(slots)`` rows, one batch per class of its longest segment that such a
    batch can have (``SEGMENT_CLASSES``, then longer). The other adapters get a row each,
    the remaining rows none. A bucket of fewer rows than ``slots`` caps the graph's segment
    count at its rows: a batch of one row per adapter meets that graph when it falls in
    this count's power-of-two class (``static_shape``: 17 to 24 adapters at bucket 24)."""
    others = slots[1:]
    batches = []
    for bucket in buckets:
        top = bucket - len(others)  # the longest segment a batch of ``bucket`` rows can have
        if top < 1:
            if 2 * bucket > len(slots):
                batches.append(sorted(slots[:bucket]))
            continue
        longest = {min(c, top) for c in SEGMENT_CLASSES} | {top}
        for length in sorted(longest):
            rows = [-1] * (top - length) + [slots[0]] * length + others
            batches.append(sorted(rows))
    return batches


def dp_lora_decode_steps(
    buckets: tuple[int, ...], slots: list[int], dp: int
) -> list[list[list[int]]]:
    """DP-attention decode steps (each group's row slots) that meet every LoRA graph a step
    of the distinct ``slots`` can: at each bucket whose ``dp x bucket`` rows hold them, one
    step per class of the longest TP-global segment (``SEGMENT_CLASSES``, then longer). Every
    group gets ``bucket`` rows (its rows of the global list, in order), so the step replays
    that bucket; the graph's key is the same as for any step whose padded global slots have
    that many adapters and that class of longest segment."""
    others = slots[1:]
    steps = []
    for bucket in buckets:
        rows = dp * bucket
        top = rows - len(others)
        if top < 1:
            continue
        for length in sorted({min(c, top) for c in SEGMENT_CLASSES} | {top}):
            flat = [slots[0]] * length + others + [-1] * (top - length)
            # (each group's rows in the engine's order: no adapter first, then by slot)
            steps.append([sorted(flat[g * bucket : (g + 1) * bucket]) for g in range(dp)])
    return steps


def stage_widths(count: int, positions: int) -> list[int]:
    """The stage widths a staged batch of ``count`` adapters can compute (``stage_width``:
    its highest position + 1 rounded up to a power of two, and its positions lie below
    ``stage_window``), smallest first."""
    if not 0 < count <= positions:
        return []
    top = stage_window(count, positions)
    widths, w = [], 1
    while w < count:
        w *= 2
    while True:
        widths.append(min(w, top))
        if w >= top:
            return widths
        w *= 2


@dataclass
class WarmupReport:
    seconds: float = 0.0
    steps: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase


def _tokens(n: int, vocab: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(1 + (7 * j + salt) % (vocab - 1) for j in range(n))


class _Runner:
    """Runs the warm-up's steps on every DP group and keeps the report."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.vocab = executor.model_config.vocab_size
        self.report = WarmupReport()

    def step(self, work: list[SeqWork]) -> None:
        self.executor.step([work] * self.executor.dp_size)
        self.report.steps += 1

    def decode_groups(self, groups: list[list[int]]) -> None:
        """One greedy decode step with each DP group's own row slots (``decode``'s rows)."""
        self.executor.step(
            [
                [
                    SeqWork(row, 0, _tokens(1, self.vocab, row), s, index=row)
                    for row, s in enumerate(g)
                ]
                for g in groups
            ]
        )
        self.report.steps += 1

    def phase(self, name: str, body: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        body(*args)
        took = time.perf_counter() - t0
        self.report.phases[name] = self.report.phases.get(name, 0.0) + took
        log.info("warm-up: %s (%.2f s)", name, took)

    def prefill(self, tokens: int, adapters: int, plan: WarmupPlan, first: int = 0) -> None:
        """One prefill step of ``tokens`` prompt tokens over as few rows as fit the plan's
        ``max_len`` and at least ``adapters`` rows; row ``i`` has slot ``first + i %
        adapters`` (``adapters`` 0: no adapter). ``plan_for`` keeps ``tokens`` and
        ``adapters`` within ``max_seqs`` rows."""
        rows = max(adapters, 1, -(-tokens // (plan.max_len - 1)))
        tokens = max(tokens, rows)
        self.step(
            [
                SeqWork(
                    row,
                    0,
                    _tokens(tokens // rows + (row < tokens % rows), self.vocab, row),
                    first + row % adapters if adapters else -1,
                )
                for row in range(rows)
            ]
        )

    def mixed(self, singles: int) -> None:
        """One step of a two-token prompt chunk beside ``singles`` one-token rows (the decode
        rows of a mixed step), no adapter."""
        work = [SeqWork(0, 0, _tokens(2, self.vocab), -1)]
        work += [SeqWork(r, 0, _tokens(1, self.vocab, r), -1) for r in range(1, singles + 1)]
        self.step(work)

    def lora_shape(self, length: int, segments: int, plan: WarmupPlan) -> None:
        """One eager step whose longest segment is slot 0's ``length`` tokens (rows of at
        most the plan's ``max_len - 1``), beside one-token rows of slots 1 to ``segments - 1``."""
        per_row = plan.max_len - 1
        rows = cdiv(length, per_row)
        work = [
            SeqWork(r, 0, _tokens(min(per_row, length - r * per_row), self.vocab, r), 0)
            for r in range(rows)
        ]
        work += [
            SeqWork(rows + i, 0, _tokens(1, self.vocab, rows + i), 1 + i)
            for i in range(segments - 1)
        ]
        self.step(work)

    def prompt_graphs(self, adapters: int, plan: WarmupPlan, first: int = 0) -> None:
        """A prompt step in every bucket of the plan's prompt graphs that a step can reach,
        with ``adapters`` distinct adapters (0: none; slots from ``first`` on), with the
        executor's prompt graphs on: their captures."""
        self.executor.use_prompt_graphs(True)
        try:
            most = plan.max_seqs * (plan.max_len - 1)  # prompt tokens one step can hold
            last = 0
            for bucket in plan.prompt_buckets:
                # a step of n tokens replays the first bucket past n: the most this bucket
                # takes, else the fewest
                for tokens in (min(bucket - 1, most), max(last, adapters + 1)):
                    if last <= tokens < bucket and self.prompt_step(tokens, adapters, plan, first):
                        break
                last = bucket
        finally:
            self.executor.use_prompt_graphs(False)

    def prompt_step(self, tokens: int, adapters: int, plan: WarmupPlan, first: int = 0) -> bool:
        """``prefill``'s step of ``tokens`` prompt tokens over its rows, the adapters (slots
        from ``first`` on) taking turns by row, if one of its rows has two tokens or more
        (else it is a decode step) and the plan's ``max_seqs`` rows hold it; False (and
        nothing run) otherwise."""
        rows = max(adapters, 1, cdiv(tokens, plan.max_len - 1))
        if rows > plan.max_seqs or tokens < rows + 1:
            return False
        self.prefill(tokens, adapters, plan, first)
        return True

    def decode(self, slots: list[int], params: list[SamplingParams] | None = None) -> None:
        """One decode step: row ``i`` at position 0, with ``slots[i]`` and ``params[i]``."""
        params = params or [GREEDY] * len(slots)
        self.step(
            [
                SeqWork(row, 0, _tokens(1, self.vocab, row), slot, p, index=row)
                for row, (slot, p) in enumerate(zip(slots, params, strict=True))
            ]
        )


def warm_up(executor: Executor, plan: WarmupPlan) -> WarmupReport:
    """Run ``plan``'s steps through ``executor`` before it serves (see the module docstring);
    every LoRA slot it used is empty again after, and its adapter is dropped."""
    t0 = time.perf_counter()
    run = _Runner(executor)
    none = -1
    # The eager steps first, with the prompt graphs off: they compile the kernel variants
    # of the prompt steps too long for a graph. Each graph is captured in its own phase.
    if plan.prompt_buckets:
        executor.use_prompt_graphs(False)
    for tokens in plan.prefill_tokens:
        run.phase(f"prefill {tokens} tokens", run.prefill, tokens, 0, plan)
    for size in plan.decode_sizes:
        run.phase(f"decode bs={size}", run.decode, [none] * size)
    for size in plan.sampler_sizes:
        for label, mix in (("top_p", [_TOP_P]), ("top_k", [_TOP_K, _TOP_P, _SEEDED])):
            params = [mix[i % len(mix)] for i in range(size)]
            run.phase(f"sampler {label} bs={size}", run.decode, [none] * size, params)
    # a mixed step's one-token rows attend at their own count (no graph pads them)
    for singles in single_row_counts(plan.max_seqs - 1, attention_splits(executor)):
        run.phase(f"mixed, {singles} one-token row(s)", run.mixed, singles)
    if plan.prompt_buckets:
        run.phase("prompt graphs, no adapter", run.prompt_graphs, 0, plan)
    if plan.ranks:
        _warm_lora(run, plan)
    if plan.prompt_buckets:
        executor.use_prompt_graphs(True)
    run.report.seconds = time.perf_counter() - t0
    log.info(
        "warm-up done in %.1f s (%d steps): the first requests compile and capture nothing "
        "it ran (--no-warmup skips it)",
        run.report.seconds,
        run.report.steps,
    )
    return run.report


def _lora_steps(run: _Runner, plan: WarmupPlan, count: int, decode: bool) -> None:
    for tokens in plan.prefill_tokens:
        run.prefill(tokens, min(count, plan.max_seqs), plan)
    if not decode:
        return
    dp = run.executor.dp_size
    if dp > 1:
        for groups in dp_lora_decode_steps(plan.decode_sizes, list(range(count)), dp):
            run.decode_groups(groups)
        return
    for slots in lora_decode_batches(plan.decode_sizes, list(range(count))):
        run.decode(slots)


def _wider_stage_steps(run: _Runner, plan: WarmupPlan, rank: int) -> None:
    """Staged batches at every width above their own, decode graphs, prompt graphs and eager
    prefills (an eager batch of up to ``EAGER_STAGE_MAX_ROWS`` rows stages on a GPU too). The
    stage now holds slot ``p`` at position ``p`` (each count's steps staged slots 0..count-1
    in turn into the lowest free positions), so the slots ``width - count .. width - 1``
    compute ``width``. ``rank``: the stage rank of the blank adapter loaded."""
    for count in plan.adapter_counts:
        for width in stage_widths(count, plan.positions_at(rank))[1:]:
            slots = list(range(width - count, width))
            for batch in lora_decode_batches(plan.decode_sizes, slots):
                run.decode(batch)
            for tokens in plan.prefill_tokens:
                if tokens <= EAGER_STAGE_MAX_ROWS:
                    run.prefill(tokens, count, plan, first=width - count)
            if plan.prompt_buckets:
                run.prompt_graphs(count, plan, first=width - count)


def _warm_lora(run: _Runner, plan: WarmupPlan) -> None:
    executor = run.executor
    # decode and prompt graphs of batches past the stage are the same at every stage rank
    unstaged_decoded: set[int] = set()
    for rank in plan.ranks:
        executor.hold_blank(BLANK_NAME, rank)
        loaded = 0  # slots holding this rank's blank adapter
        for count in plan.adapter_counts:
            for slot in range(loaded, count):
                executor.load_slot(slot, BLANK_NAME)
            loaded = count
            positions = plan.positions_at(rank)
            decode = count <= positions or count not in unstaged_decoded
            if count > positions:
                unstaged_decoded.add(count)
            label = f"LoRA rank {rank}, {count} adapter(s)"
            run.phase(label, _lora_steps, run, plan, count, decode)
            if plan.prompt_buckets and decode:
                label = f"prompt graphs, LoRA rank {rank}, {count} adapter(s)"
                run.phase(label, run.prompt_graphs, count, plan)
        if plan.positions_at(rank):
            run.phase(f"LoRA rank {rank}, wider stages", _wider_stage_steps, run, plan, rank)
        for length, segments in plan.lora_shapes:
            # (past the stage the shrink and expand read the slots' largest rank: the same
            # variants at every stage rank)
            if segments <= plan.positions_at(rank) or rank == plan.ranks[0]:
                label = f"LoRA rank {rank}, eager: {segments} segment(s), the longest {length}"
                run.phase(label, run.lora_shape, length, segments, plan)
    # (after a failure the worker does not start: the executor is shut down, and a clean-up
    # here would only raise again on a dead rank or a broken device, over the real error)
    for slot in range(max(plan.adapter_counts)):
        executor.clear_slot(slot)
    executor.drop_adapter(BLANK_NAME)
