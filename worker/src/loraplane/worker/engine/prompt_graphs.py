"""CUDA graphs of prompt steps: prompt chunks, alone or beside running decodes, per token bucket.

A step that feeds prompt tokens (a prefill, or a mixed step: chunks of new prompts beside the
running sequences' decodes) launches 18 Triton kernels and a handful of GEMMs a layer. Up to
about a thousand tokens the GPU runs them faster than Python launches them: on an H100, eight
layers of the Llama-3-8B shape with 48 decode rows and three 256-token chunks took the host
5.7 ms to launch without LoRA and 15.1 ms with it, against 6.4 / 13.4 ms for the whole step
(docs/performance.md). A graph replays the whole step in one launch, as ``DecodeGraphs`` does
for decode steps. What makes a prompt step capturable:

* Its tokens live in static buffers of the bucket's size (``prompt_buckets``: 64, then steps
  of 128 tokens), one row past the step's tokens at least. Padding tokens decode token 0 at
  position 0 of the spare page-table row (``DecodeGraphs``' too), with no adapter; their
  attention output is zeroed (``ForwardBatch.padded``).
* Attention reads everything from the device: the one-token rows (the decodes) through
  ``decode_attention`` over a fixed count of rows (padding rows attend the spare row's first
  position and write into the last padding token's row), the prompt chunks through
  ``extend_attention`` over a fixed count of tiles (padding tiles cover no query and write
  nothing). Both counts follow from the bucket and the worker's running cap (``_Sizes``).
* The logit rows (each chunk's last token) are a fixed count too; padding rows read row 0.
* LoRA metadata sits in a ``StaticLoRABatch`` of the bucket's rows whose segments hold up to
  the bucket's tokens. A graph is keyed by the distinct adapters rounded up to a power of two
  (``static_shape``) and, as a decode graph is, by the stage: a step whose adapters fit the
  stage (``LoRAManager.assign_stage``, which copies their A rows in where needed) runs the
  stacked GEMMs and fused epilogues at the stage's width and rank (``Shape``; its rows
  grouped by position in tiles, as a decode graph's, below ``kernels.stacked.ROWS_KERNEL_MIN``
  rows, else a program per row block); one with more adapters runs the shrink and expand
  kernels, the same at every rank of adapter (width and rank 0).

All the step's integers go to the device in one copy from page-locked memory. Steps of more
tokens than the largest bucket (long prompts: the GPU's time covers their launches), steps
that want logits of other rows than each chunk's last (prompt log-probabilities) and
multi-rank workers run eagerly, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplane.worker.engine.graphs import _Graph, capture_graph, static_forward
from loraplane.worker.kernels._triton_utils import cdiv
from loraplane.worker.lora.batch_info import StaticLoRABatch, segments_of, static_shape
from loraplane.worker.models.batch import (
    PROMPT_TILE,
    ForwardBatch,
    SeqChunk,
    SingleTokens,
    prompt_tiles,
)

if TYPE_CHECKING:
    from loraplane.worker.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# The smallest bucket, and the step between buckets past it (tokens).
FIRST_BUCKET = 64
BUCKET_STEP = 128
# The largest prompt step with a graph by default: past it the GPU's time covers the launches
# (eight 256-token chunks beside 48 decodes: 13.1 ms on the GPU, 6.6 ms to launch).
DEFAULT_MAX_TOKENS = 1024


def prompt_buckets(max_tokens: int) -> list[int]:
    """Token counts that get a prompt-step graph: 64, 128, then steps of 128 up to
    ``max_tokens`` (itself a bucket); none for 0."""
    if max_tokens < 0:
        raise ValueError(f"the largest prompt-step graph must be >= 0 tokens, got {max_tokens}")
    if max_tokens == 0:
        return []
    steps = [FIRST_BUCKET, *range(BUCKET_STEP, max_tokens, BUCKET_STEP)]
    return [b for b in steps if b < max_tokens] + [max_tokens]


@dataclass(frozen=True, slots=True)
class _Sizes:
    """The fixed counts of a bucket's graph, for a worker of ``max_seqs`` running sequences."""

    tokens: int
    singles: int  # one-token rows: every running sequence but one (a step feeds a prompt)
    tiles: int  # prompt tiles: a tile per PROMPT_TILE tokens, plus one per chunk at most
    logits: int  # one per chunk

    @classmethod
    def of(cls, tokens: int, max_seqs: int) -> _Sizes:
        return cls(
            tokens=tokens,
            singles=max(1, min(max_seqs - 1, tokens - 2)),
            tiles=cdiv(tokens, PROMPT_TILE) + max(1, min(max_seqs, tokens // 2)),
            logits=max(1, min(max_seqs, tokens - 1)),
        )


# A LoRA prompt graph's (adapters' power-of-two class, stage width, stage rank); width 0: the
# step is not staged (it runs the shrink and expand kernels).
Shape = tuple[int, int, int]


def _even(n: int) -> int:
    return n + (n & 1)  # int64 entries: an even count keeps the next part 16-byte aligned


class PromptGraphs:
    """Replays captured prompt steps for ``ModelRunner.forward`` (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        max_tokens: int,
        spare_row: int,
        *,
        capture: bool = True,
        pool: object = None,
    ) -> None:
        """``capture=False`` runs the same static-buffer steps without graphs (any device):
        how the CPU tests check them against the eager path. ``pool``: the graph memory pool
        to share (the decode graphs'; steps never run at once)."""
        self.runner = runner
        self.buckets = prompt_buckets(max_tokens)
        if not self.buckets:
            raise ValueError("PromptGraphs needs a largest prompt step of at least one token")
        self.spare_row = spare_row
        self.capture = capture
        # Whether ``supports`` takes any step: the warm-up runs its eager steps with it off.
        self.enabled = True
        max_seqs = runner.config.max_seqs
        self._sizes = {b: _Sizes.of(b, max_seqs) for b in self.buckets}
        top = _Sizes.of(self.buckets[-1], max_seqs)
        self._top = top
        # One int64 buffer, one host-to-device copy a step: input ids | positions | cache rows
        # (top.tokens each) | the one-token rows' local rows | cache rows | positions
        # (top.singles each) | logit rows (top.logits) | prompt tiles (int32 [top.tiles, 4]).
        spans = [_even(top.tokens)] * 3 + [_even(top.singles)] * 3 + [_even(top.logits)]
        spans.append(top.tiles * 2)
        self._offsets = [sum(spans[:i]) for i in range(len(spans) + 1)]
        device = runner.device
        self._dev = torch.zeros(self._offsets[-1], dtype=torch.int64, device=device)
        self._host = torch.zeros(
            self._offsets[-1], dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        self._logits = torch.empty(
            top.logits, runner.model_config.vocab_size, dtype=runner.dtype, device=device
        )
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy
        self._stream = torch.cuda.Stream(device) if capture else None  # warm-ups
        self._pool = (pool or torch.cuda.graph_pool_handle()) if capture else None
        self._graphs: dict[tuple[int, Shape | None], _Graph] = {}
        self._failed: set[tuple[int, Shape | None]] = set()
        self._lora: dict[tuple[int, Shape], StaticLoRABatch] = {}
        self.replays = 0

    @property
    def keys(self) -> set[tuple[int, Shape | None]]:
        """The graphs made so far: (bucket, LoRA ``Shape`` or None)."""
        return set(self._graphs)

    def bucket_for(self, tokens: int) -> int:
        """The bucket of a step of ``tokens`` (one padding row at least)."""
        return next(b for b in self.buckets if b > tokens)

    def supports(self, batch: ForwardBatch) -> bool:
        """A prompt step of fewer tokens than the largest bucket that wants each chunk's
        last row's logits, in order (every prompt step but one with prompt log-probabilities)."""
        n = batch.num_tokens
        return (
            self.enabled
            and 0 < n < self.buckets[-1]
            and not batch.is_decode
            and not batch.dp_token_counts
            and all(c.length >= 1 for c in batch.chunks)
            and batch.logit_rows.numel() == len(batch.chunks)
        )

    def run(
        self,
        batch: ForwardBatch,
        slots: Sequence[int],
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Logits [chunks, vocab] of a prompt step (each chunk's last row), by graph replay.

        ``carry`` as ``DecodeGraphs.run`` takes it. The logits are a view of a buffer the next
        step rewrites: read them first. None when this step's graph could not be captured
        (the caller runs the step eagerly)."""
        n = batch.num_tokens
        bucket = self.bucket_for(n)
        if self._copied is not None:  # (the host buffer is rewritten below)
            self._copied.synchronize()
            self._copied = None
        shape = self._lora_shape(slots, bucket)
        key = (bucket, shape)
        if key in self._failed:
            return None
        self._fill(batch, bucket)
        if carry is not None:
            from loraplane.worker.engine.runner import put_carried

            put_carried(self._dev[: self._offsets[1]][:bucket], carry)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = self._capture(bucket, shape)
            except Exception:
                log.exception(
                    "could not capture a prompt-step graph of %d tokens (LoRA %s); "
                    "these steps run eagerly",
                    bucket,
                    shape,
                )
                self._failed.add(key)
                return None
        graph.replay()
        self.replays += 1
        return graph.logits[: len(batch.chunks)]

    def _lora_shape(self, slots: Sequence[int], bucket: int) -> Shape | None:
        """The step's LoRA ``Shape``, its metadata filled in (None: no adapter). Staged
        when its adapters fit the stage (their A rows copied in where needed)."""
        manager = self.runner.lora
        if manager is None:
            return None
        segments = segments_of(slots)
        manager.check_slots(segments[2])
        if not segments[2]:
            return None
        positions, width, rank = manager.assign_stage(segments[2])
        shape = (static_shape(segments, bucket)[0], width, rank)
        static = self._lora_batch(bucket, shape)
        static.fill(slots, segments, positions, manager.slot_values())
        return shape

    def _lora_batch(self, bucket: int, shape: Shape) -> StaticLoRABatch:
        static = self._lora.get((bucket, shape))
        if static is None:
            manager = self.runner.lora
            assert manager is not None
            static = self._lora[(bucket, shape)] = StaticLoRABatch(
                bucket,
                shape[0],
                manager.slot_ranks,
                manager.slot_scalings,
                self.runner.device,
                max_seg_len=bucket,
                stage_width=shape[1],
                stage_rank=shape[2],
            )
        return static

    def _part(self, i: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        buffer = self._dev if buffer is None else buffer
        return buffer[self._offsets[i] : self._offsets[i + 1]]

    def _fill(self, batch: ForwardBatch, bucket: int) -> None:
        n, size, top = batch.num_tokens, self._sizes[bucket], self._top
        chunks = batch.chunks
        singles = [c for c in chunks if c.length == 1]
        tiles = prompt_tiles(chunks, PROMPT_TILE)
        if len(singles) > size.singles or len(tiles) > size.tiles or len(chunks) > size.logits:
            raise ValueError(
                f"a step of {n} tokens ({len(singles)} one-token rows, {len(tiles)} prompt "
                f"tiles, {len(chunks)} chunks) does not fit the graph of {bucket} tokens "
                f"({size.singles}, {size.tiles}, {size.logits})"
            )
        host = self._host
        for i, t in enumerate((batch.input_ids, batch.positions, batch.cache_rows)):
            part = self._part(i, host)
            part[:n].copy_(t)  # host to pinned host when the executor built it on the host
            part[n:bucket] = self.spare_row if i == 2 else 0
        pad = size.singles - len(singles)
        unused = [0] * (top.singles - size.singles)  # (past this bucket's views)
        parts = (
            [c.token_offset for c in singles] + [bucket - 1] * pad + unused,  # (bucket > n)
            [c.cache_row for c in singles] + [self.spare_row] * pad + unused,
            [c.start for c in singles] + [0] * pad + unused,
            [c.token_offset + c.length - 1 for c in chunks] + [0] * (top.logits - len(chunks)),
        )
        for i, values in enumerate(parts, start=3):
            self._part(i, host)[: len(values)].copy_(torch.tensor(values, dtype=torch.int64))
        tiles += [(0, self.spare_row, 0, 0)] * (top.tiles - len(tiles))  # cover no query
        self._part(7, host).view(torch.int32).copy_(
            torch.tensor(tiles, dtype=torch.int32).reshape(-1)
        )
        self._dev.copy_(host, non_blocking=True)
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _static_batch(self, bucket: int) -> ForwardBatch:
        size = self._sizes[bucket]
        batch = ForwardBatch(
            input_ids=self._part(0)[:bucket],
            positions=self._part(1)[:bucket],
            cache_rows=self._part(2)[:bucket],
            # (a stand-in: the static step's attention reads the tensors set below)
            chunks=[SeqChunk(cache_row=self.spare_row, start=0, length=2, token_offset=0)],
            logit_rows=self._part(6)[: size.logits],
            padded=True,
        )
        batch._singles = SingleTokens(
            self._part(3)[: size.singles],
            self._part(4)[: size.singles],
            self._part(5)[: size.singles],
        )
        tiles = self._part(7).view(torch.int32).view(-1, 4)[: size.tiles]
        batch._tiles = (tiles.device, PROMPT_TILE, tiles)  # (cuda:0, as the step's q: not "cuda")
        return batch

    def _capture(self, bucket: int, shape: Shape | None) -> _Graph:
        runner = self.runner
        size = self._sizes[bucket]
        static = self._lora_batch(bucket, shape) if shape is not None else None
        out = self._logits[: size.logits]
        forward = static_forward(runner, self._static_batch(bucket), out, static)
        if not self.capture:
            log.info(
                "a prompt step's static step (not captured): %d tokens, LoRA %s", bucket, shape
            )
            return _Graph(graph=None, forward=forward, logits=out)
        graph = capture_graph(runner, forward, self._stream, self._pool)
        lora = "off"
        if shape is not None:
            staged = f", stage {shape[1]} x r{shape[2]}" if shape[1] else ""
            lora = f"on (<= {shape[0]} adapters{staged})"
        log.info("captured a prompt-step graph: %d tokens, LoRA %s", bucket, lora)
        return graph
