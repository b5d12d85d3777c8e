"""Building blocks: RMSNorm, rotary embedding and tensor-parallel linears.

A linear's weight is stored as the shard this rank owns. `ColumnParallelLinear` splits
outputs (and keeps stacked projections such as qkv or gate_up as named slices, each split
on its own); `RowParallelLinear` splits inputs and reduces over the group it was built for.
With one rank they are plain linears.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.worker.config import ConfigError, RopeScaling
from loraplane.worker.kernels._triton_utils import MAX_ROW_COLUMNS


class RMSNorm(nn.Module):
    # On CUDA, rows of the weight's dtype go through one Triton kernel (kernels/norm.py)
    # instead of six torch ops; a class switch so that one bench run can compare the two
    # (bench/probes/switches.py norm=0).
    fused = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.fused
            and x.is_cuda
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.shape[1] <= MAX_ROW_COLUMNS  # one program holds a row
            and x.stride(1) == 1
        ):
            from loraplane.worker import kernels

            return kernels.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[d/2]`` fp32 rotary inverse frequencies, as transformers' ``ROPE_INIT_FUNCTIONS``
    computes them for ``scaling.rope_type`` (same formulas, same fp32 steps)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device).float() / head_dim)
    )
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        orig = scaling.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # (as transformers: no division by zero)
        pos_freqs = theta ** (
            torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim
        )
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        ramp = torch.clamp(
            (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
        )
        keep = 1 - ramp.to(device=device)  # [d/2]: 1 where the frequency is kept as it is
        return interpolation * (1 - keep) + extrapolation * keep
    return inv_freq


class RotaryEmbedding(nn.Module):
    """HF rotary embedding (rotate_half form), with the checkpoint's rope scaling: the
    scaled inverse frequencies, and YaRN's attention factor on cos and sin. The torch path
    (``forward``) and the fused kernel's table (``cos_sin``) compute both the same way."""

    # cos | sin tables by (head_dim, theta, scaling, positions, dtype, device): one for all
    # layers (each layer has its own module; a 128K-position table in bf16 is 32 MB at d 128).
    _tables: ClassVar[
        dict[tuple[int, float, RopeScaling, int, torch.dtype, torch.device], torch.Tensor]
    ] = {}

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling or RopeScaling()
        self.register_buffer(
            "inv_freq", rope_inv_freq(head_dim, theta, self.scaling), persistent=False
        )

    def reset_inv_freq(self, device: torch.device | str) -> None:
        """Recompute ``inv_freq`` on ``device`` (a model built on the meta device lost it)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, heads, d]; k [T, kv_heads, d]
        freqs = self._angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling.attention_factor != 1.0:
            cos, sin = cos * self.scaling.attention_factor, sin * self.scaling.attention_factor
        cos = cos.to(q.dtype)[:, None, :]
        sin = sin.to(q.dtype)[:, None, :]
        return _rope(q, cos, sin), _rope(k, cos, sin)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``[P, d/2]`` fp32: ``position * inv_freq``."""
        return positions.float()[:, None] * self.inv_freq.float()[None, :]

    def cos_sin(self, max_pos: int, dtype: torch.dtype) -> torch.Tensor:
        """``[max_pos, d]``: ``cos`` then ``sin`` of ``position * inv_freq`` (times the
        attention factor) for positions ``0 .. max_pos - 1``, in ``dtype`` as ``forward``
        rounds them; the table that ``kernels.rope_qkv`` reads. Built once per size, dtype and
        device and shared by every layer with the same head size and rope. It must first be
        built outside a CUDA graph capture (the first forward of a KV cache runs eagerly:
        prefill, or a graph's warm-up), or the table would hold values that only the graph's
        replay computes."""
        device = self.inv_freq.device
        key = (self.inv_freq.numel() * 2, self.theta, self.scaling, max_pos, dtype, device)
        table = self._tables.get(key)
        if table is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "the rotary cos/sin table would be built inside a CUDA graph capture; "
                    "run one forward with this KV cache eagerly first"
                )
            freqs = self._angles(torch.arange(max_pos, device=device))
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            if self.scaling.attention_factor != 1.0:
                table = table * self.scaling.attention_factor
            table = table.to(dtype)
            self._tables[key] = table
        return table


@dataclass(slots=True)
class RopeKV:
    """Everything ``kernels.rope_qkv`` reads besides ``qkv``: the step's positions and KV
    slots, the layer's caches and per-head norms. Calling it rotates q and k of a qkv
    output, writes k and v into the caches and returns ``q [T, heads, d]``; with
    ``lora_b``/``stage`` the qkv is a stacked GEMM's output and the LoRA goes in first."""

    positions: torch.Tensor
    slots: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float

    def __call__(
        self, qkv: torch.Tensor, lora_b: torch.Tensor | None = None, stage: object = None
    ) -> torch.Tensor:
        from loraplane.worker import kernels

        return kernels.rope_qkv(  # type: ignore[no-any-return]
            qkv,
            self.positions,
            self.slots,
            self.cos_sin,
            self.k_cache,
            self.v_cache,
            self.num_heads,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            eps=self.eps,
            lora_b=lora_b,
            stage=stage,
        )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gu: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of ``gu [T, 2I]`` (gate | up), plus ``delta`` if given (a LoRA's output, added
    in fp32), in fp32 and rounded once: one Triton kernel on CUDA (``kernels/swiglu.py``),
    torch ops on the CPU (the same math as its reference)."""
    if gu.is_cuda:
        from loraplane.worker import kernels

        return kernels.silu_and_mul(gu, delta)  # type: ignore[no-any-return]
    from loraplane.worker.kernels import reference

    return reference.silu_and_mul(gu, delta)


def topk_combine(
    d: torch.Tensor, topk_weights: torch.Tensor, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's top-k expert outputs weighted by the router, ``sum_j w[t, j] * (d +
    delta)[t * k + j]``, in fp32 and rounded once: one Triton kernel on CUDA
    (``kernels.moe_combine``), torch ops on the CPU (its reference)."""
    if d.is_cuda:
        from loraplane.worker import kernels

        return kernels.moe_combine(d, topk_weights, delta)  # type: ignore[no-any-return]
    from loraplane.worker.kernels import reference

    return reference.moe_combine(d, topk_weights, delta)


def split_evenly(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ConfigError(
            f"{what} of size {size} cannot be sharded over {parts} ranks (not divisible)"
        )
    return size // parts


WeightLoader = Callable[[torch.Tensor, int], None]


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), output features split over `tp_size` ranks.

    `output_sizes` lists the full sizes of stacked slices (e.g. q, k, v); each slice is
    split on its own so that rank i holds slice parts [i*s/tp, (i+1)*s/tp) of every slice.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        tp_size: int,
        tp_rank: int,
        bias: bool = False,
        name: str = "linear",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.local_sizes = [split_evenly(s, tp_size, f"{name} output") for s in output_sizes]
        self.local_offsets = [0]
        for s in self.local_sizes:
            self.local_offsets.append(self.local_offsets[-1] + s)
        out_local = self.local_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_local), requires_grad=False) if bias else None

    def shard_rows(self, full: torch.Tensor, slice_index: int) -> torch.Tensor:
        """This rank's part of a full [out_i, ...] tensor of slice `slice_index`."""
        size = self.local_sizes[slice_index]
        return full.narrow(0, self.tp_rank * size, size)

    def load(
        self, full_weight: torch.Tensor, slice_index: int = 0, bias: torch.Tensor | None = None
    ) -> None:
        lo, hi = self.local_offsets[slice_index], self.local_offsets[slice_index + 1]
        self.weight.data[lo:hi].copy_(self.shard_rows(full_weight, slice_index))
        if bias is not None:
            assert self.bias is not None
            self.bias.data[lo:hi].copy_(self.shard_rows(bias, slice_index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu_mul(self(x))`` for a gate | up projection; a LoRA wrapper may fuse its
        term into the activation instead (``ColumnLoRA.forward_silu_mul``)."""
        return silu_mul(self(x))

    def forward_rope(self, x: torch.Tensor, rope: RopeKV) -> torch.Tensor:
        """``rope(self(x))`` for a qkv projection (see ``RopeKV``); a LoRA wrapper may add its
        term inside the rotation's kernel instead (``ColumnLoRA.forward_rope``)."""
        return rope(self(x))


class RowParallelLinear(nn.Module):
    """y = reduce(x_shard W_shard^T): input features split over the ranks of `reduce`'s group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int,
        tp_rank: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        name: str = "linear",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.in_local = split_evenly(in_features, tp_size, f"{name} input")
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)

    def shard_cols(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full [..., in_features] tensor."""
        return full.narrow(-1, self.tp_rank * self.in_local, self.in_local)

    def load(self, full_weight: torch.Tensor) -> None:
        self.weight.data.copy_(self.shard_cols(full_weight))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.forward_partial(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, the residual add that follows o_proj and down_proj.

        A wrapper may first add its own term into ``residual`` in place (the LoRA does, see
        ``RowLoRA.forward_add``): callers pass a residual that nothing reads again.
        """
        return residual + self(x)
