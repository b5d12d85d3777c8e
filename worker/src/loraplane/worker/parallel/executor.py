"""The multi-rank executor: the server process drives `tp` rank processes.

Each rank process owns one shard of the model (its `ParallelState`), its DP group's KV
cache and every LoRA slot. The driver sends every command to every rank, in the same
order, so the ranks enter each collective together; a `step` carries all DP groups' work
and each rank picks its own group's part (an idle group gets an empty list and still joins
every collective). Group leaders (attn-TP rank 0) pick their group's tokens on their device
and send back the token ids (``step_result``).

Overlapped steps (ADR 0014) go through ``launch``: the driver sends a step without waiting
for the last one's tokens; every rank samples its group's ids and keeps them on its device,
where the next launch's carried rows read them (``_launch_on_rank``), and a thread of the
rank (``_reply_loop``) sends them back once the device has them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as std_mp
import os
import queue
import sys
import threading
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from loraplane.worker.config import LoRARuntimeConfig, ModelConfig
from loraplane.worker.engine.compile_watch import after_warmup
from loraplane.worker.engine.executor import (
    AdapterInfo,
    LaunchedStep,
    PendingStep,
    PromptLogprobs,
    SeqWork,
    StepResult,
    build_batch,
    carried_inputs,
    sample_step,
    slots_loaded,
    step_result,
)
from loraplane.worker.engine.logprobs import TokenLogprob
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.lora.adapter import AdapterError, AdapterWeights
from loraplane.worker.parallel.launch import (
    RankFailed,
    exit_with_parent,
    init_rank,
    rendezvous_store,
)
from loraplane.worker.parallel.state import ParallelConfig, ParallelState

_REPLY_TIMEOUT_S = 600.0


def _read_loop(
    rank: int,
    ps: ParallelState,
    runner: ModelRunner,
    host: dict[str, AdapterWeights],
    inbox: Any,
    outbox: Any,
) -> None:
    """A rank's adapter reads (and their roll-backs), beside its steps: host memory only, no
    collective, so the driver's adapter thread sends them while its engine thread steps."""
    while True:
        cmd, args, seq = inbox.get()
        if cmd == "stop":
            return
        try:
            if cmd == "read":
                status, _, payload = _read(rank, ps, runner, host, *args)
            elif cmd == "drop":
                host.pop(args, None)
                status, payload = "ok", None
            else:
                raise ValueError(f"unknown read command {cmd!r}")
        except BaseException:
            status, payload = "error", traceback.format_exc()
        outbox.put((status, rank, (seq, payload)))  # seq: which command this answers


def _read(
    rank: int,
    ps: ParallelState,
    runner: ModelRunner,
    host: dict[str, AdapterWeights],
    group: int,
    name: str,
    path: str,
) -> tuple[str, int, Any]:
    """The reply to a read: ok with its AdapterInfo (None off the group), or rejected."""
    if group != ps.dp_rank:
        return ("ok", rank, None)
    try:
        w = runner.read_adapter(name, path)
    except AdapterError as exc:
        return ("rejected", rank, str(exc))
    except Exception as exc:
        # Reading is host-only (no collective ran): a file this rank cannot read is the
        # adapter's fault, not the rank's; reject it and keep serving.
        message = f"adapter {name!r}: lora_path: {path} cannot be read on rank {rank} ({exc!r})"
        return ("rejected", rank, message)
    host[name] = w
    return ("ok", rank, AdapterInfo(name, path, w.rank, w.scaling, w.target_modules, w.nbytes))


def _draws_unseeded(work: list[SeqWork]) -> bool:
    """Whether some row draws from the device's generator (sampled, with no seed)."""
    return any(not w.params.greedy and w.params.seed is None for w in work)


def _launch_on_rank(
    runner: ModelRunner, ps: ParallelState, work: list[SeqWork], after: PendingStep | None
) -> PendingStep:
    """One launched step on one rank (ADR 0014): the forward, which every rank runs, idle
    or not, so every collective is joined, and its group's sampled ids, kept on the device.
    Carried rows read ``after``'s ids, this rank's own last launch: each DP group's rows come
    from its own previous step.

    Every rank of a group samples from the same gathered logits, so greedy and seeded rows
    pick the same ids on each of them; where some row draws unseeded, the group takes its
    leader's ids (one broadcast in the group, decided from the work, the same on its ranks)."""
    batch, slots = build_batch(work, "cpu")
    carry = carried_inputs(work, batch, after, runner.device)
    logits = runner.forward(batch, slots, carry)
    if not work:
        return PendingStep(torch.empty(0, dtype=torch.int64))
    leader = ps.attn_tp_rank == 0  # (the one that sends the group's tokens and logprobs)
    ids, logprobs = sample_step(logits, work, runner.config.sampler, logprobs=leader)
    if ps.attn_tp_size > 1 and _draws_unseeded(work):
        src = ps.dp_rank * ps.attn_tp_size
        torch.distributed.broadcast(ids, src=src, group=ps.attn_tp_group)
    return PendingStep(ids, logprobs)


def _reply_loop(
    rank: int, leader: bool, device: torch.device, steps: queue.SimpleQueue[Any], outbox: Any
) -> None:
    """A rank's launched steps, in launch order, once the device has each one's ids: its
    group's ``StepResult`` from the group's leader, None from the others (the driver hears
    from every rank, so it sees a dead one). A launch that raised comes as its traceback,
    after the steps before it; the thread ends there."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while (item := steps.get()) is not None:
        seq, step = item
        payload: StepResult | str | None
        try:
            if isinstance(step, str):
                status, payload = "error", step
            else:
                tokens = step.tokens()
                status, payload = "ok", StepResult(tokens, *step.logprobs()) if leader else None
        except BaseException:
            status, payload = "error", traceback.format_exc()
        outbox.put((status, rank, (seq, payload)))
        if status == "error":
            return


def _rank_loop(
    rank: int,
    pconf: ParallelConfig,
    runner_config: RunnerConfig,
    lora: LoRARuntimeConfig,
    port: int,
    inbox: Any,
    outbox: Any,
    step_outbox: Any,
    read_inbox: Any,
    read_outbox: Any,
    log_level: int,
) -> None:
    exit_with_parent()
    # The rank's own log lines (decode graphs captured, kernels compiled after the warm-up)
    # go to the worker's stderr like the driver's, at its level, each naming the rank.
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)-7s rank{rank} %(name)s: %(message)s"
    )
    try:
        device = init_rank(rank, pconf.tp, runner_config.device, port)
        ps = ParallelState(pconf, rank)
        cfg = dataclasses.replace(runner_config, device=str(device))
        runner = ModelRunner(cfg, lora, ps)
        host: dict[str, AdapterWeights] = {}
        threading.Thread(
            target=_read_loop,
            args=(rank, ps, runner, host, read_inbox, read_outbox),
            name=f"loraplane-rank{rank}-reads",
            daemon=True,
        ).start()
        steps: queue.SimpleQueue[Any] = queue.SimpleQueue()  # launched, for `_reply_loop`
        replier = threading.Thread(
            target=_reply_loop,
            args=(rank, ps.attn_tp_rank == 0, device, steps, step_outbox),
            name=f"loraplane-rank{rank}-replies",
            daemon=True,
        )
        replier.start()
        outbox.put(("ready", rank, runner.kv.num_pages))
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
        return
    stopped = False
    last: PendingStep | None = None  # the last launched step: its ids feed carried rows
    while True:
        cmd, args = inbox.get()
        try:
            if cmd == "stop":
                outbox.put(("ok", rank, None))
                stopped = True
                break
            if cmd == "launch":
                seq, groups = args
                try:
                    last = _launch_on_rank(runner, ps, groups[ps.dp_rank], last)
                except BaseException:
                    steps.put((seq, traceback.format_exc()))  # (after the steps before it)
                    raise
                steps.put((seq, last))
            elif cmd == "step":
                last = None
                work: list[SeqWork] = args[ps.dp_rank]
                # (on the host: the runner moves it, or copies it into a decode graph's inputs)
                batch, slots = build_batch(work, "cpu")
                logits = runner.forward(batch, slots)
                leader = ps.attn_tp_rank == 0
                result = step_result(logits, work, cfg.sampler) if leader else None
                outbox.put(("ok", rank, result))
            elif cmd == "load_slot":
                slot, name = args
                assert runner.lora is not None
                runner.lora.load_slot(slot, host[name])
                outbox.put(("ok", rank, None))
            elif cmd == "loaded":
                slots, wait = args
                assert runner.lora is not None
                outbox.put(("ok", rank, slots_loaded(runner.lora, slots, wait)))
            elif cmd == "clear_slot":
                assert runner.lora is not None
                runner.lora.clear_slot(args)
                outbox.put(("ok", rank, None))
            elif cmd == "drop":
                host.pop(args, None)
                outbox.put(("ok", rank, None))
            elif cmd == "blank":
                name, adapter_rank = args
                host[name] = runner.blank_adapter(name, adapter_rank)
                outbox.put(("ok", rank, None))
            elif cmd == "after_warmup":
                outbox.put(("ok", rank, after_warmup()))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException:
            outbox.put(("error", rank, traceback.format_exc()))
            break
    # The launched steps' replies go out before the process group does: the device has
    # finished every step whose collectives the rank issued (bounded: a step that waits on
    # a dead peer never finishes).
    steps.put(None)
    replier.join(timeout=10)
    # Best effort on the way out; not after a capture of NCCL collectives, where NCCL's
    # communicator teardown can hang (pytorch/pytorch#115388): the exit below ends it.
    if not (runner.graphs is not None and runner.graphs.captured):
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    if stopped:
        # Every rank got "stop" between steps, so no collective is in flight. Leave without
        # interpreter teardown, whose C++ destructors of gloo's and torch's state can abort
        # ("terminate called without an active exception"; see launch.finish_rank), once the
        # reply and the logs are out.
        for box in (outbox, step_outbox):
            box.close()
            box.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class MultiRankExecutor:
    """`Executor` over `tp` rank processes with `dp` DP-attention groups."""

    # Each rank reads adapters on a thread of its own, from an inbox of its own (`_read_loop`):
    # the engine's adapter thread sends reads while its engine thread sends steps.
    reads_adapters_concurrently = True
    stage_positions = 0  # ranks of a multi-rank worker do not stage (lora/manager.py)
    prompt_graph_buckets: tuple[int, ...] = ()  # (their prompt steps run eagerly)
    supports_launch = True

    def __init__(
        self, pconf: ParallelConfig, runner_config: RunnerConfig, lora: LoRARuntimeConfig
    ) -> None:
        self.pconf = pconf
        self.dp_size = pconf.dp
        self.model_config = ModelConfig.from_dir(runner_config.model)
        self.max_seqs = runner_config.max_seqs
        self.max_len = runner_config.max_len
        self.kv_pages = runner_config.pages  # (the ranks' own count once they start)
        self.page_size = runner_config.page_size
        if runner_config.device == "cuda" and torch.cuda.device_count() < pconf.tp:
            raise RuntimeError(
                f"--tp {pconf.tp} needs {pconf.tp} GPUs; this machine has {torch.cuda.device_count()}"
            )
        ctx = mp.get_context("spawn")
        self._store = rendezvous_store()  # kept while the ranks run
        port = self._store.port
        self._inboxes = [ctx.Queue() for _ in range(pconf.tp)]
        self._outbox: std_mp.Queue[Any] = ctx.Queue()
        self._read_inboxes = [ctx.Queue() for _ in range(pconf.tp)]
        self._read_outbox: std_mp.Queue[Any] = ctx.Queue()
        self._read_seq = 0
        # Launched steps (``launch``): their replies come on an outbox of their own, each
        # rank's in launch order; a reply that comes before its step is read waits in
        # ``_later``. ``_last`` is the step the ranks' carried rows read.
        self._step_outbox: std_mp.Queue[Any] = ctx.Queue()
        self._launches = itertools.count(1)
        self._later: dict[int, list[Any]] = {}
        self._last: RankStep | None = None
        self._procs = [
            ctx.Process(
                target=_rank_loop,
                args=(
                    r,
                    pconf,
                    runner_config,
                    lora,
                    port,
                    self._inboxes[r],
                    self._outbox,
                    self._step_outbox,
                    self._read_inboxes[r],
                    self._read_outbox,
                    logging.getLogger().getEffectiveLevel(),
                ),
                name=f"loraplane-rank{r}",
                daemon=True,
            )
            for r in range(pconf.tp)
        ]
        for p in self._procs:
            p.start()
        # each rank sized its pool (from its free memory with --mem-fraction): the groups
        # share the engine's page count, so the smallest one
        self.kv_pages = min(payload for _, payload in self._collect("start"))

    def _send(self, cmd: str, args: Any = None) -> list[Any]:
        for box in self._inboxes:
            box.put((cmd, args))
        return self._collect(cmd)

    def _send_read(self, cmd: str, args: Any) -> list[Any]:
        """``cmd`` to every rank's read thread (the engine's adapter thread calls this).

        Each carries a number its replies echo: a reply that comes after its command gave up
        (a timeout, another rank's error) is dropped, not taken for the next command's."""
        self._read_seq += 1
        seq = self._read_seq
        for box in self._read_inboxes:
            box.put((cmd, args, seq))
        return self._collect(cmd, self._read_outbox, seq)

    def _collect(
        self,
        what: str,
        outbox: std_mp.Queue[Any] | None = None,
        seq: int | None = None,
        later: dict[int, list[Any]] | None = None,
    ) -> list[Any]:
        """Every rank's ``(status, payload)`` for ``what``; with ``seq``, replies are
        ``(seq, payload)`` and those of earlier commands are dropped, those of later ones
        too, or kept in ``later`` (by their ``seq``, failures included) where given. This
        command's error raises."""
        outbox = outbox or self._outbox
        replies: list[Any] = [None] * len(self._procs)
        pending = set(range(len(self._procs)))
        kept: list[Any] = []
        if later is not None and seq is not None:
            kept = later.pop(seq, [])
            for stale in [s for s in later if s < seq]:  # (steps never read: an engine stopped)
                del later[stale]
        waited = 0.0
        while pending:
            try:
                status, rank, payload = kept.pop() if kept else outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead:
                    raise RankFailed(f"rank(s) {dead} exited during {what!r}") from None
                if waited > _REPLY_TIMEOUT_S:
                    raise RankFailed(
                        f"no reply from ranks {sorted(pending)} to {what!r} in {_REPLY_TIMEOUT_S:.0f}s"
                    ) from None
                continue
            if seq is not None:
                answered, payload = payload
                if answered < seq or (answered > seq and later is None):
                    continue  # the late reply of a command that gave up
                if answered > seq and later is not None:
                    # a later launched step's answer, its failure too: read in its turn (a
                    # rank answers its steps in order, so this step's answer came first)
                    later.setdefault(answered, []).append((status, rank, (answered, payload)))
                    continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed during {what!r}:\n{payload}")
            replies[rank] = (status, payload)
            pending.discard(rank)
        return replies

    def step(self, work: list[list[SeqWork]]) -> list[StepResult]:
        assert len(work) == self.dp_size
        self._last = None  # (the ranks forget their last launched ids)
        replies = self._send("step", work)
        return [replies[r][1] for r in self._leaders]

    @property
    def _leaders(self) -> list[int]:
        return [g * self.pconf.attn_tp for g in range(self.dp_size)]

    def launch(self, work: list[list[SeqWork]], after: LaunchedStep | None) -> RankStep:
        """Send one step to every rank without waiting for any step's tokens (ADR 0014).
        A row with a ``carry`` takes its input token from row ``carry`` of its DP group's
        part of ``after``, which must be the step launched just before: every rank keeps
        that step's ids on its device. A bad carry raises ValueError and sends nothing."""
        assert len(work) == self.dp_size
        last = self._last
        for group, rows in enumerate(work):
            for i, w in enumerate(rows):
                if w.carry < 0:
                    continue
                if last is None or after is not last:
                    raise ValueError(
                        f"work[{group}][{i}].carry is {w.carry}, a row of a step that is not the "
                        "last one launched: after must be the step launched just before"
                    )
                if w.carry >= last.sizes[group]:
                    raise ValueError(
                        f"work[{group}][{i}].carry is {w.carry}; DP group {group} of the step "
                        f"before has rows 0..{last.sizes[group] - 1}"
                    )
        seq = next(self._launches)
        for box in self._inboxes:
            box.put(("launch", (seq, work)))
        self._last = RankStep(self, seq, [len(rows) for rows in work])
        return self._last

    def _step_results(self, seq: int) -> list[StepResult]:
        """Every DP group's ``StepResult`` of launched step ``seq``, once its ranks sent it."""
        replies = self._collect("launch", self._step_outbox, seq, self._later)
        return [replies[r][1] for r in self._leaders]

    def read_adapter(self, dp_group: int, name: str, path: str) -> AdapterInfo:
        replies = self._send_read("read", (dp_group, name, path))
        ranks = range(dp_group * self.pconf.attn_tp, (dp_group + 1) * self.pconf.attn_tp)
        for r in ranks:
            status, payload = replies[r]
            if status == "rejected":
                # The group's other ranks may have read it: forget it everywhere in the group.
                self._send_read("drop", name)
                raise _rejected(name, payload)
        info: AdapterInfo = replies[ranks[0]][1]
        return info

    def load_slot(self, slot: int, name: str) -> None:
        self._send("load_slot", (slot, name))

    def loaded_slots(self, slots: list[int], wait: bool = False) -> set[int]:
        replies = self._send("loaded", (slots, wait))
        done: set[int] = set(slots)
        for _status, payload in replies:
            done &= payload
        return done

    def clear_slot(self, slot: int) -> None:
        self._send("clear_slot", slot)

    def drop_adapter(self, name: str) -> None:
        self._send("drop", name)

    def hold_blank(self, name: str, rank: int) -> None:
        self._send("blank", (name, rank))

    def use_prompt_graphs(self, on: bool) -> None:
        pass  # (no prompt graphs on a multi-rank worker)

    def after_warmup(self) -> bool:
        return all(payload for _, payload in self._send("after_warmup"))

    def shutdown(self) -> None:
        try:
            for box in self._read_inboxes:
                box.put(("stop", None, 0))
            for box in self._inboxes:
                box.put(("stop", None))
            for p in self._procs:
                p.join(timeout=10)
        finally:
            for p in self._procs:
                if p.is_alive():
                    p.kill()


class RankStep:
    """A step launched on the ranks (``MultiRankExecutor.launch``); a ``LaunchedStep``."""

    def __init__(self, executor: MultiRankExecutor, seq: int, sizes: list[int]) -> None:
        self._executor = executor
        self.seq = seq
        self.sizes = sizes  # rows per DP group
        self._results: list[StepResult] | None = None

    def _read(self) -> list[StepResult]:
        if self._results is None:
            self._results = self._executor._step_results(self.seq)
        return self._results

    def tokens(self) -> list[int]:
        return [t for r in self._read() for t in r.tokens]

    def logprobs(self) -> tuple[list[TokenLogprob | None], list[PromptLogprobs | None]]:
        results = self._read()
        if not any(r.logprobs for r in results):
            return [], []
        logprobs: list[TokenLogprob | None] = []
        prompts: list[PromptLogprobs | None] = []
        for r in results:  # (a group whose rows asked for none has empty lists)
            logprobs.extend(r.logprobs or [None] * len(r.tokens))
            prompts.extend(r.prompt_logprobs or [None] * len(r.tokens))
        return logprobs, prompts


def _rejected(name: str, message: str) -> AdapterError:
    """Re-raise a rank's AdapterError in the driver with the same message."""
    err = AdapterError.__new__(AdapterError)
    ValueError.__init__(err, message)
    err.adapter, err.field, err.reason = name, "adapter", message
    return err
