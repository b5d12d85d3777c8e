"""CUDA graphs of the decode step, captured lazily: one per batch-size bucket and LoRA shape.

A decode step of a small batch is a few hundred short kernels; launched one by one from Python,
the host sets the pace (docs/performance.md: eager steps run at 0.4-0.6 of the graph rate with
LoRA). A graph replays the whole forward in one launch. What makes the forward capturable:

* Inputs live in static buffers of the bucket's size. A batch of ``n`` rows fills the first
  ``n``; the rest are padding rows that decode token 0 at position 0 of a spare page-table
  row (row ``max_seqs``, never given to a sequence, mapped to the KV cache's spare page),
  with no adapter. Their logits are dropped.
* Decode attention reads each row's length and pages on the device
  (``kernels.decode_attention``); the page table is one static tensor that the runner
  updates before each step (``KVCache.sync_table``), and each token's KV slot is computed
  from it inside the step.
* LoRA batch info sits in ``StaticLoRABatch`` buffers. Launch grids follow the number of
  segments and the longest one, so LoRA graphs are keyed by ``static_shape``: the distinct
  adapters rounded up to a power of two and the longest segment's row-block class (16, 32,
  or the bucket). A batch of one adapter thus launches one segment's programs, not
  ``max_loras_per_batch``'s. The LoRA wrappers overlap their shrink with the base projection
  on a side stream while capturing (``LoRABackend.overlap``).
* The base MoE experts are routed on the device (``kernels/experts.py``).
* A batch of at most ``stage_slots`` adapters is **staged** (``lora/stage.py``): their A rows
  are copied under the base weights (only when one is not there yet, before the replay), the
  projections' shrinks come out of the base GEMMs and the expands are fused into the kernel
  after each projection. Its graph is keyed by the stage width and rank too (the GEMMs'
  extra rows: 1, 2 or 4 positions of the staged adapters' rank rounded up to a power of two).
  A batch of more adapters runs the shrink + expand kernels.

A batch with no adapter replays the bucket's LoRA-off graph, which has no LoRA work at all.
Graphs run only for pure decode batches of at most the largest bucket; prompt steps replay
graphs of their own (``engine/prompt_graphs.py``, ADR 0019) or run eagerly. Adapter loads copy into the slot buffers in place, so captured graphs see
new adapters without a recapture.

Each rank of a multi-rank worker (``--tp``, ``--dp --dp-attention``) holds graphs of its own,
and the step's collectives (the TP all-reduces, the DP-attention gather of hidden states and
the LM head's gathers) are captured with it (docs/adr/0018-per-rank-decode-graphs.md):

* Under DP attention ``ModelRunner.forward`` first exchanges every group's token count and
  per-token slots (the host exchange of the eager step); the graph step runs when every
  group's batch is a pure decode batch that fits the largest bucket, an idle group's empty
  batch included. Every group pads its rows to the bucket of the largest group's, so the
  gathers move ``dp x bucket`` rows at fixed offsets and every rank replays a graph of the
  same bucket; an idle group replays it with padding rows only and drops every logit row.
* The LoRA shape of a DP step is that of the TP-global slots (every group's, padded), the
  same on every rank, so all ranks capture at the same steps (a capture's warm-ups run the
  collectives). The attention projections read the group's own rows (``local``: ``bucket``
  rows), the MLP and experts the gathered ones (``global``: ``dp x bucket`` rows).
  Multi-rank runners do not stage (``lora/manager.py``): their LoRA graphs run the shrink
  and expand kernels.
* Under plain TP every rank gets the same batch, so each rank's own choice of graph is the
  same as its peers'.
* A capture that fails on one rank cannot fall back to an eager step alone (its peers would
  wait in another collective): on a multi-rank worker it raises, and the rank fails.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplane.worker.lora.adapter import CUDA_CAPTURE_LOCK
from loraplane.worker.lora.batch_info import (
    NO_ADAPTER,
    StaticLoRABatch,
    segments_of,
    static_shape,
)
from loraplane.worker.models.batch import ForwardBatch, SeqChunk

if TYPE_CHECKING:
    from loraplane.worker.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# a LoRA graph's (segments, longest segment, stage width, stage rank); width 0: not staged
Shape = tuple[int, int, int, int]

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two to 8, then steps of 8..64, up to ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"the largest graph batch must be >= 1, got {max_batch}")
    return [b for b in _BUCKETS if b < max_batch] + [max_batch]


def graphs_enabled(requested: bool, device: torch.device, lora_backend: str | None) -> bool:
    """Whether a runner replays decode steps from graphs: CUDA, and LoRA (if any) through the
    Triton kernels. The torch reference kernels read segment bounds back to the host, which a
    capture cannot do (and would freeze one step's adapter layout).

    On the CPU, ``LORAPLANE_CPU_STATIC_DECODE=1`` gives a runner that asks for graphs the same
    static-buffer steps without capture (``DecodeGraphs(capture=False)``): how the tests take
    a worker's ranks, which read it from the environment they start with, down that path."""
    static_cpu = device.type == "cpu" and os.environ.get("LORAPLANE_CPU_STATIC_DECODE") == "1"
    return requested and (device.type == "cuda" or static_cpu) and lora_backend in (None, "triton")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: not captured, each replay runs `forward`
    forward: Callable[[], torch.Tensor]
    logits: torch.Tensor  # [bucket, vocab]: the shared output rows, rewritten by every replay

    def replay(self) -> None:
        if self.graph is None:
            self.logits = self.forward()
        else:
            self.graph.replay()


class DecodeGraphs:
    """Replays captured decode steps for ``ModelRunner.forward`` (see the module docstring)."""

    def __init__(
        self, runner: ModelRunner, max_batch: int, spare_row: int, *, capture: bool = True
    ) -> None:
        """``capture=False`` runs the same static-buffer steps without graphs (any device):
        how the CPU tests check padding and static LoRA metadata against the eager path."""
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.spare_row = spare_row
        self.capture = capture
        device = runner.device
        top = self.buckets[-1]
        # input_ids | positions | cache_rows, one row each; a bucket's batch is a prefix view.
        self._inputs = torch.zeros(3, top, dtype=torch.int64, device=device)
        self._inputs_host = torch.zeros(3, top, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._logit_rows = torch.arange(top, dtype=torch.int64, device=device)
        # One output buffer for every graph (outside the pool): a captured step copies its
        # logits here, so no graph keeps its own [bucket, vocab] block alive in the pool.
        self._logits = torch.empty(
            top, runner.model_config.vocab_size, dtype=runner.dtype, device=device
        )
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copies
        self._failed: set[tuple[int, Shape | None]] = set()
        self._stream = torch.cuda.Stream(device) if capture else None  # warm-ups
        self._lora: dict[tuple[int, Shape, bool], StaticLoRABatch] = {}  # see _lora_batch
        ps = runner.ps
        self.dp_size = ps.dp_size if ps.dp_attention else 1
        self.multi_rank = not ps.is_single
        self._graphs: dict[tuple[int, Shape | None], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._last_slots: tuple[int, tuple[int, ...], int, int] | None = None  # see _lora_shape
        self._last_shape: Shape | None = None
        self._last_adapters: list[int] = []
        self.replays = 0

    def supports(self, batch: ForwardBatch) -> bool:
        """A pure decode batch (logits of every row, in order) that fits the largest bucket.
        Under DP attention an idle group's empty batch too (it replays its peers' bucket)."""
        n = batch.num_tokens
        return (
            (n > 0 or self.dp_size > 1)
            and n <= self.buckets[-1]
            and batch.is_decode
            and not batch.dp_token_counts
            and batch.logit_rows.numel() == n  # decode batches want every row's logits
        )

    @property
    def captured(self) -> bool:
        """Whether any CUDA graph was captured (not only run without capture)."""
        return any(g.graph is not None for g in self._graphs.values())

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(
        self,
        batch: ForwardBatch,
        slots: Sequence[int],
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
        dp_slots: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor | None:
        """Logits [rows, vocab] of a decode batch (every row's next token), by graph replay.

        ``carry``: input tokens taken from a previous step's sampled ids on the device
        (``ModelRunner.forward``), copied into the static input buffer after the host values.
        ``dp_slots``: under DP attention, every group's per-token slots in group order (the
        step's host exchange; the same on every rank): the bucket fits the largest group.

        The logits are a view of a buffer that the next step rewrites: read them first. None
        when this batch's graph could not be captured (the caller runs the step eagerly).
        """
        n = batch.num_tokens
        if (dp_slots is not None) != (self.dp_size > 1):
            raise ValueError(
                f"dp_slots must be given exactly under DP attention (dp {self.dp_size}), "
                f"got {'none' if dp_slots is None else len(dp_slots)}"
            )
        if dp_slots is not None and len(dp_slots) != self.dp_size:
            raise ValueError(
                f"dp_slots must hold every DP group's slots ({self.dp_size}), got {len(dp_slots)}"
            )
        bucket = self.bucket_for(max(len(g) for g in dp_slots) if dp_slots else n)
        self._wait_for_last_copies()
        if dp_slots is not None:
            shape = self._dp_lora_shape(slots, dp_slots, bucket)
        else:
            shape = self._lora_shape(slots, bucket)  # None: no adapter in the batch
        key = (bucket, shape)
        if key in self._failed:
            return None
        self._fill(batch, bucket)
        if carry is not None:
            from loraplane.worker.engine.runner import put_carried

            put_carried(self._inputs[0], carry)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = self._capture(bucket, shape)
            except Exception:
                if self.multi_rank:
                    raise  # (an eager step on this rank alone would strand its peers)
                log.exception(
                    "could not capture a decode graph of %d rows (LoRA shape %s); "
                    "these steps run eagerly",
                    bucket,
                    shape,
                )
                self._failed.add(key)
                return None
        graph.replay()
        self.replays += 1
        return graph.logits[:n]

    def _wait_for_last_copies(self) -> None:
        """The pinned host buffers are rewritten below: the last step's copies must be done.

        (They always are when the caller read the last logits back; this keeps them safe for a
        caller that does not.)"""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _lora_shape(self, slots: Sequence[int], bucket: int) -> Shape | None:
        """The LoRA graph shape of ``slots``, with its metadata filled in (None: no adapter).

        ``(segments, longest segment, stage width, stage rank)``; width 0: not staged.
        Decode batches keep their rows and adapters for many steps in a row, so when
        ``slots`` equal the last step's (same bucket, same stage and slot contents) the static
        metadata already holds them and the step skips the host work and the copy."""
        manager = self.runner.lora
        if manager is None:
            return None
        key = (bucket, tuple(slots), manager.stage.epoch, manager.version)
        if key == self._last_slots:
            manager.check_slots(self._last_adapters)
            manager.stage.touch(self._last_adapters)
            return self._last_shape
        segments = segments_of(slots)
        manager.check_slots(segments[2])
        shape: Shape | None = None
        if segments[2]:
            positions, width, rank = manager.assign_stage(segments[2])  # copies A where needed
            shape = (*static_shape(segments, bucket), width, rank)
            self._lora_batch(bucket, shape).fill(slots, segments, positions, manager.slot_values())
        # (the key after assign: a copy it made bumped the epoch)
        key = (bucket, tuple(slots), manager.stage.epoch, manager.version)
        self._last_slots, self._last_shape, self._last_adapters = key, shape, segments[2]
        return shape

    def _dp_lora_shape(
        self, slots: Sequence[int], dp_slots: Sequence[Sequence[int]], bucket: int
    ) -> Shape | None:
        """``_lora_shape`` of a DP-attention step: the shape of the TP-global slots (every
        group's rows padded to ``bucket``, in group order), with the local (``slots``, this
        group's) and global metadata filled in. Every rank computes the same shape."""
        manager = self.runner.lora
        if manager is None:
            return None
        global_slots = [s for g in dp_slots for s in (*g, *[NO_ADAPTER] * (bucket - len(g)))]
        key = (bucket, tuple(global_slots), 0, manager.version)
        if key == self._last_slots:
            manager.check_slots(self._last_adapters)
            return self._last_shape
        segments = segments_of(global_slots)
        manager.check_slots(segments[2])
        shape: Shape | None = None
        if segments[2]:
            shape = (*static_shape(segments, len(global_slots)), 0, 0)
            values = manager.slot_values()
            self._lora_batch(bucket, shape).fill(slots, None, None, values)
            self._lora_batch(bucket, shape, gathered=True).fill(
                global_slots, segments, None, values
            )
        self._last_slots, self._last_shape, self._last_adapters = key, shape, segments[2]
        return shape

    def _fill(self, batch: ForwardBatch, bucket: int) -> None:
        n = batch.num_tokens
        host = self._inputs_host[:, :bucket]
        for i, t in enumerate((batch.input_ids, batch.positions, batch.cache_rows)):
            host[i, :n].copy_(t)  # host to pinned host when the executor built it on the host
        host[:, n:] = 0
        host[2, n:] = self.spare_row
        self._inputs[:, :bucket].copy_(host, non_blocking=True)
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _lora_batch(self, bucket: int, shape: Shape, gathered: bool = False) -> StaticLoRABatch:
        """A graph's static LoRA metadata: of its ``bucket`` rows, or with ``gathered`` of the
        TP-global rows of a DP-attention graph (``dp x bucket`` rows)."""
        static = self._lora.get((bucket, shape, gathered))
        if static is None:
            manager = self.runner.lora
            assert manager is not None
            rows = self.dp_size * bucket if gathered else bucket
            static = self._lora[(bucket, shape, gathered)] = StaticLoRABatch(
                rows,
                shape[0],
                manager.slot_ranks,
                manager.slot_scalings,
                self.runner.device,
                max_seg_len=min(shape[1], rows),
                stage_width=shape[2],
                stage_rank=shape[3],
            )
        return static

    def _static_batch(self, bucket: int) -> ForwardBatch:
        ids, positions, rows = self._inputs[:, :bucket]
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            cache_rows=rows,
            chunks=[
                SeqChunk(cache_row=0, start=0, length=1, token_offset=i) for i in range(bucket)
            ],
            logit_rows=self._logit_rows[:bucket],
            # every group's rows padded to the bucket: the gathers move fixed-size blocks
            dp_token_counts=[bucket] * self.dp_size if self.dp_size > 1 else [],
            dp_logit_counts=[bucket] * self.dp_size if self.dp_size > 1 else [],
        )

    def _capture(self, bucket: int, shape: Shape | None) -> _Graph:
        runner = self.runner
        batch = self._static_batch(bucket)
        static = self._lora_batch(bucket, shape) if shape is not None else None
        gathered = (
            self._lora_batch(bucket, shape, gathered=True)
            if shape is not None and self.dp_size > 1
            else None
        )
        out = self._logits[:bucket]
        forward = static_forward(runner, batch, out, static, gathered)
        if not self.capture:
            log.info("a decode graph's static step (not captured): %d rows, LoRA %s", bucket, shape)
            return _Graph(graph=None, forward=forward, logits=out)
        graph = capture_graph(runner, forward, self._stream, self.pool)
        log.info(
            "captured a decode graph: %d rows, LoRA %s",
            bucket,
            f"on (<= {shape[0]} adapters, <= {shape[1]} rows each, stage {shape[2]} x r{shape[3]})"
            if shape
            else "off",
        )
        return graph


def static_forward(
    runner: ModelRunner,
    batch: ForwardBatch,
    out: torch.Tensor,
    static: StaticLoRABatch | None,
    gathered: StaticLoRABatch | None = None,
) -> Callable[[], torch.Tensor]:
    """The step a graph captures: ``runner``'s model over ``batch`` (static buffers), with the
    LoRA metadata of ``static`` (and under DP attention ``gathered``, the TP-global rows'),
    or no LoRA work at all (None), its logits copied into ``out``."""

    def forward() -> torch.Tensor:
        if runner.lora is not None:
            runner.lora.reset_batch_state()  # a LoRA-off graph must capture no LoRA work
        if static is not None:
            assert runner.lora is not None
            info = static.info()
            runner.lora.ctx.local = info
            runner.lora.ctx.global_ = gathered.info() if gathered is not None else info
        try:
            out.copy_(runner.model(batch, runner.kv))
            return out
        finally:
            if runner.lora is not None:
                runner.lora.reset_batch_state()

    return forward


@contextmanager
def _as_captured(runner: ModelRunner) -> Iterator[None]:
    """Overlap the LoRA as a capture would ("auto" overlaps only while capturing)."""
    backend = runner.lora.ctx.backend if runner.lora is not None else None
    if backend is None or backend.overlap != "auto":
        yield
        return
    backend.overlap = "on"
    try:
        yield
    finally:
        backend.overlap = "auto"


def capture_graph(
    runner: ModelRunner,
    forward: Callable[[], torch.Tensor],
    side: torch.cuda.Stream | None,
    pool: object,
) -> _Graph:
    """``forward`` (a step over static buffers that returns its logits buffer) captured in a
    CUDA graph in ``pool``, after two warm-up runs on the ``side`` stream.

    The buffers hold this step's values: the warm-up runs and the capture compute this step
    (KV writes included) and the first replay recomputes it with the same inputs. Warm-ups
    take the overlapped LoRA path the capture takes, so every kernel variant is compiled and
    loaded before the capture starts."""
    assert side is not None
    side.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(side), _as_captured(runner):
        for _ in range(2):  # compile kernels and settle the allocator outside the capture
            forward()
    torch.cuda.current_stream(runner.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # (no adapter is page-locked on another thread meanwhile: CUDA_CAPTURE_LOCK)
    with CUDA_CAPTURE_LOCK, torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return _Graph(graph=graph, forward=forward, logits=logits)
