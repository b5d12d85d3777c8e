"""One decoder model for Llama, Qwen2, Qwen3 and Qwen3-MoE.

The architectures differ in three switches read from config.json: q/k/v bias (Qwen2),
per-head RMSNorm on q and k (Qwen3), and sparse MoE MLP layers (Qwen3-MoE).

Token layout under DP attention (seed 000): every DP group runs embedding, attention and
the residual stream on its own tokens. Before the MLP the hidden states are all-gathered
into the TP-global token set (DP groups in order, padding removed); the MLP/MoE runs on it
sharded over all TP ranks and each group takes its own rows back. The LM head is
DP-gathered the same way and vocab-parallel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.worker import kernels
from loraplane.worker.config import ModelConfig
from loraplane.worker.models.batch import PROMPT_TILE, ForwardBatch
from loraplane.worker.models.kv_cache import KVCache
from loraplane.worker.models.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RopeKV,
    RotaryEmbedding,
    RowParallelLinear,
    silu_mul,
    split_evenly,
    topk_combine,
)
from loraplane.worker.parallel.state import ParallelState


class Attention(nn.Module):
    # On CUDA the rotation, the per-head norms and the KV-cache write run as one Triton
    # kernel (kernels/rope.py), a staged qkv LoRA inside it; a class switch so that one
    # bench run can compare it with the torch path (bench/probes/switches.py rope=0).
    fused_rope = True
    # Prompt chunks through the Triton kernel (``extend_attention``): None on CUDA only; True
    # on CPU tensors too, through Triton's interpreter (the kernels tier's tests of the CUDA
    # path); False nowhere, one SDPA per chunk (the baseline of `loraplane bench
    # prefill-attention`).
    prompt_kernel: bool | None = None

    def __init__(self, config: ModelConfig, layer: int, ps: ParallelState) -> None:
        super().__init__()
        self.layer = layer
        tp, rank = ps.attn_tp_size, ps.attn_tp_rank
        self.num_heads = split_evenly(
            config.num_heads, tp, f"layers.{layer}.self_attn q_proj heads"
        )
        self.num_kv_heads = split_evenly(
            config.num_kv_heads, tp, f"layers.{layer}.self_attn k_proj/v_proj heads"
        )
        self.head_dim = config.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.q_size, config.kv_size, config.kv_size],
            tp_size=tp,
            tp_rank=rank,
            bias=config.attention_bias,
            name=f"layers.{layer}.self_attn.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.q_size,
            config.hidden_size,
            tp_size=tp,
            tp_rank=rank,
            reduce=ps.all_reduce_attn_tp,
            name=f"layers.{layer}.self_attn.o_proj",
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        slots: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj's output for the normed ``h``, or ``residual`` plus it when given (see
        ``RowParallelLinear.forward_add``: ``residual`` may be updated in place). ``slots``
        [T]: each token's KV slot (``KVCache.slots``)."""
        t = h.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [pages, page_size, kv, d]
        if self.fused_rope and h.is_cuda:
            rope = RopeKV(
                batch.positions,
                slots,
                self.rotary.cos_sin(kv.max_len, h.dtype),
                k_cache,
                v_cache,
                self.num_heads,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.q_norm.eps if self.q_norm is not None else 0.0,
            )
            q = self.qkv_proj.forward_rope(h, rope)  # [T, heads, d]; k, v in the cache
        else:
            qkv = self.qkv_proj(h)  # [T, (heads + 2 kv_heads) * d]
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch.positions, q, k)
            if t:
                k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots] = k  # [slots, kv, d]
                v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots] = v
        out = self._attend(q, batch, kv)  # [T, heads, d]
        if residual is not None:
            return self.o_proj.forward_add(out.reshape(t, q_size), residual)  # type: ignore[no-any-return]
        return self.o_proj(out.reshape(t, q_size))

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        if not batch.chunks:
            return q
        if batch.is_decode:
            return self._attend_one_each(q, batch.cache_rows, batch.positions, kv)
        # A prefill or mixed step (chunked prefill beside running decodes): every chunk of one
        # token (a running sequence's decode) attends in one call, and on CUDA every longer
        # chunk in one more (kernels/attention.py, ``extend_attention``): from position 0 or
        # past a cached prefix, the step's own keys are in the cache already.
        out = torch.zeros_like(q) if batch.padded else torch.empty_like(q)
        singles = batch.single_tokens(q.device)
        if singles.rows.numel():
            out[singles.rows] = self._attend_one_each(
                q[singles.rows], singles.cache_rows, singles.positions, kv
            )
        use_kernel = q.device.type == "cuda" if self.prompt_kernel is None else self.prompt_kernel
        if use_kernel:
            tiles = batch.prompt_tiles(q.device, PROMPT_TILE)
            return kernels.extend_attention(  # type: ignore[no-any-return]
                q,
                kv.k[self.layer],
                kv.v[self.layer],
                kv.page_table,
                tiles,
                self.scale,
                out,
                block_m=PROMPT_TILE,
            )
        # Otherwise one SDPA per chunk, over the row's keys gathered from its pages.
        masks = batch.prompt_masks(q.device)
        for c, mask in zip(batch.chunks, masks, strict=True):
            if c.length < 2:
                continue
            qs = q[c.token_offset : c.token_offset + c.length].transpose(0, 1)[None]
            row_k, row_v = kv.row_keys(self.layer, c.cache_row, c.start + c.length)
            ks = row_k.transpose(0, 1)[None]  # [1, kv, Lk, d]
            vs = row_v.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(  # [1, heads, Lq, d]
                qs,
                ks,
                vs,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[c.token_offset : c.token_offset + c.length] = o[0].transpose(0, 1)
        return out

    def _attend_one_each(
        self, q: torch.Tensor, cache_rows: torch.Tensor, positions: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        """``q [B, heads, d]``: one new token per row, at ``positions``, attending in place
        over its row's pages up to and including itself."""
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        if q.device.type == "cuda":
            # Lengths are read on the device, so a decode step can be captured
            # (engine/graphs.py).
            return kernels.decode_attention(  # type: ignore[no-any-return]
                q, k_cache, v_cache, kv.page_table, cache_rows, positions + 1, self.scale
            )
        # One batched call over each row's cached prefix, its pages gathered through the
        # page table.
        ctx = positions + 1  # [B]
        length = int(positions.max()) + 1
        n = -(-length // kv.page_size)
        pages = kv.page_table[cache_rows, :n].to(torch.int64)  # [B, n]
        keys = k_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)  # [B, kv, L, d]
        values = v_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)
        mask = torch.arange(length, device=q.device)[None, :] < ctx[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, heads, 1, d]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]


class MLP(nn.Module):
    """SwiGLU MLP sharded over all TP ranks (runs on the TP-global token set)."""

    def __init__(
        self, config: ModelConfig, layer: int, ps: ParallelState, intermediate: int
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [intermediate, intermediate],
            tp_size=ps.tp_size,
            tp_rank=ps.tp_rank,
            name=f"layers.{layer}.mlp.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate,
            config.hidden_size,
            tp_size=ps.tp_size,
            tp_rank=ps.tp_rank,
            reduce=ps.all_reduce_tp,
            name=f"layers.{layer}.mlp.down_proj",
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down_proj's output, or ``residual`` plus it (as in ``Attention.forward``)."""
        act = self.gate_up_proj.forward_silu_mul(x)
        if residual is not None:
            return self.down_proj.forward_add(act, residual)  # type: ignore[no-any-return]
        return self.down_proj(act)


class Experts(nn.Module):
    """Routed experts with their intermediate size sharded over MoE-TP (= all TP ranks).

    Rows are (token, k) pairs after top-k routing. A LoRA attached as `self.lora` adds to
    the per-pair gate_up and down outputs, each pair with its own token's adapter.
    """

    def __init__(self, config: ModelConfig, layer: int, ps: ParallelState) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden = config.hidden_size
        self.tp_size, self.tp_rank = ps.moe_tp_size, ps.moe_tp_rank
        self.intermediate = split_evenly(
            config.moe_intermediate_size, self.tp_size, f"layers.{layer}.mlp.experts intermediate"
        )
        i, h, e = self.intermediate, config.hidden_size, config.num_experts
        self.w_gate_up = nn.Parameter(
            torch.empty(e, 2 * i, h), requires_grad=False
        )  # [E, 2I_local, H]
        self.w_down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)  # [E, H, I_local]
        self.reduce = ps.all_reduce_tp
        # Set by the LoRA manager: adds per-(slot, expert) LoRA to the pair outputs.
        self.lora: nn.Module | None = None

    def load(self, expert: int, proj: str, full: torch.Tensor) -> None:
        i, r = self.intermediate, self.tp_rank
        if proj == "gate_proj":
            self.w_gate_up.data[expert, :i].copy_(full[r * i : (r + 1) * i])
        elif proj == "up_proj":
            self.w_gate_up.data[expert, i:].copy_(full[r * i : (r + 1) * i])
        else:
            self.w_down.data[expert].copy_(full[:, r * i : (r + 1) * i])

    # Rows per expert matmul on CPU. Fixed-size blocks make every row's result independent
    # of how many other rows an expert got, so routing changes in one request (an adapter
    # moving its tokens to other experts) never change another request's bits. See
    # docs/adr/0001-batch-invariant-experts.md.
    cpu_row_block = 16
    # The device kernels (Triton's interpreter) on the CPU too, instead of ``grouped``: for
    # tests of the device path, LoRA and base alike (their bits differ from torch's). The
    # environment variable reaches the ranks a multi-rank test starts.
    device_kernels = os.environ.get("LORAPLANE_CPU_DEVICE_KERNELS") == "1"

    def grouped(self, x: torch.Tensor, w: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor:
        """y[p] = x[p] @ w[pair_expert[p]]^T, one matmul per expert present."""
        out = x.new_empty(x.shape[0], w.shape[1])
        if not x.shape[0]:
            return out
        order = torch.argsort(pair_expert, stable=True)
        counts = torch.bincount(pair_expert, minlength=self.num_experts).tolist()
        block = self.cpu_row_block if x.device.type == "cpu" else 0
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = order[start : start + n]
            start += n
            if not block:
                out[rows] = x[rows] @ w[e].t()
                continue
            for b in range(0, n, block):
                chunk = rows[b : b + block]
                padded = x.new_zeros(block, x.shape[1])
                padded[: chunk.numel()] = x[chunk]
                out[chunk] = (padded @ w[e].t())[: chunk.numel()]
        return out

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        k = topk_ids.shape[1]
        # [P] int32, pair p = token p // k: what the routing kernels take (one conversion,
        # shared with the LoRA's).
        pair_expert = topk_ids.reshape(-1).to(torch.int32)
        lora = self.lora if self.lora is not None and self.lora.lora_active else None
        device_kernels = x.device.type == "cuda" or self.device_kernels
        fused = None
        if lora is not None and device_kernels:
            fused = lora.fused_operands(k, pair_expert.shape[0])
        if fused is not None:
            # The LoRA inside the base kernels (kernels.moe_experts_lora) and the combine:
            # the launches of the base experts, no more.
            routing = kernels.moe_expert_routing(pair_expert, self.num_experts)
            d, delta = kernels.moe_experts_lora(
                x, self.w_gate_up, self.w_down, pair_expert, routing, fused, check=False
            )
            return self.reduce(topk_combine(d, topk_weights, delta))
        # The LoRA's per-pair outputs only read x / act: begun before each base GEMM (on a
        # side stream while a CUDA graph is captured, and then added where the next op reads
        # the GEMM's output: the SwiGLU, the top-k combine; no LoRA kernel waits on a GEMM).
        pending = lora.begin_gate_up(x, pair_expert, k) if lora is not None else None
        if device_kernels:
            # Device-routed grouped GEMMs (kernels/experts.py): no host sync, capturable; each
            # pair reads its token's row of x in place.
            routing = kernels.moe_expert_routing(pair_expert, self.num_experts)
            gu = kernels.moe_grouped_matmul(x, self.w_gate_up, routing, x_row_div=k)
        else:
            gu = self.grouped(x.repeat_interleave(k, dim=0), self.w_gate_up, pair_expert)
        # [P, I]: as the dense MLP's, fp32 math, one kernel on the device path
        delta = lora.gate_up_delta(pending, gu) if lora is not None else None
        act = kernels.silu_and_mul(gu, delta) if device_kernels else silu_mul(gu, delta)
        pending = lora.begin_down(act) if lora is not None else None
        if device_kernels:
            d = kernels.moe_grouped_matmul(act, self.w_down, routing)
        else:
            d = self.grouped(act, self.w_down, pair_expert)  # [P, H] partial over MoE-TP
        # Each token's k pairs are adjacent (pair = token * k + j): a weighted sum over j.
        out = topk_combine(
            d, topk_weights, lora.down_delta(pending, d) if lora is not None else None
        )
        return self.reduce(out)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ps: ParallelState) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(
            config.hidden_size, config.num_experts, bias=False
        )  # router, replicated
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(config, layer, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights.to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ps: ParallelState) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, ps)
        self.mlp: nn.Module = (
            SparseMoE(config, layer, ps)
            if config.is_moe_layer(layer)
            else MLP(config, layer, ps, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        self.ps = ps or ParallelState.single()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.ps) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            [config.vocab_size],
            tp_size=self.ps.tp_size,
            tp_rank=self.ps.tp_rank,
            name="lm_head",
        )

    # --- DP-attention layout -------------------------------------------------------------

    def _dp_gather(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Local rows of every DP group → the TP-global rows (groups in order, no padding)."""
        ps = self.ps
        if not ps.dp_attention:
            return x
        pad = max(counts)
        padded = x.new_zeros(pad, *x.shape[1:])
        padded[: x.shape[0]] = x
        gathered = ps.all_gather_tp(padded)
        return torch.cat(
            [gathered[r][:n] for r, n in zip(ps.dp_group_leaders(), counts, strict=True)]
        )

    def _dp_local(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The rows of the TP-global set that belong to this rank's DP group."""
        ps = self.ps
        if not ps.dp_attention:
            return x
        start = sum(counts[: ps.dp_rank])
        return x[start : start + counts[ps.dp_rank]]

    # --- forward -------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Next-token logits [len(batch.logit_rows), vocab] for this DP group's rows."""
        counts = batch.dp_token_counts or [batch.num_tokens]
        h = self.embed_tokens(batch.input_ids)  # [T_local, H]
        slots = kv.slots(batch)  # [T_local]: each token's KV slot, read from the page table
        for layer in self.layers:
            # h is fresh each step (embedding or an add), so the residual adds may update it.
            h = layer.self_attn(layer.input_layernorm(h), batch, kv, slots, residual=h)
            g = self._dp_gather(h, counts)  # [T_global, H]
            if g is h and isinstance(layer.mlp, MLP):
                h = layer.mlp(layer.post_attention_layernorm(h), residual=h)
                continue
            m = layer.mlp(layer.post_attention_layernorm(g))
            h = h + self._dp_local(m, counts)
        h = self.norm(h[batch.logit_rows])  # [L_local, H]
        logit_counts = batch.dp_logit_counts or [int(batch.logit_rows.numel())]
        g = self._dp_gather(h, logit_counts)  # [L_global, H]
        logits = self.lm_head(g)  # [L_global, V / tp]
        if self.ps.tp_size > 1:
            logits = torch.cat(self.ps.all_gather_tp(logits), dim=-1)
        return self._dp_local(logits, logit_counts)
