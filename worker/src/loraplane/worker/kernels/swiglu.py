"""SwiGLU ``act = silu(gate) * up`` in Triton; reference: ``reference.silu_and_mul``.

An optional ``delta`` of ``gu``'s shape is added first, in fp32: the routed experts' gate_up
LoRA, computed beside their grouped GEMM (``lora.layers.ExpertsLoRA``).

``gu [T, 2I]`` is a gate_up projection's output: gate in columns ``[0, I)``, up in ``[I, 2I)``.
One kernel where torch needs two (``silu``, then ``mul`` reading back what ``silu`` wrote):
measured on an H200 at Llama-3-8B decode shapes, 2.8-5.3 us against torch's 7.6-15 us
(``bench/results/2026-11-30-h200-s5/swiglu_probe.json``). The math is fp32, rounded once.

gate_up's LoRA expand stays a separate launch: fused in here (20b4a39), a row block holding
several adapters' rows takes one serial pass per adapter, up to 10x slower than the separate
expand (docs/performance.md, "Tried and not kept").
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import FLOAT_DTYPES, cdiv, check_tensor, next_power_of_2

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2I]: gate | up
    delta_ptr,  # [T, 2I] added to gu first (read only when HAS_DELTA)
    act_ptr,  # [T, I]
    rows,
    inter,
    gu_stride_row,
    delta_stride_row,
    act_stride_row,
    HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    mask = (offs_m < rows)[:, None] & (offs_n < inter)[None, :]
    g_ptrs = gu_ptr + offs_m[:, None].to(tl.int64) * gu_stride_row + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    up = tl.load(g_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d_ptrs = delta_ptr + offs_m[:, None].to(tl.int64) * delta_stride_row + offs_n[None, :]
        # A zero delta (a row without an adapter) leaves the value as it is, -0.0 included:
        # the row's bits are LoRA-off's.
        d_gate = tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
        d_up = tl.load(d_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        gate = tl.where(d_gate != 0.0, gate + d_gate, gate)
        up = tl.where(d_up != 0.0, up + d_up, up)
    act = gate / (1.0 + tl.exp(-gate)) * up
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * act_stride_row + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gu: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(g) * u`` of ``gu + delta`` (gate | up; ``delta``, if given, the same shape and
    dtype as ``gu``, is added in fp32) as a new ``[T, I]`` tensor, in one launch."""
    fn = "silu_and_mul"
    gu = check_tensor(fn, "gu", gu, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    if gu.shape[1] % 2:
        raise ValueError(
            f"{fn}: gu must be [rows, 2 * intermediate] (gate | up), got an odd width "
            f"{gu.shape[1]} in shape {tuple(gu.shape)}"
        )
    if delta is not None:
        delta = check_tensor(
            fn,
            "delta",
            delta,
            ndim=2,
            dtypes=(gu.dtype,),
            device=gu.device,
            unit_last_stride=True,
        )
        if delta.shape != gu.shape:
            raise ValueError(
                f"{fn}: delta must have the shape of gu {tuple(gu.shape)}, got {tuple(delta.shape)}"
            )
    rows, inter = gu.shape[0], gu.shape[1] // 2
    act = torch.empty((rows, inter), dtype=gu.dtype, device=gu.device)
    if rows == 0 or inter == 0:
        return act
    # 16 x 128 tiles at decode, 32 x 128 past 128 rows: about 2-4K elements per program.
    block_m = 16 if rows <= 128 else 32
    block_n = min(128, next_power_of_2(inter))
    grid = (cdiv(rows, block_m), cdiv(inter, block_n))
    _silu_mul_kernel[grid](
        gu,
        delta if delta is not None else gu,
        act,
        rows,
        inter,
        gu.stride(0),
        delta.stride(0) if delta is not None else 0,
        act.stride(0),
        HAS_DELTA=delta is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return act
