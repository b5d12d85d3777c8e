"""Decode benchmark: end-to-end decode tokens/s of our runtime, LoRA off vs on.

    python -m loraplane.worker.bench.decode --device cuda --json [--out FILE]
        [--shape llama3-8b|qwen3-30b-a3b|tiny|tiny-moe] [--layers 8] [--batch-sizes 16,32,64,128]
        [--adapters 1,4,16] [--rank 16] [--context 512] [--steps 10] [--rounds 3] [--cuda-graphs]
        [--order step|variant] [--sampling greedy|chat] [--profile] [--stage-slots P]
        [--max-lora-rank R] [--tp N [--dp D --dp-attention]]

Entry point: ``run_decode_bench(device, batch_sizes, adapters, layers, shape, cuda_graphs, out,
*, rank=16, context=512, steps=10, warmup=3, profile=False, dtype=None, stage_slots=None,
max_rank=None, profile_graphs=(), order="step", sampling="greedy") -> dict``.

What runs (the same engine and settings on both sides of every ratio, all in one process):

* The model is ``CausalLM`` built **in memory** at the real shapes of ``shape`` with ``layers``
  decoder layers and the real vocabulary (no checkpoint is written: a multi-GB safetensors
  round trip would cost minutes and measure nothing), random bf16 weights (std 1/sqrt(fan_in),
  never zeros), wrapped in a ``ModelRunner`` (``_InMemoryRunner``: the real ``forward``, only
  the constructor differs) with its real ``KVCache``.
* The KV cache rows are filled with random values for ``context`` positions instead of running
  a prefill (a decode step costs the same either way); every sequence sits at the same length.
* One decode step = what the engine does per step: ``decode_batch`` (host lists -> device
  tensors), ``ModelRunner.forward`` (which builds ``LoRABatchInfo`` on the host), greedy
  ``argmax`` and ``tolist`` of the next tokens (the host sync that ends every real step), or
  with ``--sampling chat`` the server's sampler at temperature 0.7 and top_p 0.9
  (``sampling.sample_rows``, on the device; ``chat-triton``: its fused kernel, the
  server's ``--sampler triton``; the LM head's weights scaled by
  ``CHAT_LOGIT_STD`` so the random model's distributions are as peaked as a language
  model's).
  Steps advance the position by one. Input tokens are a fixed sequence per step, the same
  for every variant (an MoE routes by token, so each variant runs the same expert work).
  tokens/s = batch size x timed steps / wall time.
* ``--rounds`` rounds go over every variant. Within a round the variants take turns one step
  at a time (``--order step``, the default): step ``s`` of every variant runs before step
  ``s + 1`` of any, each step timed on its own, so a slow phase of the machine (a clock
  change, a neighbour on the host) falls on every variant alike instead of on whichever it
  meets; the turn order follows a balanced Latin square (``turn_order``), so every variant
  follows every other about equally often. ``--order variant`` runs each variant's warm-up
  and steps back to back, as sessions up to 20 did. Switching variants between steps is
  host work outside the timed step, and a variant's graph and LoRA metadata stay as its last
  step left them (``DecodeGraphs`` keeps one per variant, keyed by its slots and the stage
  epoch), so no step pays to re-stage.
  Python's garbage collector stays on, as in the server's decode loop (pausing it for the
  rounds, as ``timeit`` does, makes the ``none`` rows read lower, not closer to 1: three runs
  on an H200).
  Each row's ``tok_s`` is from the median of its steps pooled over the rounds, and
  ``ratio_by_round`` holds one ratio per round (that round's median step against the same
  round's ``off``), whose median and range the table prints: on a shared machine the ratios
  of ``none``, which replays the same LoRA-off graph, show the noise.
* Variants per batch size: ``off`` (no LoRA manager: the base layers), ``none`` (LoRA manager
  attached, ``max(adapters)`` slots loaded, no token uses an adapter), and ``n`` distinct
  adapters (token ``i`` uses slot ``i % n``: mixed traffic), rows ordered by slot as the
  engine orders them, and ``4s``: 4 adapters with the LoRA shrink serial after the base
  projection (``LoRABackend.overlap="off"``; the other variants overlap it on a side stream
  whenever a graph is captured, the backend's default); ``--split-variants 4k1,...``: N
  adapters with the overlapped shrink's K splits capped at C (``overlap_split_k``: qkv and
  gate_up; on one rank the o/down LoRA runs wholly aside, folded into the residual, at the
  default cap). ``--control`` adds ``off2``: LoRA-off again, with graphs of its own (captured
  apart from ``off``'s, so its buffers sit elsewhere): the same kernels, so its ratio is the
  run's noise floor, the spread that no variant's ratio can be read finer than.
  The manager is attached once and swapped in and out of the model (``_LoRASwitch``), so every
  variant runs on the same weights. Adapters: rank ``rank``, every linear target (q, k, v, o,
  gate, up, down; on MoE the attention projections plus per-expert gate/up/down of all 128
  experts); dense adapters are random per adapter, expert LoRA tensors are shared between
  adapters (same cost: each slot is its own buffer).
* Before the timed rows of a batch size, every variant runs once untimed, so one-time costs
  (cuBLAS/SDPA plans, allocator growth, Triton compiles) land on no variant's row.
* ``head`` rows time the step with no decoder layer (embedding, final norm, LM head, sampling)
  so ``projected_ratio_full_depth`` extrapolates each ratio to the real depth (32 / 48 layers):
  ``(H + L b) / (H + L (b + d))`` with ``b``, ``d`` the measured per-layer base and LoRA cost.
* ``--cuda-graphs``: the same steps through the runtime's own decode graphs
  (``engine/graphs.py``: one graph per batch-size bucket and LoRA on/off, static inputs and
  LoRA metadata, decode attention reading lengths on the device). Each variant gets its own
  ``DecodeGraphs``, captured at its first step, so no variant replays another's graph.
  Positions advance as in eager mode. MoE layers on CUDA route their experts on the device
  (``kernels/experts.py``), so MoE steps are captured too. A graph step of at most
  ``--stage-slots`` adapters is staged (ADR 0007: the shrink inside the base GEMM, the expand
  fused into the next kernel; ``--stage-slots 0`` keeps the shrink and expand kernels), so
  its ``4s`` row equals ``4``. Unset, the worker's default: on a dense model K * 16 / R
  positions from 4 to 8, 16 on a MoE one (``lora.stage.default_positions``; the JSON's ``stage_positions``). ``--max-lora-rank`` sizes the slot buffers above ``--rank``,
  as a pool that also serves larger adapters.
* ``--tp N`` (``--dp D --dp-attention``): the same bench on every rank of an N-rank worker,
  one process each (``run_decode_bench_ranks``; NCCL on N GPUs, gloo on the CPU), each rank
  with its shard of the model and the adapters, and its own decode graphs with
  ``--cuda-graphs`` (ADR 0018: the collectives inside; on the CPU the same static steps run
  without capture, so the path is tested there). ``bs`` is the rows of each DP group (every
  group decodes ``bs`` rows with the same adapters); ``tok_s`` counts every group's rows; the
  times are rank 0's. Multi-rank workers do not stage (``stage_positions`` 0).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loraplane.worker.bench.common import JsonSink, env_info, fmt, is_cuda, sync

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        arch="llama",
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        full_layers=32,
    ),
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe",
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        full_layers=48,
    ),
    "tiny": dict(
        arch="llama",
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        full_layers=4,
    ),
    "tiny-moe": dict(
        arch="qwen3_moe",
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        full_layers=4,
    ),
}

# How a round orders the variants' steps (``run_decode_bench``'s ``order``).
ORDERS = ("step", "variant")

DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_config(shape: str, layers: int, dtype: torch.dtype) -> Any:
    from loraplane.worker.config import ModelConfig

    spec = {k: v for k, v in SHAPES[shape].items() if k != "full_layers"}
    return ModelConfig(
        num_layers=layers,
        torch_dtype=str(dtype).removeprefix("torch."),
        name=f"bench-{shape}",
        **spec,
    )


def build_model(
    config: Any, device: str, dtype: torch.dtype, seed: int = 0, ps: Any = None
) -> nn.Module:
    """``CausalLM`` at ``config``'s shapes with random weights, built on ``device``; with
    ``ps`` (a ``ParallelState``) that rank's shard (random too: no rank's shard is another's)."""
    from loraplane.worker.models.loader import reset_rotary
    from loraplane.worker.models.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(config, ps)
    model = model.to_empty(device=device)
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    reset_rotary(model, device)  # lost on the meta device
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return model.eval()


def _make_runner(model: nn.Module, device: str, max_seqs: int, max_len: int) -> Any:
    from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
    from loraplane.worker.models.kv_cache import KVCache
    from loraplane.worker.parallel.state import ParallelState

    class _InMemoryRunner(ModelRunner):
        """``ModelRunner`` around a model built in memory (its ``forward`` is the real one)."""

        def __init__(self) -> None:
            self.config = RunnerConfig(
                model="<in-memory>", device=device, max_seqs=max_seqs, max_len=max_len
            )
            self.ps = model.ps
            self.device = torch.device(device)
            self.model = model
            self.model_config = model.config
            self.dtype = model.embed_tokens.weight.dtype
            attn = model.layers[0].self_attn
            self.kv = KVCache(
                self.model_config.num_layers,
                max_seqs + 1,  # the spare row that graph steps pad into
                max_len,
                attn.num_kv_heads,
                self.model_config.head_dim,
                self.dtype,
                self.device,
            )
            self.kv.point_at_spare(max_seqs)
            self.lora_config = None
            self.lora = None
            self.graphs = None  # set per measured variant (run_decode_bench)
            self.prompt_graphs = None  # (the decode bench times decode steps)

    del ParallelState
    return _InMemoryRunner()


class _LoRASwitch:
    """Attach a ``LoRAManager`` once, then swap its wrappers in (``on``) and out (``off``)."""

    _ATTRS = (
        ("self_attn", "qkv_proj"),
        ("self_attn", "o_proj"),
        ("mlp", "gate_up_proj"),
        ("mlp", "down_proj"),
    )

    def __init__(self, runner: Any, lora_cfg: Any, backend: str) -> None:
        from loraplane.worker.lora.manager import LoRAManager

        self.runner = runner
        self.base = self._refs()
        self.manager = LoRAManager(runner.model, lora_cfg, backend)
        self.wrapped = self._refs()
        self.expert_loras = [
            getattr(getattr(layer.mlp, "experts", None), "lora", None)
            for layer in runner.model.layers
        ]
        runner.lora_config = lora_cfg
        self.off()

    def _refs(self) -> list[dict[tuple[str, str], nn.Module]]:
        refs = []
        for layer in self.runner.model.layers:
            d = {}
            for parent, attr in self._ATTRS:
                mod = getattr(layer, parent)
                if hasattr(mod, attr):
                    d[(parent, attr)] = getattr(mod, attr)
            refs.append(d)
        return refs

    def _apply(self, refs: list[dict[tuple[str, str], nn.Module]], experts_on: bool) -> None:
        for layer, d, el in zip(self.runner.model.layers, refs, self.expert_loras, strict=True):
            for (parent, attr), mod in d.items():
                setattr(getattr(layer, parent), attr, mod)
            if el is not None:
                layer.mlp.experts.lora = el if experts_on else None

    def on(self) -> None:
        self._apply(self.wrapped, True)
        self.runner.lora = self.manager

    def off(self) -> None:
        self._apply(self.base, False)
        self.runner.lora = None


def random_adapters(
    config: Any, n: int, rank: int, device: str, dtype: torch.dtype, seed: int = 1
) -> list[Any]:
    """``n`` validated-shape ``AdapterWeights`` held on ``device`` (slots copy from there)."""
    from loraplane.worker.lora.adapter import AdapterWeights, ExpertStack

    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }

    def pair(fan_in: int, fan_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = (torch.randn(rank, fan_in, device=device, generator=gen) * fan_in**-0.5).to(dtype)
        b = (torch.randn(fan_out, rank, device=device, generator=gen) * (0.1 * rank**-0.5)).to(
            dtype
        )
        return a, b

    moe = config.is_moe
    modules = ("q_proj", "k_proj", "v_proj", "o_proj") if moe else DENSE_MODULES
    stacks: dict[tuple[int, str], ExpertStack] = {}
    if moe:  # shared between adapters (same cost: every slot is its own buffer)
        mi, ids = config.moe_intermediate_size, torch.arange(config.num_experts)
        for layer in range(config.num_layers):
            for m in ("gate_proj", "up_proj", "down_proj"):
                fan = (mi, h) if m == "down_proj" else (h, mi)
                a, b = zip(*(pair(*fan) for _ in range(config.num_experts)), strict=True)
                stacks[(layer, m)] = ExpertStack(ids, torch.stack(a), torch.stack(b))
    out = []
    for k in range(n):
        dense = {
            (layer, m): pair(*shapes[m]) for layer in range(config.num_layers) for m in modules
        }
        out.append(
            AdapterWeights(
                name=f"bench-{k}",
                path="<random>",
                rank=rank,
                alpha=2.0 * rank,
                scaling=2.0,
                target_modules=modules + (("gate_proj", "up_proj", "down_proj") if moe else ()),
                dense=dense,
                expert_stacks=stacks,
            )
        )
    return out


def bench_runner(
    config: Any,
    device: str,
    max_bs: int,
    max_len: int,
    slots: int,
    *,
    rank: int = 16,
    max_rank: int | None = None,
    stage_slots: int | None = None,
    backend: str = "triton",
    ps: Any = None,
) -> tuple[Any, _LoRASwitch]:
    """The bench's model at ``config`` on ``device`` (random weights, the KV cache filled
    randomly) in a runner, and a ``_LoRASwitch`` with ``slots`` random adapters of ``rank``
    loaded (switched off); with ``ps``, one rank's shard of them. Shared with
    ``bench/probes``."""
    from loraplane.worker.config import LoRARuntimeConfig

    dtype = getattr(torch, config.torch_dtype)
    model = build_model(config, device, dtype, ps=ps)
    runner = _make_runner(model, device, max_bs, max_len)
    for k_cache, v_cache in zip(runner.kv.k, runner.kv.v, strict=True):
        k_cache.normal_()
        v_cache.normal_()
    lora_cfg = LoRARuntimeConfig(
        max_loras_per_batch=slots,
        max_loaded_loras=slots,
        max_lora_rank=max_rank or rank,
        stage_slots=stage_slots,
    )
    switch = _LoRASwitch(runner, lora_cfg, backend)
    for slot, ad in enumerate(random_adapters(config, slots, rank, device, dtype)):
        switch.manager.load_slot(slot, ad)
    return runner, switch


def probe_parser(doc: str, batch_sizes: str) -> argparse.ArgumentParser:
    """The arguments every decode probe takes (``bench/probes``): its JSON file, the shape,
    its layers, the batch sizes and the context."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-sizes", default=batch_sizes)
    p.add_argument("--context", type=int, default=512)
    return p


@contextlib.contextmanager
def _active(
    runner: Any,
    switch: _LoRASwitch,
    graphs_by_variant: dict[str, Any],
    bs: int,
    variant: str,
    mode: str,
) -> Iterator[list[int]]:
    """``variant`` set up on the model (its slots yielded), and taken down after. In
    ``mode == "graph"`` the variant replays its own ``DecodeGraphs`` (made at first use, kept
    in ``graphs_by_variant``)."""
    from loraplane.worker.engine.graphs import DecodeGraphs

    saved_layers = runner.model.layers
    try:  # (a set-up that fails half-way is taken down too)
        if variant in ("off", "off2", "head"):
            switch.off()
            slots = [-1] * bs
        else:
            switch.on()
            n = 0 if variant == "none" else int(variant.split("k")[0].rstrip("s"))
            # The engine orders a batch by slot (engine.py): each adapter's rows contiguous.
            slots = sorted(i % n for i in range(bs)) if n else [-1] * bs
            backend = switch.manager.ctx.backend
            backend.overlap = "off" if variant.endswith("s") else "auto"
            backend.overlap_split_k = int(variant.split("k")[1]) if "k" in variant else None
        if variant == "head":
            runner.model.layers = nn.ModuleList()
        if mode == "graph":
            if variant not in graphs_by_variant:
                max_bs = runner.config.max_seqs
                graphs_by_variant[variant] = DecodeGraphs(
                    runner, max_bs, max_bs, capture=is_cuda(runner.device)
                )
            runner.graphs = graphs_by_variant[variant]
        yield slots
    finally:
        runner.graphs = None
        runner.model.layers = saved_layers
        switch.manager.ctx.backend.overlap = "auto"
        switch.manager.ctx.backend.overlap_split_k = None
        switch.off()


def turn_order(names: list[str], s: int) -> list[str]:
    """Step ``s``'s order of the variants: row ``s`` of a Williams design (a balanced Latin
    square, rows mirrored when the count is odd), so that over a cycle of rows each variant
    comes first, last and right after each other variant equally often. A plain rotation
    keeps every variant's neighbours."""
    n = len(names)
    base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]
    row = [(x + s) % n for x in base]
    if n % 2 and (s // n) % 2:
        row.reverse()
    return [names[i] for i in row]


# What a step's tokens are picked with (``--sampling``): ``greedy`` (the argmax), or ``chat``
# (temperature 0.7, top_p 0.9: ``sampling.sample_rows`` on the device, as the server samples),
# by the torch sampler or (``chat-triton``) the fused one.
SAMPLINGS = ("greedy", "chat", "chat-triton")
# With ``chat`` the LM head's random weights are scaled so that the logits' std is ~3 (not
# ~1): at temperature 0.7 and top_p 0.9 the nucleus is then ~50-500 tokens of 128k, as a
# language model's is; flat logits (~56k-token nuclei) would send every row down the
# sampler's sort of the whole vocabulary (``sampling.CANDIDATES``).
CHAT_LOGIT_STD = 3.0


def _step(
    runner: Any, bs: int, slots: list[int], context: int, s: int, sampling: str = "greedy"
) -> float:
    """One decode step ``s`` (its wall time in seconds), as the engine runs it."""
    from loraplane.worker.engine.runner import decode_batch
    from loraplane.worker.engine.sampling import SamplingParams, sample_rows

    rows = list(range(bs))
    vocab = runner.model_config.vocab_size
    t0 = time.perf_counter()
    # The same input tokens for every variant (not the argmax fed back): with MoE, the
    # tokens pick the experts, and each variant must route the same work.
    tokens = [(7 * j + 3 + 11 * s) % vocab for j in rows]
    batch = decode_batch(tokens, rows, [context + s] * bs, "cpu")  # as the executor builds it
    logits = runner.forward(batch, slots)
    if sampling != "greedy":  # the server's sampler and host sync
        sampler = "triton" if sampling == "chat-triton" else "torch"
        sample_rows(logits, [SamplingParams(temperature=0.7, top_p=0.9)] * bs, [s] * bs, sampler)
    else:
        logits.argmax(-1).tolist()  # a greedy step's sampling and host sync
    return time.perf_counter() - t0


def _eager_steps(
    runner: Any,
    bs: int,
    slots: list[int],
    context: int,
    warmup: int,
    steps: int,
    sampling: str = "greedy",
) -> list[float]:
    """``warmup`` untimed steps, then the times of ``steps`` more, back to back."""
    times = [_step(runner, bs, slots, context, s, sampling) for s in range(warmup + steps)]
    return times[warmup:]


def _graph_check(runner: Any, bs: int, slots: list[int], context: int) -> dict[str, Any]:
    """How far the runtime's CUDA-graph decode (``runner.graphs`` set) is from eager, on one
    batch: the graph step (LoRA shrink overlapped with the base projections, in-place decode
    attention, static LoRA metadata) against the same batch run eagerly, so a capture or
    stream-ordering mistake shows up as a difference."""
    from loraplane.worker.engine.runner import decode_batch

    rows = list(range(bs))
    tokens = [(7 * j + 3) % runner.model_config.vocab_size for j in rows]
    batch = decode_batch(tokens, rows, [context] * bs, "cpu")
    graphs, replays = runner.graphs, runner.graphs.replays
    logits = runner.forward(batch, slots).float()
    runner.graphs = None
    try:
        eager = runner.forward(batch, slots).float()
    finally:
        runner.graphs = graphs
    return {
        "graph_replayed": runner.graphs.replays > replays,
        "graph_vs_eager_max_abs": float((logits - eager).abs().max()),
        "graph_vs_eager_same_argmax": bool(torch.equal(logits.argmax(-1), eager.argmax(-1))),
    }


def run_decode_bench(
    device: str,
    batch_sizes: list[int],
    adapters: list[int],
    layers: int,
    shape: str,
    cuda_graphs: bool,
    out: Path | None,
    *,
    rank: int = 16,
    context: int = 512,
    steps: int = 10,
    warmup: int = 3,
    profile: bool = False,
    rounds: int = 3,
    split_variants: tuple[str, ...] = (),
    dtype: str | None = None,
    backend: str = "triton",
    stage_slots: int | None = None,
    max_rank: int | None = None,
    profile_graphs: tuple[int, ...] = (),
    order: str = "step",
    sampling: str = "greedy",
    control: bool = False,
    ps: Any = None,
) -> dict[str, Any]:
    """Measure every (batch size, variant, mode); JSON written to ``out`` after each row.
    ``profile_graphs``: batch sizes whose graph steps are profiled too (``_profile``).
    ``order``: within a round, ``"step"`` interleaves the variants step by step, ``"variant"``
    runs each variant's steps back to back. ``ps``: this rank's ``ParallelState`` when every
    rank of a multi-rank worker runs it (``run_decode_bench_ranks``)."""
    from loraplane.worker.engine.graphs import DecodeGraphs

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    if order not in ORDERS:
        raise ValueError(f"order: unknown {order!r}; expected one of {', '.join(ORDERS)}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling: unknown {sampling!r}; expected one of {', '.join(SAMPLINGS)}")
    dev_type = torch.device(device).type
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        dtype or ("bfloat16" if dev_type == "cuda" else "float32")
    ]
    config = model_config(shape, layers, tdtype)
    multi = ps is not None and not ps.is_single
    # Several ranks on the CPU take the graph steps without capture (DecodeGraphs(capture=
    # False)): how the CPU tests run the per-rank graph path over gloo.
    graphs = cuda_graphs and (dev_type == "cuda" or multi)
    modes = ["eager"] + (["graph"] if graphs else [])
    groups = ps.dp_size if multi and ps.dp_attention else 1  # each group runs ``bs`` rows
    sink = JsonSink(
        out,
        {
            "bench": "decode",
            "env": env_info(device),
            "settings": {
                "shape": shape,
                "layers": layers,
                "full_layers": SHAPES[shape]["full_layers"],
                "batch_sizes": batch_sizes,
                "adapters": adapters,
                "rank": rank,
                "context": context,
                "steps": steps,
                "rounds": rounds,
                "order": order,
                "sampling": sampling,
                "split_variants": list(split_variants),
                "control": control,
                "warmup": warmup,
                "dtype": str(tdtype),
                "modes": modes,
                "backend": backend,
                "stage_slots": stage_slots,
                "max_lora_rank": max_rank or rank,
                "model": "CausalLM built in memory, random weights, real vocabulary; KV filled randomly",
                "targets": "q,k,v,o + per-expert gate/up/down"
                if config.is_moe
                else ",".join(DENSE_MODULES),
                "cuda_graphs_requested": cuda_graphs,
                "graph_capture": graphs and dev_type == "cuda",
                "tp": ps.tp_size if ps is not None else 1,
                "dp": ps.dp_size if ps is not None else 1,
                "dp_attention": bool(ps is not None and ps.dp_attention),
                "bs_is": "rows per DP group; tok_s counts every group's rows",
            },
            "rows": [],
        },
    )
    t_start = time.perf_counter()
    max_bs, max_len = max(batch_sizes), context + warmup + steps + 8
    runner, switch = bench_runner(
        config,
        device,
        max_bs,
        max_len,
        max(adapters) if adapters else 1,
        rank=rank,
        max_rank=max_rank,
        stage_slots=stage_slots,
        backend=backend,
        ps=ps,
    )
    if sampling != "greedy":  # language-model-like next-token distributions (CHAT_LOGIT_STD)
        with torch.no_grad():
            runner.model.lm_head.weight.mul_(CHAT_LOGIT_STD)
    sync(device)
    sink.set("stage_positions", switch.manager.stage.positions)
    sink.set("setup_s", time.perf_counter() - t_start)

    variants: list[tuple[str, list[int] | None]] = [("off", None), ("none", None)]
    if control:
        variants.insert(1, ("off2", None))
    variants += [(str(n), None) for n in adapters]
    if 4 in adapters:
        variants.append(("4s", None))
    variants += [(v, None) for v in split_variants]

    graphs_by_variant: dict[str, Any] = {}

    def warm(bs: int, variant: str, mode: str) -> dict[str, Any]:
        """The untimed first steps of ``variant`` at ``bs`` (the graph's capture and its
        check against eager)."""
        with _active(runner, switch, graphs_by_variant, bs, variant, mode) as slots:
            check = _graph_check(runner, bs, slots, context) if mode == "graph" else {}
            _eager_steps(runner, bs, slots, context, warmup, 0, sampling)
            return check

    def timed_steps(bs: int, variant: str, mode: str, first: int, count: int) -> list[float]:
        with _active(runner, switch, graphs_by_variant, bs, variant, mode) as slots:
            return [
                _step(runner, bs, slots, context, s, sampling) for s in range(first, first + count)
            ]

    def round_times(bs: int, mode: str, r: int) -> dict[str, list[float]]:
        """One round's timed steps per variant (a variant that failed has none)."""
        times: dict[str, list[float]] = {v: [] for v in names}
        failed: set[str] = set()
        if order == "variant":  # each variant's steps back to back, after its own warm-up
            for variant in names:
                got = sink.guarded(
                    f"decode bs={bs} {variant} {mode} round {r}",
                    timed_steps, bs, variant, mode, 0, warmup + steps,
                )  # fmt: skip
                times[variant] = got[warmup:] if got is not None else []
            return times
        # order "step": step s of every variant before step s + 1 of any, so a slow phase of
        # the machine falls on every variant alike instead of on the ones it happens to meet;
        # and the turns follow a balanced Latin square, so every variant follows every other
        # about equally often (a fixed order would always put the light ``head`` step before
        # the same variant and make that variant's steps faster)
        for s in range(warmup + steps):
            for variant in turn_order(names, s):
                if variant in failed:
                    continue
                got = sink.guarded(
                    f"decode bs={bs} {variant} {mode} round {r} step {s}",
                    timed_steps, bs, variant, mode, s, 1,
                )  # fmt: skip
                if got is None:
                    failed.add(variant)
                    times[variant] = []
                elif s >= warmup:
                    times[variant] += got
        return times

    def row_of(bs: int, variant: str, mode: str, times: list[float]) -> dict[str, Any]:
        step_s = statistics.median(times)
        return {
            "bs": bs,
            "variant": variant,
            "mode": mode,
            "step_ms": step_s * 1e3,
            "tok_s": groups * bs / step_s,  # median step: robust to a stray slow step
            "tok_s_mean": groups * bs * len(times) / sum(times),
            "step_ms_min": min(times) * 1e3,
            "timed_steps": len(times),
        }

    names = ["head", *(v for v, _ in variants)]
    with torch.inference_mode():
        for bs in batch_sizes:
            for mode in modes:
                # One untimed pass over every variant first: the first forward at a batch size
                # pays one-time costs (cuBLAS/SDPA plans, allocator growth, Triton compiles,
                # graph captures) that would otherwise land on whichever variant is first.
                checks: dict[str, dict[str, Any]] = {}
                for variant in names:
                    check = sink.guarded(
                        f"decode bs={bs} {variant} {mode} warm-up", warm, bs, variant, mode
                    )
                    checks[variant] = check or {}
                # Rounds over all variants, steps pooled per variant: a drift of the clock or
                # the host during the run spreads over every variant instead of one.
                pooled: dict[str, list[float]] = {v: [] for v in names}
                # each round's median step per variant (None: the round failed), for the
                # spread of the per-round ratios that each row reports beside the pooled one
                by_round: dict[str, list[float | None]] = {v: [] for v in names}
                for r in range(rounds):
                    for variant, got in round_times(bs, mode, r).items():
                        by_round[variant].append(statistics.median(got) if got else None)
                        pooled[variant] += got
                rows = {
                    v: {**row_of(bs, v, mode, pooled[v]), **checks.get(v, {})}
                    for v in names
                    if pooled[v]
                }
                head, base = rows.get("head"), rows.get("off")
                for variant in names:
                    row = rows.get(variant)
                    if row is None:
                        continue
                    if base is not None and variant != "head":
                        row["ratio_vs_off"] = row["tok_s"] / base["tok_s"]
                        row["ratio_by_round"] = [
                            off / step
                            for off, step in zip(by_round["off"], by_round[variant], strict=True)
                            if off is not None and step is not None
                        ]
                        if head is not None and variant != "off":
                            row["projected_ratio_full_depth"] = _project(
                                head["step_ms"],
                                base["step_ms"],
                                row["step_ms"],
                                layers,
                                SHAPES[shape]["full_layers"],
                            )
                    sink.append("rows", row)
                    print(
                        f"[decode] {shape} bs={bs} {mode} {variant}: {row['tok_s']:.0f} tok/s "
                        f"ratio={fmt(row.get('ratio_vs_off'), 3)}",
                        flush=True,
                    )
    if profile and dev_type == "cuda":
        sink.set(
            "profile",
            sink.guarded(
                "profile", lambda: _profile(runner, switch, min(64, max_bs), adapters, context)
            ),
        )
    for bs in profile_graphs if dev_type == "cuda" else ():
        sink.set(
            f"profile_graph_bs{bs}",
            sink.guarded(
                f"graph profile bs={bs}",
                lambda bs=bs: _profile(
                    runner, switch, bs, adapters, context, DecodeGraphs(runner, max_bs, max_bs)
                ),
            ),
        )
    sink.set("elapsed_s", time.perf_counter() - t_start)
    if dev_type == "cuda":
        torch.cuda.empty_cache()
    return sink.payload


def _bench_rank(
    rank: int, ps: Any, device: torch.device, args: tuple[Any, ...], kw: dict[str, Any], out: str
) -> None:
    """One rank of ``run_decode_bench_ranks``: the whole bench, in step with its peers (every
    rank runs the same variants and steps, so the collectives pair up); rank 0 writes the JSON
    and prints the rows."""
    if rank:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the rank's life)
    batch_sizes, adapters, layers, shape, cuda_graphs = args
    result = run_decode_bench(
        str(device),
        batch_sizes,
        adapters,
        layers,
        shape,
        cuda_graphs,
        Path(out) if rank == 0 else None,
        ps=ps,
        **kw,
    )
    if rank == 0:
        Path(out).write_text(json.dumps(result, default=str))


def run_decode_bench_ranks(
    tp: int,
    dp: int,
    dp_attention: bool,
    device: str,
    batch_sizes: list[int],
    adapters: list[int],
    layers: int,
    shape: str,
    cuda_graphs: bool,
    out: Path | None,
    **kw: Any,
) -> dict[str, Any]:
    """``run_decode_bench`` on every rank of a ``tp``-rank worker (``dp`` DP-attention groups),
    one process each (gloo on the CPU, NCCL on GPUs): each rank's model is its shard, every DP
    group decodes ``bs`` rows of its own with the same adapters, and a step's time is rank 0's.
    With ``cuda_graphs`` every rank replays its own decode graphs (ADR 0018); on the CPU they
    run without capture. The layout is checked before any rank starts."""
    import tempfile

    from loraplane.worker.parallel.launch import spawn_ranks
    from loraplane.worker.parallel.state import ParallelConfig

    pconf = ParallelConfig(tp=tp, dp=dp, dp_attention=dp_attention)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    args = (batch_sizes, adapters, layers, shape, cuda_graphs)
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-decode-") as tmp:
        path = out or Path(tmp) / "decode.json"
        spawn_ranks(_bench_rank, pconf, torch.device(device).type, args, kw, str(path))
        result: dict[str, Any] = json.loads(Path(path).read_text())
    return result


def _project(head_ms: float, off_ms: float, lora_ms: float, layers: int, full: int) -> float | None:
    b = (off_ms - head_ms) / layers
    d = (lora_ms - off_ms) / layers
    if b <= 0:
        return None
    return (head_ms + full * b) / (head_ms + full * (b + d))


def _profile(
    runner: Any,
    switch: _LoRASwitch,
    bs: int,
    adapters: list[int],
    context: int,
    graphs: Any = None,
) -> dict[str, Any]:
    """torch.profiler over 3 steps, LoRA off, with 1 adapter and with 4 (or the most)
    adapters: the top kernels by device time, each kernel's device time per step
    (``kernel_us_per_step``, so two variants can be subtracted) and the number of kernel
    launches per step. Eager steps, or the runtime's decode graphs when ``graphs`` is a
    ``DecodeGraphs`` (one per variant is not needed: each is captured on first use)."""
    from torch.profiler import ProfilerActivity, profile

    n = 4 if 4 in adapters else max(adapters)
    result: dict[str, Any] = {"bs": bs, "mode": "graph" if graphs is not None else "eager"}
    for variant in dict.fromkeys(["off", *(["1"] if 1 in adapters else []), str(n)]):
        k = 0 if variant == "off" else int(variant)
        slots = [-1] * bs if variant == "off" else sorted(i % k for i in range(bs))
        (switch.off if variant == "off" else switch.on)()
        runner.graphs = graphs
        replays = graphs.replays if graphs is not None else 0
        try:
            with torch.inference_mode():
                _eager_steps(runner, bs, slots, context, 1, 1)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    _eager_steps(runner, bs, slots, context, 0, 3)
        finally:
            runner.graphs = None
            switch.off()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in kernels)
        per_step = {
            e.key: round(e.self_device_time_total / 3, 1)
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)
        }
        table = events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
        result[variant] = {
            "kernel_launches_per_step": launches / 3,
            "kernel_us_per_step": per_step,
            "table": table,
        }
        if graphs is not None:  # a capture that failed runs eagerly: say what was profiled
            result[variant]["graph_replays"] = graphs.replays - replays  # of 4 steps
    return result


def summary_table(result: dict[str, Any]) -> str:
    s = result.get("settings", {})
    lines = [
        f"decode {s.get('shape')} layers={s.get('layers')} (of {s.get('full_layers')}) rank={s.get('rank')} "
        f"context={s.get('context')} setup {fmt(result.get('setup_s'))} s",
        f"{'bs':>4} {'mode':6} {'variant':>7} {'step ms':>8} {'tok/s':>9} {'ratio':>6} {'proj':>6}"
        "  by round: median (range)",
    ]
    for r in result.get("rows", []):
        by_round = r.get("ratio_by_round") or []
        spread = (
            f"{statistics.median(by_round):.3f} ({min(by_round):.3f}-{max(by_round):.3f})"
            if by_round
            else "-"
        )
        lines.append(
            f"{r['bs']:>4} {r['mode']:6} {r['variant']:>7} {r['step_ms']:>8.2f} {r['tok_s']:>9.0f} "
            f"{fmt(r.get('ratio_vs_off'), 3):>6} {fmt(r.get('projected_ratio_full_depth'), 3):>6}"
            f"  {spread}"
        )
    prof = result.get("profile")
    if isinstance(prof, dict):
        for k, v in prof.items():
            if isinstance(v, dict):
                lines.append(
                    f"profile bs={prof.get('bs')} {k}: {v['kernel_launches_per_step']:.0f} kernel launches/step"
                )
    for e in result.get("errors", []):
        lines.append(f"ERROR {e['what']}: {e['error'][:160]}")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loraplane.worker.bench.decode", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default=None, help="one of " + ",".join(SHAPES))
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 8 dense, 4 MoE, 2 tiny)"
    )
    p.add_argument("--batch-sizes", default=None)
    p.add_argument("--adapters", default="1,4,16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds over all variants (steps pooled per variant)"
    )
    p.add_argument(
        "--order",
        default="step",
        choices=ORDERS,
        help="within a round, 'step' interleaves the variants one step at a time (a slow "
        "phase of the machine falls on all of them alike), 'variant' runs each variant's "
        "warm-up and steps back to back",
    )
    p.add_argument(
        "--sampling",
        default="greedy",
        choices=SAMPLINGS,
        help="how a step picks its tokens: 'greedy' (argmax), or 'chat' (temperature 0.7, "
        "top_p 0.9, on the device, as the server samples such requests; 'chat-triton': with "
        "the fused sampler, the server's --sampler triton)",
    )
    p.add_argument(
        "--split-variants",
        default="",
        help="extra variants NkC: N adapters, the overlapped shrink's K splits capped at C",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="add 'off2': LoRA-off again with graphs of its own, the ratios' noise floor",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="profile eager steps at bs min(64, largest)"
    )
    p.add_argument(
        "--profile-graphs",
        default="",
        help="batch sizes whose CUDA-graph steps to profile (kernel time per step, per variant)",
    )
    p.add_argument("--dtype", default=None)
    p.add_argument("--backend", default="triton", choices=["triton", "torch"])
    p.add_argument(
        "--stage-slots",
        type=int,
        default=None,
        help="adapters staged under the base weights (graph steps of at most this many "
        "adapters shrink inside the base GEMM); 0: the shrink and expand kernels always; "
        "default: the worker's (on a dense model K*16/R from 4 to 8, 16 on a MoE one)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="the slot buffers' rank (default: --rank); above it, adapters of --rank sit in "
        "wider slots, as in a pool that also serves larger ranks",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="ranks of one worker, a process each (gloo on the CPU)"
    )
    p.add_argument("--dp", type=int, default=1, help="DP-attention groups (needs --dp-attention)")
    p.add_argument("--dp-attention", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--json", action="store_true", help="print the result JSON on stdout (else a table)"
    )
    args = p.parse_args(argv)
    if args.tp > 1 or args.dp > 1:
        from loraplane.worker.config import ConfigError
        from loraplane.worker.parallel.state import ParallelConfig

        try:
            ParallelConfig(tp=args.tp, dp=args.dp, dp_attention=args.dp_attention)
        except ConfigError as exc:
            p.error(str(exc))
        if args.profile or args.profile_graphs:
            p.error("--profile and --profile-graphs profile one rank's process: without --tp/--dp")
    cuda = is_cuda(args.device)
    shape = args.shape or ("llama3-8b" if cuda else "tiny")
    layers = args.layers or (
        2 if shape.startswith("tiny") else 4 if SHAPES[shape].get("num_experts") else 8
    )
    bss = _ints(args.batch_sizes) if args.batch_sizes else ([16, 32, 64, 128] if cuda else [2, 4])
    too_big = [b for b in _ints(args.profile_graphs) if b > max(bss)]
    if too_big:
        p.error(f"--profile-graphs {too_big}: at most the largest batch size ({max(bss)})")
    context = args.context if args.context is not None else (512 if cuda else 8)
    run: Any = run_decode_bench
    if args.tp > 1:
        run = functools.partial(run_decode_bench_ranks, args.tp, args.dp, args.dp_attention)
    result = run(
        args.device,
        bss,
        _ints(args.adapters),
        layers,
        shape,
        args.cuda_graphs,
        args.out,
        rank=args.rank,
        context=context,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        split_variants=tuple(v for v in args.split_variants.split(",") if v),
        profile=args.profile,
        dtype=args.dtype,
        backend=args.backend,
        stage_slots=args.stage_slots,
        max_rank=args.max_lora_rank,
        profile_graphs=tuple(_ints(args.profile_graphs)),
        order=args.order,
        sampling=args.sampling,
        control=args.control,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
    else:
        print(summary_table(result))
    return 1 if result.get("errors") and not result.get("rows") else 0


if __name__ == "__main__":
    raise SystemExit(main())
