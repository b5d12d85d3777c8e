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
from loraplane.worker.lora.batch_info import NO_ADAPTER, LoRABatchInfo
from loraplane.worker.lora.layers import ColumnLoRA, ExpertsLoRA, LoRAContext, LoRALayer, RowLoRA
from loraplane.worker.lora.stage import Stage
from loraplane.worker.models.model import MLP, CausalLM, SparseMoE


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
        self.version = 0  # bumped whenever a slot's contents change (load_slot, clear_slot)
        # layer index -> wrappers of that layer
        self.layers: list[list[LoRALayer]] = []
        self.experts: list[ExpertsLoRA | None] = []
        targets = set(config.target_modules)
        k, r = self.num_slots, config.max_lora_rank
        # Stacked shrinks need the Triton kernels (graphs run no others) and one rank.
        backend_name = self.ctx.backend.name
        p = min(config.stage_slots, k) if backend_name == "triton" and ps.is_single else 0
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
        )

    # --- slots -------------------------------------------------------------------------

    def load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy a validated adapter into `slot`; modules it lacks are zeroed."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
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
                ew = {(e, m): ab for (li, e, m), ab in adapter.experts.items() if li == layer_idx}
                experts.set_expert_slot(slot, ew, adapter.rank)
        self.slot_ranks[slot] = adapter.rank
        self.slot_scalings[slot] = adapter.scaling
        self.slot_adapters[slot] = adapter
        self.version += 1

    def clear_slot(self, slot: int) -> None:
        self.stage.forget(slot)
        for wrappers in self.layers:
            for w in wrappers:
                w.clear_slot(slot)
        for experts in self.experts:
            if experts is not None:
                experts.clear_slot(slot)
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0
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
        """Every slot a token uses holds an adapter."""
        for s in slots:
            if s != NO_ADAPTER and self.slot_adapters[s] is None:
                raise RuntimeError(f"a token uses slot {s}, which holds no adapter")

    def prepare_batch(
        self, local_slots: Sequence[int], global_slots: Sequence[int] | None = None
    ) -> None:
        """Batch info for this forward: DP-local rows and (with DP attention) TP-global rows.

        `global_slots` is the per-token slot ids all-gathered from every DP group, in
        group order; every rank must pass the same list.
        """
        self.check_slots([*local_slots, *(global_slots or [])])
        self.ctx.local = LoRABatchInfo.build(
            local_slots, self.slot_ranks, self.slot_scalings, self.device
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
