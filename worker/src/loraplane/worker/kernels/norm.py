"""RMSNorm in Triton, one launch; reference: ``reference.rms_norm``.

The model's ``RMSNorm`` on the CPU is six torch ops (``float``, ``pow``, ``mean``, ``rsqrt``,
two ``mul``), each a kernel on a GPU: in a Llama-3-8B-shaped decode step on an H200 they are
about 13% of the step (``bench decode --profile-graphs``: the mean's reduction alone 8.9 us per
call). Here one program normalizes one row held in registers, with the torch
module's rounding steps: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, the sum in fp32
(in another order, and ``1 / sqrt`` rounded where torch's ``rsqrt`` is approximate: equal to
tolerance, not bit for bit).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels are untyped JIT functions; their wrappers are typed.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    MAX_ROW_COLUMNS,
    check_dim,
    check_same_dtype,
    check_tensor,
    next_power_of_2,
)

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    cols,
    x_stride,
    out_stride,
    eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / cols + eps)
    dtype = out_ptr.dtype.element_ty
    h = (x * rstd).to(dtype).to(tl.float32)  # rounded as the torch module rounds it
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (w * h).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` as a new ``[T, N]`` tensor."""
    fn = "rms_norm"
    x = check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    w = check_tensor(fn, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_same_dtype(fn, "weight", w, "x", x.dtype)
    check_dim(fn, "weight", w, 0, x.shape[1], "one weight per column of x")
    if not w.is_contiguous():
        raise ValueError(f"{fn}: weight must be contiguous, got stride {tuple(w.stride())}")
    if x.shape[1] > MAX_ROW_COLUMNS:
        raise ValueError(
            f"{fn}: x has {x.shape[1]} columns; one program holds a row, at most {MAX_ROW_COLUMNS}"
        )
    if not eps >= 0.0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return out
    block_n = next_power_of_2(x.shape[1])
    num_warps = 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16
    _rms_norm_kernel[(x.shape[0],)](
        x, w, out, x.shape[1], x.stride(0), out.stride(0), eps, BLOCK_N=block_n, num_warps=num_warps
    )
    return out
