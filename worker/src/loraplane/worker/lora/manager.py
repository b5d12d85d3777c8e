"""Attach LoRA wrappers to a model and manage its GPU slots and per-batch metadata.

Slot bookkeeping (which adapter sits in which slot, who is evicted) is decided by the
engine's residency logic, which is plain Python; this class only moves weights into and
out of slots and builds the batch info every forward needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplane.worker.config import ATTN_MODULES, MLP_MODULES, LoRARuntimeConfig
from loraplane.worker.lora.adapter import AdapterWeights
from loraplane.worker.lora.backend import LoRABackend, make_backend
from loraplane.worker.lora.batch_info import (
    NO_ADAPTER,
    LoRABatchInfo,
    Segments,
    StaticLoRABatch,
    segments_of,
    static_shape,
)
from loraplane.worker.lora.layers import ColumnLoRA, ExpertsLoRA, LoRAContext, LoRALayer, RowLoRA
from loraplane.worker.lora.stage import Stage, default_positions, stage_width
from loraplane.worker.models.model import MLP, CausalLM, SparseMoE

# On CUDA, eager batches of at most this many rows are staged when their adapters fit the
# stage (decode steps past the largest graph bucket or with graphs off, small prefills);
# larger ones run the shrink and expand kernels. Staged eager metadata buffers kept, by shape.
EAGER_STAGE_MAX_ROWS = 256
EAGER_STAGE_CACHE = 16


def stages_eager_batches(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether eager batches stage (``LoRAManager._staged_info``): on CUDA, for 16-bit models.

    Rows without an adapter then go through the fused epilogues instead of the LoRA-off
    SwiGLU, rotation and residual add. In fp32 on an H200 those differ in the last bits;
    rounded to bf16 they matched the LoRA-off step bit for bit in every checked step
    (tests/gpu/test_decode_graphs.py), as staged graphs do (ADR 0007). An fp32 model (a
    numerics check) keeps the unstaged kernels, whose rows without an adapter are the LoRA-off
    bits by construction; so does the CPU, whose LoRA-off ops are torch's."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


class LoRAManager:
    def __init__(
        self, model: CausalLM, config: LoRARuntimeConfig, backend: str | LoRABackend = "triton"
    ) -> None:
        self.model = model
        self.config = config
        ps = model.ps
        device = model.embed_tokens.weight.device
        self.device = device
        self.num_slots = config.max_loras_per_batch
        self.ctx = LoRAContext(
            make_backend(backend) if isinstance(backend, str) else backend, ps.dp_attention
        )
        self.slot_ranks = torch.zeros(self.num_slots, dtype=torch.int32, device=device)
        self.slot_scalings = torch.zeros(self.num_slots, dtype=torch.float32, device=device)
        self.slot_adapters: list[AdapterWeights | None] = [None] * self.num_slots
        # On CUDA a slot load is copied on a stream of its own (``load_slot``), so the steps
        # queued after it run while it copies; ``overlap_loads = False`` copies on the step
        # stream instead (the probe compares the two). Each slot's load in
        # flight, by its event: a step that uses the slot waits for it on the device. (Other
        # devices copy at once.)
        self.overlap_loads = True
        self._copy_stream: torch.cuda.Stream | None = None
        self._loading: dict[int, torch.cuda.Event] = {}
        self.version = 0  # bumped whenever a slot's contents change (load_slot, clear_slot)
        # layer index -> wrappers of that layer
        self.layers: list[list[LoRALayer]] = []
        self.experts: list[ExpertsLoRA | None] = []
        targets = set(config.target_modules)
        k, r = self.num_slots, config.max_lora_rank
        # Stacked shrinks need the Triton kernels (graphs run no others) and one rank.
        backend_name = self.ctx.backend.name
        slots = config.stage_slots
        if slots is None:
            has_experts = any(isinstance(ly.mlp, SparseMoE) for ly in model.layers)
            slots = default_positions(has_experts, k, r)
        p = min(slots, k) if backend_name == "triton" and ps.is_single else 0
        for layer in model.layers:
            wrappers: list[LoRALayer] = []
            attn = layer.self_attn
            if targets & {"q_proj", "k_proj", "v_proj"}:
                attn.qkv_proj = ColumnLoRA(
                    attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), self.ctx, "local", k, r, p
                )
                wrappers.append(attn.qkv_proj)
            if "o_proj" in targets:
                attn.o_proj = RowLoRA(attn.o_proj, "o_proj", self.ctx, "local", k, r, p)
                wrappers.append(attn.o_proj)
            mlp = layer.mlp
            if isinstance(mlp, MLP):
                if targets & {"gate_proj", "up_proj"}:
                    mlp.gate_up_proj = ColumnLoRA(
                        mlp.gate_up_proj, ("gate_proj", "up_proj"), self.ctx, "global", k, r, p
                    )
                    wrappers.append(mlp.gate_up_proj)
                if "down_proj" in targets:
                    mlp.down_proj = RowLoRA(mlp.down_proj, "down_proj", self.ctx, "global", k, r, p)
                    wrappers.append(mlp.down_proj)
                self.experts.append(None)
            elif isinstance(mlp, SparseMoE) and config.experts:
                self.experts.append(ExpertsLoRA(mlp.experts, self.ctx, k, r))
            else:
                self.experts.append(None)
            self.layers.append(wrappers)
        self.enabled_modules = tuple(m for m in ATTN_MODULES + MLP_MODULES if m in targets)
        self.stage = Stage(
            p,
            [w for wrappers in self.layers for w in wrappers if w.stacked is not None],
            rank_of=self._rank_of,
            max_rank=r,
            limit=k,
        )
        # Eager batches of up to this many rows are staged (stages_eager_batches).
        eager = stages_eager_batches(device, model.embed_tokens.weight.dtype)
        self.eager_stage_rows = EAGER_STAGE_MAX_ROWS if eager else 0
        # Staged eager batches' metadata, by (rows, static shape).
        self._eager_batches: dict[tuple[int, tuple[int, int, int, int]], StaticLoRABatch] = {}

    # --- slots -------------------------------------------------------------------------

    def load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy a validated adapter into `slot`; modules it lacks are zeroed.

        With ``overlap_loads`` (CUDA) the copies go on the manager's copy stream, after
        every step queued so far (one of them may still read the slot's last adapter), and
        return at once: the steps queued next run beside them, and the first step that uses
        the slot waits for them on the device (``check_slots``). ``slot_loaded`` says when
        they are done, so the engine can keep the slot's requests out of the steps until
        then (docs/adr/0011-slot-loads-beside-the-steps.md). From page-locked memory
        (``AdapterWeights.page_locked_copy``: what a CUDA worker reads adapters into) they
        run at the link's speed: 32 GB/s on an H200 against 6 from pageable memory (ADR
        0010)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if not self.overlap_loads or self.device.type != "cuda":
            self._order_after_load(slot)  # (a load still copying into it would land after)
            self._load_slot(slot, adapter)
            return
        step_stream = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(step_stream)
        with torch.cuda.stream(self._copy_stream):
            self._load_slot(slot, adapter)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._loading[slot] = done

    def slot_loaded(self, slot: int) -> bool:
        """Whether ``slot``'s last load has finished copying (always, without a copy stream)."""
        done = self._loading.get(slot)
        if done is None:
            return True
        if not done.query():
            return False
        del self._loading[slot]
        return True

    def wait_for_loads(self) -> None:
        """Block the host until every slot load in flight has finished copying."""
        for slot in list(self._loading):
            self._loading.pop(slot).synchronize()

    def _order_after_load(self, slot: int) -> None:
        """Make the current stream's next work wait (on the device) for ``slot``'s load."""
        done = self._loading.pop(slot, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        self.stage.forget(slot)
        for layer_idx, wrappers in enumerate(self.layers):
            for w in wrappers:
                weights = {
                    m: adapter.dense[(layer_idx, m)]
                    for m in w.module_names
                    if (layer_idx, m) in adapter.dense
                }
                w.set_slot(slot, weights, adapter.rank)
            experts = self.experts[layer_idx]
            if experts is not None:
                stacks = {
                    m: adapter.expert_stacks[(layer_idx, m)]
                    for m in experts.module_names
                    if (layer_idx, m) in adapter.expert_stacks
                }
                experts.set_expert_slot(slot, stacks, adapter.rank)
        # (``fill_``: a kernel with the value as its argument; ``t[slot] = value`` copies a
        # pageable host scalar and so waits for the stream: for the copy stream's whole load)
        self.slot_ranks[slot].fill_(adapter.rank)
        self.slot_scalings[slot].fill_(adapter.scaling)
        self.slot_adapters[slot] = adapter
        self.version += 1

    def clear_slot(self, slot: int) -> None:
        self._order_after_load(slot)  # (a load still copying into it would land after)
        self.stage.forget(slot)
        for wrappers in self.layers:
            for w in wrappers:
                w.clear_slot(slot)
        for experts in self.experts:
            if experts is not None:
                experts.clear_slot(slot)
        self.slot_ranks[slot].fill_(0)
        self.slot_scalings[slot].fill_(0.0)
        self.slot_adapters[slot] = None
        self.version += 1

    def slot_values(self) -> tuple[list[int], list[float]]:
        """Every slot's rank and scaling, from the host (what ``slot_ranks`` and
        ``slot_scalings`` hold on the device; 0 for an empty slot)."""
        adapters = self.slot_adapters
        return (
            [a.rank if a is not None else 0 for a in adapters],
            [a.scaling if a is not None else 0.0 for a in adapters],
        )

    def _rank_of(self, slot: int) -> int:
        adapter = self.slot_adapters[slot]
        assert adapter is not None, f"slot {slot} holds no adapter"
        return adapter.rank

    @property
    def resident_slots(self) -> int:
        return sum(a is not None for a in self.slot_adapters)

    # --- per batch ---------------------------------------------------------------------

    def check_slots(self, slots: Sequence[int]) -> None:
        """Every slot a token uses holds an adapter; the step about to be queued on the
        current stream then waits on the device for any of their loads still copying. Every
        path that reads slots for a step calls this first (``prepare_batch``, the decode
        graphs)."""
        for s in slots:
            if s != NO_ADAPTER and self.slot_adapters[s] is None:
                raise RuntimeError(f"a token uses slot {s}, which holds no adapter")
        if self._loading:
            for s in set(slots):
                self._order_after_load(s)

    def prepare_batch(
        self, local_slots: Sequence[int], global_slots: Sequence[int] | None = None
    ) -> None:
        """Batch info for this forward: DP-local rows and (with DP attention) TP-global rows.

        `global_slots` is the per-token slot ids all-gathered from every DP group, in
        group order; every rank must pass the same list.
        """
        self.check_slots([*local_slots, *(global_slots or [])])
        segments = segments_of(local_slots)
        staged = None if self.ctx.dp_attention else self._staged_info(local_slots, segments)
        self.ctx.local = staged or LoRABatchInfo.build(
            local_slots, self.slot_ranks, self.slot_scalings, self.device, segments
        )
        if self.ctx.dp_attention:
            assert global_slots is not None, "DP attention needs the all-gathered adapter slots"
            self.ctx.global_ = LoRABatchInfo.build(
                global_slots, self.slot_ranks, self.slot_scalings, self.device
            )
        else:
            self.ctx.global_ = self.ctx.local

    def reset_batch_state(self) -> None:
        self.ctx.reset_batch_state()

    def assign_stage(self, slots: Sequence[int]) -> tuple[dict[int, int] | None, int, int]:
        """Stage positions for a batch's distinct ``slots`` (``Stage.assign``: copies A rows
        where needed), the stage width its stacked GEMMs compute and the stage rank; ``(None,
        0, 0)`` when the batch is not staged."""
        positions = self.stage.assign(slots) if slots else None
        if not positions:
            return None, 0, 0
        return positions, stage_width(positions.values(), self.stage.positions), self.stage.rank

    def _staged_info(self, slots: Sequence[int], segments: Segments) -> LoRABatchInfo | None:
        """The batch info of an eager batch whose adapters all fit the stage, or None.

        An eager step then runs each projection's shrink as a GEMM over the stage's A rows
        and its expand fused into the epilogue that a staged decode graph runs, instead of a
        shrink and an expand launch per projection (their host time dominated eager LoRA
        steps: ~110 us a projection on an H200's host, docs/performance.md). Unlike a graph,
        it runs the base GEMM apart from the stage's (``exact_base``): rows without an
        adapter get the LoRA-off step's GEMM output, and the epilogues' arithmetic on it
        (see ``stages_eager_batches``). ``segments``: ``segments_of(slots)``. Batches of more than
        ``eager_stage_rows`` rows (prefill) keep the shrink and expand kernels, which are
        tuned for them.
        """
        if not self.stage.enabled or not 0 < len(slots) <= self.eager_stage_rows:
            return None
        positions, width, rank = self.assign_stage(segments[2])
        if positions is None:
            return None
        shape = (*static_shape(segments, len(slots)), width, rank)
        key = (len(slots), shape)
        batch = self._eager_batches.get(key)
        if batch is None:
            if len(self._eager_batches) >= EAGER_STAGE_CACHE:
                self._eager_batches.clear()
            batch = self._eager_batches[key] = StaticLoRABatch(
                len(slots),
                shape[0],
                self.slot_ranks,
                self.slot_scalings,
                self.device,
                max_seg_len=shape[1],
                stage_width=width,
                stage_rank=rank,
                pinned=False,  # refilled every step: pageable copies finish before fill returns
                exact_base=True,
            )
        batch.fill(slots, segments, positions, self.slot_values())
        return batch.info()
