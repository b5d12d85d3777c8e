"""The executor: what the engine asks of the ranks, whatever their number.

The engine (scheduler, residency, HTTP server) is rank-agnostic. It hands the executor one
list of `SeqWork` per DP group per step, and slot commands that apply on every rank. The
`LocalExecutor` runs one process (tp = dp = 1); `loraplane.worker.parallel.launch` provides
the multi-rank executor with the same interface, where rank 0 drives and the others follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from loraplane.worker.config import LoRARuntimeConfig, ModelConfig
from loraplane.worker.engine.compile_watch import after_warmup
from loraplane.worker.engine.logprobs import DeviceLogprobs, LogprobRows, TokenLogprob
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.engine.sampling import GREEDY, SamplingParams, sample_ids, sample_rows
from loraplane.worker.lora.adapter import AdapterWeights
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.lora.manager import LoRAManager
from loraplane.worker.models.batch import ForwardBatch, SeqChunk, upload


@dataclass(frozen=True, slots=True)
class SeqWork:
    """New tokens of one sequence for this step, on its DP group."""

    cache_row: int  # page-table row within the DP group
    start: int  # tokens of this sequence already in the cache
    tokens: tuple[int, ...]
    slot: int = NO_ADAPTER  # LoRA slot of this sequence's adapter, -1 for none
    # How the sequence picks its next token (greedy by default), and how many tokens it
    # generated before this step (a seeded sequence's draw depends on it: ``draw_seed``).
    params: SamplingParams = GREEDY
    index: int = 0
    # Overlapped steps (ADR 0014): >= 0, this row's one input token is row ``carry`` of the
    # previous launched step's sampled ids, copied on the device (``tokens`` holds a
    # placeholder); -1, ``tokens`` are the input.
    carry: int = -1
    # The KV pages of positions ``0..start + len(tokens) - 1`` (``engine/pages.py``); None:
    # the row's contiguous pages (callers that manage rows themselves).
    pages: tuple[int, ...] | None = None


PromptLogprobs = tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    """One DP group's step: each sequence's next token, in work order.

    The tokens are picked where the logits are (``sampling.sample_rows``), so a step moves
    ``n`` ints to the host, not ``n x vocab`` floats (at bs 128 and a 152k vocabulary, 78 MB
    a step, if sampled one row at a time on the host).

    Where some sequence asks for log probabilities (``SamplingParams.wants_logprobs``),
    ``logprobs`` holds each sequence's sampled token's (None where it did not ask) and
    ``prompt_logprobs`` its prompt tokens' in a prefill, from ``prompt_logprobs_start`` on
    (None where it did not ask); both are empty when no sequence asked."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs | None] = field(default_factory=list)


def prompt_rows(w: SeqWork) -> int:
    """How many logit rows ``w`` needs before its last one: one for each prompt token whose
    logprob it asks for, in its prefill (the logits of the position before that token)."""
    p = w.params
    if p.prompt_logprobs is None or w.start != 0 or w.carry >= 0:
        return 0
    return max(len(w.tokens) - max(p.prompt_logprobs_start, 1), 0)


class StepLogprobs:
    """A step's log probabilities (``engine.logprobs``), on the device until ``read``."""

    def __init__(self, logits: torch.Tensor, work: list[SeqWork], ids: torch.Tensor) -> None:
        """``logits`` ``[rows, vocab]`` in ``build_batch``'s row order, ``ids`` the step's
        sampled tokens ``[len(work)]``."""
        extra = [prompt_rows(w) for w in work]
        last = [end - 1 for end in accumulate(e + 1 for e in extra)]
        self.size = len(work)
        self.sampled = [i for i, w in enumerate(work) if w.params.logprobs is not None]
        rows = [last[i] for i in self.sampled]
        tops = [w.params.logprobs or 0 for w in (work[i] for i in self.sampled)]
        # per prompt-scoring sequence: (its index in work, its rows' count)
        self.prompts = [(i, e) for i, e in enumerate(extra) if e]
        prompt_targets: list[int] = []
        for i, e in self.prompts:
            rows.extend(range(last[i] - e, last[i]))
            prompt_targets.extend(work[i].tokens[len(work[i].tokens) - e :])
            tops.extend([work[i].params.prompt_logprobs or 0] * e)
        index = upload(torch.tensor(self.sampled, dtype=torch.int64), ids.device)
        targets = torch.cat(
            [
                ids.index_select(0, index),
                upload(torch.tensor(prompt_targets, dtype=torch.int64), ids.device),
            ]
        )
        self.values = DeviceLogprobs(logits, LogprobRows(rows, targets, tops))

    def read(self) -> tuple[list[TokenLogprob | None], list[PromptLogprobs | None]]:
        """``StepResult.logprobs`` and ``StepResult.prompt_logprobs`` (on the host)."""
        values = self.values.read()
        logprobs: list[TokenLogprob | None] = [None] * self.size
        for i, value in zip(self.sampled, values, strict=False):
            logprobs[i] = value
        prompts: list[PromptLogprobs | None] = [None] * self.size
        at = len(self.sampled)
        for i, count in self.prompts:
            prompts[i] = tuple(values[at : at + count])
            at += count
        return logprobs, prompts


def sample_step(
    logits: torch.Tensor, work: list[SeqWork], sampler: str, logprobs: bool = True
) -> tuple[torch.Tensor, StepLogprobs | None]:
    """A group's sampled ids ``[len(work)]`` on the device, from its step's ``logits`` (rows
    as ``build_batch`` asked for them), and its log probabilities if some sequence asks (and
    ``logprobs``: a rank that only feeds the ids to the next step skips them)."""
    params = [w.params for w in work]
    indices = [w.index for w in work]
    if not any(p.wants_logprobs for p in params):
        return sample_ids(logits, params, indices, sampler), None
    extra = [prompt_rows(w) for w in work]
    last = logits
    if any(extra):
        ends = [end - 1 for end in accumulate(e + 1 for e in extra)]
        last = logits.index_select(0, upload(torch.tensor(ends), logits.device))
    ids = sample_ids(last, params, indices, sampler)
    return ids, StepLogprobs(logits, work, ids) if logprobs else None


def step_result(logits: torch.Tensor, work: list[SeqWork], sampler: str = "auto") -> StepResult:
    """``StepResult`` of a group's step ``logits`` (the rows ``build_batch`` asked for), by
    ``sampler`` (``sampling.SAMPLERS``)."""
    if not any(w.params.wants_logprobs for w in work):  # (the common path, as it was)
        return StepResult(
            sample_rows(logits, [w.params for w in work], [w.index for w in work], sampler)
        )
    ids, logprobs = sample_step(logits, work, sampler)
    tokens = ids.tolist()
    assert logprobs is not None
    return StepResult(tokens, *logprobs.read())


class LaunchedStep(Protocol):
    """What ``launch`` returns (ADR 0014): a step started without reading its tokens back.

    ``tokens`` waits for that step (not for any launched after it) and gives every DP
    group's sampled ids, group after group, each in work order; ``logprobs`` gives the
    step's ``StepResult.logprobs`` and ``prompt_logprobs`` in the same order (both empty when
    no row asked), read after ``tokens``."""

    def tokens(self) -> list[int]: ...

    def logprobs(self) -> tuple[list[TokenLogprob | None], list[PromptLogprobs | None]]: ...


class PendingStep:
    """A launched step (``LocalExecutor.launch``) whose sampled ids are still on the device.

    ``ids`` feeds the next step's carried rows there; ``tokens()`` reads them back to the host
    (waiting for this step, not for any launched after it)."""

    def __init__(self, ids: torch.Tensor, logprobs: StepLogprobs | None = None) -> None:
        self.ids = ids
        self._logprobs = logprobs
        self._tokens: list[int] | None = None
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def tokens(self) -> list[int]:
        """Each row's sampled token id, in work order."""
        if self._tokens is None:
            if self._done is not None and self._host is not None:
                self._done.synchronize()
                self._tokens = self._host.tolist()
            else:
                self._tokens = self.ids.tolist()
        return self._tokens

    def logprobs(self) -> tuple[list[TokenLogprob | None], list[PromptLogprobs | None]]:
        """``StepResult.logprobs`` and ``prompt_logprobs`` of this step (empty when no row
        asked); read after ``tokens``."""
        return self._logprobs.read() if self._logprobs is not None else ([], [])


def carried_inputs(
    work: list[SeqWork], batch: ForwardBatch, after: PendingStep | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids, index)`` for ``ModelRunner.forward``'s ``carry``: the previous step's sampled
    ids and ``index [2, k]``, each carried row's token offset in ``batch`` over its row in
    ``ids`` (moved without waiting for the device); None when no row is carried."""
    pairs = [(c.token_offset, w.carry) for w, c in zip(work, batch.chunks, strict=True)]
    pairs = [p for p in pairs if p[1] >= 0]
    if not pairs:
        return None
    if after is None:
        raise ValueError(f"work carries tokens of a previous step ({pairs}), and there is none")
    return after.ids, upload(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)


def slots_loaded(manager: LoRAManager, slots: list[int], wait: bool) -> set[int]:
    """``Executor.loaded_slots`` on one rank's ``manager``."""
    if wait:
        manager.wait_for_loads()
        return set(slots)
    return {s for s in slots if manager.slot_loaded(s)}


class ExecutorFailed(RuntimeError):
    """The executor itself broke (a rank died, or stopped answering), not what it was asked
    to do: the worker cannot serve on, whatever call met it."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    nbytes: int


class Executor(Protocol):
    dp_size: int
    # Whether `read_adapter` may run on another thread while `step` runs (the engine then
    # reads adapter files beside its steps; everything else stays on the engine's thread).
    reads_adapters_concurrently: bool
    model_config: ModelConfig
    max_seqs: int  # page-table rows per DP group: running sequences at most
    max_len: int  # positions per sequence
    kv_pages: int  # KV pages per DP group (models/kv_cache.py)
    page_size: int  # positions per KV page
    # Stage positions of the stacked shrinks at the slot buffers' rank (lora/stage.py; a lower
    # stage rank has more); 0 where nothing is staged.
    stage_positions: int
    # Token buckets of the prompt steps replayed from graphs (engine/prompt_graphs.py); ()
    # where every prompt step runs eagerly (multi-rank executors, a CPU).
    prompt_graph_buckets: tuple[int, ...]
    # Whether ``launch(work, after) -> LaunchedStep`` is there (overlapped steps, ADR 0014):
    # it starts a step without reading its tokens, and rows with a ``carry`` take their
    # input token from ``after``, the step launched just before, on the device.
    supports_launch: bool

    def step(self, work: list[list[SeqWork]]) -> list[StepResult]:
        """Run one forward; per DP group, its sequences' next tokens (``StepResult``)."""
        ...

    def read_adapter(self, dp_group: int, name: str, path: str) -> AdapterInfo:
        """Validate an adapter on one DP group and keep it in that group's host memory; AdapterError if rejected."""
        ...

    def load_slot(self, slot: int, name: str) -> None:
        """Copy an adapter already read (on every group) from host memory into `slot` on every rank."""
        ...

    def loaded_slots(self, slots: list[int], wait: bool = False) -> set[int]:
        """Those of ``slots`` whose last ``load_slot`` has finished copying on every rank;
        with ``wait``, all of them, once they have. A step may use a slot before that (it
        waits for the copy on the device); the engine asks so as not to make it wait."""
        ...

    def clear_slot(self, slot: int) -> None: ...

    def drop_adapter(self, name: str) -> None:
        """Forget an adapter's host copy on every rank."""
        ...

    def hold_blank(self, name: str, rank: int) -> None:
        """Hold a zero adapter of ``rank`` over every LoRA target, as if read on every group
        (``lora.adapter.blank_adapter``; the warm-up loads it into slots)."""
        ...

    def use_prompt_graphs(self, on: bool) -> None:
        """Whether prompt steps that fit a bucket of ``prompt_graph_buckets`` replay graphs
        (on by default; the warm-up runs its eager steps with it off)."""
        ...

    def after_warmup(self) -> bool:
        """Once warmed up, on every rank: from now on log each Triton kernel variant first
        launched, and keep the start-up heap out of the garbage collector
        (``engine.compile_watch.after_warmup``). False where this Triton has no hook for
        compiles."""
        ...

    def shutdown(self) -> None: ...


def build_batch(work: list[SeqWork], device: torch.device | str) -> tuple[ForwardBatch, list[int]]:
    """A forward batch of one DP group and the LoRA slot of each of its tokens."""
    chunks, tokens, slots = [], [], []
    offset = 0
    for w in work:
        chunks.append(
            SeqChunk(
                cache_row=w.cache_row,
                start=w.start,
                length=len(w.tokens),
                token_offset=offset,
                pages=w.pages,
            )
        )
        tokens.append(list(w.tokens))
        slots.extend([w.slot] * len(w.tokens))
        offset += len(w.tokens)
    batch = ForwardBatch.from_chunks(tokens, chunks, all_logits=False, device=device)
    extra = [prompt_rows(w) for w in work]
    if any(extra):  # prompt logprobs: those prompts' rows too, each chunk's last row last
        rows = [
            r
            for c, e in zip(chunks, extra, strict=True)
            for r in range(c.token_offset + c.length - 1 - e, c.token_offset + c.length)
        ]
        batch.logit_rows = upload(torch.tensor(rows, dtype=torch.int64), device)
    return batch, slots


class LocalExecutor:
    """One process, one rank: tp = dp = 1."""

    dp_size = 1
    # A read touches host memory only (`ModelRunner.read_adapter`, then one `host` entry).
    reads_adapters_concurrently = True
    supports_launch = True

    def __init__(self, runner_config: RunnerConfig, lora: LoRARuntimeConfig) -> None:
        self.runner = ModelRunner(runner_config, lora)
        self.model_config = self.runner.model_config
        self.max_seqs = runner_config.max_seqs
        self.max_len = runner_config.max_len
        self.kv_pages = self.runner.kv.num_pages
        self.page_size = self.runner.kv.page_size
        lora_manager = self.runner.lora
        self.stage_positions = (
            lora_manager.stage.full_positions if lora_manager and lora_manager.stage.enabled else 0
        )
        prompt_graphs = self.runner.prompt_graphs
        self.prompt_graph_buckets = tuple(prompt_graphs.buckets) if prompt_graphs else ()
        self.host: dict[str, AdapterWeights] = {}

    def step(self, work: list[list[SeqWork]]) -> list[StepResult]:
        assert len(work) == 1, "LocalExecutor has one DP group"
        batch, slots = build_batch(work[0], "cpu")  # the runner moves it, or replays a graph
        if not work[0]:
            return [StepResult([])]
        logits = self.runner.forward(batch, slots)
        return [step_result(logits, work[0], self.runner.config.sampler)]

    def launch(self, work: list[list[SeqWork]], after: PendingStep | None) -> PendingStep:
        """Start one forward and its sampling without reading the tokens back (ADR 0014):
        the engine prepares the next step while the device runs this one. Rows with a
        ``carry`` take their input token from ``after``'s sampled ids, on the device."""
        assert len(work) == 1, "LocalExecutor has one DP group"
        rows = work[0]
        if not rows:
            return PendingStep(torch.empty(0, dtype=torch.int64))
        batch, slots = build_batch(rows, "cpu")
        carry = carried_inputs(rows, batch, after, self.runner.device)
        logits = self.runner.forward(batch, slots, carry)
        return PendingStep(*sample_step(logits, rows, self.runner.config.sampler))

    def read_adapter(self, dp_group: int, name: str, path: str) -> AdapterInfo:
        assert dp_group == 0
        weights = self.runner.read_adapter(name, path)
        self.host[name] = weights
        return AdapterInfo(
            name, path, weights.rank, weights.scaling, weights.target_modules, weights.nbytes
        )

    def load_slot(self, slot: int, name: str) -> None:
        assert self.runner.lora is not None
        self.runner.lora.load_slot(slot, self.host[name])

    def loaded_slots(self, slots: list[int], wait: bool = False) -> set[int]:
        assert self.runner.lora is not None
        return slots_loaded(self.runner.lora, slots, wait)

    def clear_slot(self, slot: int) -> None:
        assert self.runner.lora is not None
        self.runner.lora.clear_slot(slot)

    def drop_adapter(self, name: str) -> None:
        self.host.pop(name, None)

    def hold_blank(self, name: str, rank: int) -> None:
        self.host[name] = self.runner.blank_adapter(name, rank)

    def use_prompt_graphs(self, on: bool) -> None:
        if self.runner.prompt_graphs is not None:
            self.runner.prompt_graphs.enabled = on

    def after_warmup(self) -> bool:
        return after_warmup()

    def shutdown(self) -> None:
        pass
