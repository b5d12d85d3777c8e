"""Run forward passes of one rank's model, with its KV cache and LoRA slots."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.graphs import DecodeGraphs, graphs_enabled
from loraplane.worker.engine.pages import pages_for
from loraplane.worker.engine.prompt_graphs import DEFAULT_MAX_TOKENS, PromptGraphs
from loraplane.worker.lora.adapter import (
    AdapterWeights,
    blank_adapter,
    load_adapter,
    page_locked,
)
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.lora.manager import LoRAManager, stages_eager_batches
from loraplane.worker.models.batch import ForwardBatch, SeqChunk
from loraplane.worker.models.kv_cache import DEFAULT_PAGE_SIZE, KVCache
from loraplane.worker.models.loader import load_model, resolve_dtype
from loraplane.worker.models.model import Attention
from loraplane.worker.parallel.state import ParallelState


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's own dtype
    max_seqs: int = 64  # page-table rows: running sequences at most
    max_len: int = 1024
    # The paged KV pool (models/kv_cache.py): positions per page, and pages to hand out
    # (None: ``max_seqs`` rows of ``max_len``, the one-row-per-sequence capacity).
    page_size: int = DEFAULT_PAGE_SIZE
    kv_pages: int | None = None
    # On CUDA without ``kv_pages``: the share of the GPU's memory for the weights, the LoRA
    # slots and the KV pool together (SGLang's mem_fraction_static); the rest is left to
    # activations and CUDA graphs. None: ``max_seqs`` rows of ``max_len``.
    mem_fraction: float | None = None
    lora_backend: str = "triton"
    # Replay decode steps from CUDA graphs (engine/graphs.py): CUDA, each rank its own.
    cuda_graphs: bool = True
    graph_max_batch: int | None = None  # the largest decode batch with a graph; None: max_seqs
    # The largest prompt step (prefill or mixed) replayed from a graph (engine/prompt_graphs.py),
    # in tokens; 0: every prompt step runs eagerly. Single-rank runners with decode graphs.
    graph_max_tokens: int = DEFAULT_MAX_TOKENS
    # How a step's tokens are picked from its logits: engine.sampling.SAMPLERS.
    sampler: str = "auto"

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.graph_max_tokens < 0:
            raise ValueError(
                f"graph_max_tokens must be >= 0 (0: no prompt-step graphs), got {self.graph_max_tokens}"
            )
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError(f"kv_pages must be >= 1 (or None: max_seqs rows), got {self.kv_pages}")
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(
                f"mem_fraction must be in (0, 1): the share of GPU memory for weights, LoRA "
                f"slots and the KV pool; got {self.mem_fraction}"
            )

    @property
    def pages(self) -> int:
        """KV pages the runner's pool hands out, unless sized from memory (``kv_pages_for``)."""
        if self.kv_pages is not None:
            return self.kv_pages
        return self.max_seqs * pages_for(self.max_len, self.page_size)


def _interpret_triton() -> None:
    """Select Triton's interpreter, the only way its kernels run on a CPU. Triton reads
    ``TRITON_INTERPRET`` when a kernel is defined, and ``triton.language`` defines its own
    helpers (``tl.zeros``...) when triton is imported: set after that, our kernels would be
    interpreted and its helpers not ("Cannot call @triton.jit'd outside of the scope of a
    kernel"). torch imports triton on its first ops (dynamo looks for it), so this runs
    before the model is built, and refuses where triton came earlier, or where the
    environment asks for compiled kernels."""
    if "TRITON_INTERPRET" in os.environ:
        value = os.environ["TRITON_INTERPRET"]
        if value.strip().lower() in ("", "0", "false", "off", "no"):
            raise RuntimeError(
                f"TRITON_INTERPRET={value} asks for compiled Triton kernels, which need a GPU: "
                "on a CPU unset it (the worker then selects Triton's interpreter), or use "
                "--lora-backend torch and --sampler torch"
            )
        return  # (the caller's choice)
    if "triton" in sys.modules:
        raise RuntimeError(
            "Triton kernels on a CPU need TRITON_INTERPRET=1 set before triton is imported, "
            "and something imported it first: start the worker with TRITON_INTERPRET=1 in "
            "its environment, or use --lora-backend torch and --sampler torch on a CPU"
        )
    os.environ["TRITON_INTERPRET"] = "1"


class ModelRunner:
    def __init__(
        self,
        config: RunnerConfig,
        lora: LoRARuntimeConfig | None = None,
        ps: ParallelState | None = None,
    ) -> None:
        self.config = config
        self.ps = ps or ParallelState.single()
        self.device = torch.device(config.device)
        triton_kernels = (lora is not None and config.lora_backend == "triton") or (
            config.sampler == "triton"
        )
        if triton_kernels and self.device.type == "cpu":
            _interpret_triton()  # (before the model: torch's first ops may import triton)
        dtype = resolve_dtype(config.dtype) if config.dtype else None
        self.model = load_model(config.model, dtype=dtype, device=self.device, ps=self.ps)
        self.model_config = self.model.config
        self.dtype = self.model.embed_tokens.weight.dtype
        graphs = graphs_enabled(
            config.cuda_graphs, self.device, config.lora_backend if lora is not None else None
        )
        self.lora_config = lora
        if (
            lora is not None
            and self.device.type == "cuda"
            and not graphs
            and not stages_eager_batches(self.device, self.dtype)
        ):
            # Staging serves decode graphs and eager batches where they stage; without
            # either its buffers would be unused. (The CPU keeps them: its tests run the
            # static graph path without capture.)
            lora = dataclasses.replace(lora, stage_slots=0)
        self.lora = LoRAManager(self.model, lora, config.lora_backend) if lora is not None else None
        # The KV pool last: sized from the memory the weights and LoRA slots leave.
        attn = self.model.layers[0].self_attn
        self.kv = KVCache(
            self.model_config.num_layers,
            config.max_seqs + (1 if graphs else 0),  # graphs pad their batches into a spare row
            config.max_len,
            attn.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
            self.device,
            page_size=config.page_size,
            num_pages=kv_pages_for(config, self.model, self.device, self.dtype),
        )
        if graphs:
            self.kv.point_at_spare(config.max_seqs)
        self.graphs = (
            DecodeGraphs(
                self,
                config.graph_max_batch or config.max_seqs,
                config.max_seqs,
                capture=self.device.type == "cuda",
            )
            if graphs
            else None
        )
        # Prompt steps from graphs too, where their attention runs the Triton kernels (CUDA;
        # a CPU test selects them with ``Attention.prompt_kernel``) on one rank.
        prompt_kernel = Attention.prompt_kernel
        self.prompt_graphs = (
            PromptGraphs(
                self,
                config.graph_max_tokens,
                config.max_seqs,
                capture=self.device.type == "cuda",
                pool=self.graphs.pool,
            )
            if self.graphs is not None
            and config.graph_max_tokens
            and self.ps.is_single
            and (self.device.type == "cuda" if prompt_kernel is None else prompt_kernel)
            else None
        )

    def read_adapter(self, name: str, path: str | Path) -> AdapterWeights:
        """Validate an adapter against this model (host memory only; no slot is touched)."""
        assert self.lora_config is not None, "this runner was built without LoRA"
        weights = load_adapter(
            name,
            path,
            self.model_config,
            max_rank=self.lora_config.max_lora_rank,
            allowed_modules=self.lora.enabled_modules if self.lora else (),
            experts_enabled=self.lora_config.experts,
            slot_dtype=self.dtype,
        )
        return page_locked(weights, self.device)  # (on the adapter thread)

    def blank_adapter(self, name: str, rank: int) -> AdapterWeights:
        """A zero adapter of ``rank`` over every target this runner's slots hold."""
        assert self.lora is not None, "this runner was built without LoRA"
        return blank_adapter(name, rank, self.lora.enabled_modules)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        local_slots: Sequence[int] | None = None,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] of `batch.logit_rows`; `local_slots` is the LoRA slot per token.

        `batch` may be on the host (cheapest: a decode step replayed from a CUDA graph copies
        it into the graph's buffers) or on the runner's device. The logits of a graph step are
        a view of a buffer the next forward rewrites: read them (`.cpu()`) before that.

        Under DP attention every rank calls this once per step, idle or not: the ranks
        exchange their token counts and per-token adapter slots here, so the TP-global
        sections see every DP group's tokens with their own adapters, and every rank takes
        the graph step (``DecodeGraphs``, the same bucket on every rank) or the eager one
        from what all groups sent.

        ``carry`` ``(ids, index [2, k])``: input token ``index[0, j]`` is ``ids[index[1, j]]``,
        a previous step's sampled id still on the device (overlapped steps, ADR 0014); the
        copy is a device op, so the host does not wait for that step.
        """
        ps = self.ps
        slots = list(local_slots) if local_slots is not None else [NO_ADAPTER] * batch.num_tokens
        self.kv.sync_table(batch.chunks)  # (before a graph replay too: it reads the table)
        graphs = self.graphs
        groups: list[tuple[int, int, list[int], bool]] = []
        if ps.dp_attention:
            graphable = graphs is not None and graphs.supports(batch)
            mine = (batch.num_tokens, int(batch.logit_rows.numel()), slots, graphable)
            everyone = ps.all_gather_object_tp(mine)
            groups = [everyone[r] for r in ps.dp_group_leaders()]
            if graphs is not None and all(g[3] for g in groups) and any(g[0] for g in groups):
                logits = graphs.run(batch, slots, carry, dp_slots=[g[2] for g in groups])
                if logits is not None:
                    return logits
        elif graphs is not None and graphs.supports(batch):
            logits = graphs.run(batch, slots, carry)
            if logits is not None:
                return logits
        elif self.prompt_graphs is not None and self.prompt_graphs.supports(batch):
            logits = self.prompt_graphs.run(batch, slots, carry)
            if logits is not None:
                return logits
        batch = batch.to(self.device)
        if carry is not None:
            put_carried(batch.input_ids, carry)
        global_slots: list[int] | None = None
        if ps.dp_attention:
            batch.dp_token_counts = [g[0] for g in groups]
            batch.dp_logit_counts = [g[1] for g in groups]
            global_slots = [s for g in groups for s in g[2]]
        if self.lora is not None:
            # Built afresh every forward; no adapter anywhere (or an idle rank) means no
            # batch info, so every wrapper takes the base path (seed 004).
            self.lora.prepare_batch(slots, global_slots)
        try:
            return self.model(batch, self.kv)  # type: ignore[no-any-return]
        finally:
            if self.lora is not None:
                self.lora.reset_batch_state()


def kv_pages_for(
    config: RunnerConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> int:
    """Pages of the runner's pool: ``config.pages``, or on CUDA with ``mem_fraction`` (and no
    ``kv_pages``) what fits in ``mem_fraction`` of the GPU's memory beside what is allocated
    now (the weights and the LoRA slots), at most ``max_seqs`` full rows."""
    if config.kv_pages is not None or config.mem_fraction is None or device.type != "cuda":
        return config.pages
    layers = model.config.num_layers  # type: ignore[union-attr]
    attn = model.layers[0].self_attn  # type: ignore[index]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    page_bytes = 2 * layers * config.page_size * attn.num_kv_heads * attn.head_dim * itemsize
    total = torch.cuda.get_device_properties(device).total_memory
    left = config.mem_fraction * total - torch.cuda.memory_allocated(device)
    pages = int(left // page_bytes)
    if pages < pages_for(config.max_len, config.page_size):
        raise RuntimeError(
            f"--mem-fraction {config.mem_fraction} leaves {max(0, int(left)) >> 20} MiB for the "
            f"KV pool after the weights and LoRA slots, {pages} pages of {page_bytes >> 10} KiB: "
            f"fewer than one sequence of max_model_len {config.max_len} needs; raise "
            "--mem-fraction or lower --max-model-len"
        )
    return min(pages, config.pages)


def put_carried(input_ids: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``input_ids[index[0]] = ids[index[1]]`` on the device (``ModelRunner.forward``)."""
    ids, index = carry
    input_ids.index_copy_(0, index[0], ids.index_select(0, index[1]).to(input_ids.dtype))


def prefill_batch(
    prompts: Sequence[Sequence[int]],
    cache_rows: Sequence[int],
    *,
    all_logits: bool,
    device: torch.device | str,
) -> ForwardBatch:
    chunks, offset = [], 0
    for ids, row in zip(prompts, cache_rows, strict=True):
        chunks.append(SeqChunk(cache_row=row, start=0, length=len(ids), token_offset=offset))
        offset += len(ids)
    return ForwardBatch.from_chunks(
        [list(p) for p in prompts], chunks, all_logits=all_logits, device=device
    )


def decode_batch(
    last_tokens: Sequence[int],
    cache_rows: Sequence[int],
    starts: Sequence[int],
    device: torch.device | str,
) -> ForwardBatch:
    chunks = [
        SeqChunk(cache_row=row, start=start, length=1, token_offset=i)
        for i, (row, start) in enumerate(zip(cache_rows, starts, strict=True))
    ]
    return ForwardBatch.from_chunks(
        [[t] for t in last_tokens], chunks, all_logits=False, device=device
    )
