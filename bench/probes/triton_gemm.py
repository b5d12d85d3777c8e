"""Probe: a Triton decode GEMM with one adapter's LoRA inside, against cuBLAS (CUDA only).

    python bench/probes/triton_gemm.py OUT.json

At decode a LoRA costs its launches, not its bytes (docs/performance.md). This probe asks
whether one kernel could do a batch-of-one-adapter projection whole: the base GEMM with the
shrink in its K loop (each K step of ``x`` also multiplied with that step of ``A``) and the
expand in its epilogue (``linear_lora`` below). Not adopted, by its measurement on an H200:
the plain Triton GEMM keeps up with cuBLAS at 16-64 rows, but the shrink's second dot in the
K loop slows it 1.3-2x at most shapes (``bench/results/2026-11-30-h200-s6/``).

Llama-3-8B's qkv, o, gate_up and down at 16/64/128 rows, bf16, rank 16, graph-timed from cold
L2 (``bench.common.time_graph``):

- ``cublas_us``: ``F.linear``; ``cublas_lora_us``: it, then the runtime's shrink and expand
  (``lora_apply``), one after the other (the eager path's cost);
- ``triton_us`` / ``fused_us``: ``linear_lora`` without and with the LoRA, default block
  shapes; ``fused_<config>_us``: the fused kernel under forced block shapes (rows, columns,
  K step, stages, warps), and the best of them.

Prints one JSON object per case and writes them all to OUT.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplane.worker import kernels
from loraplane.worker.bench.common import time_graph
from loraplane.worker.kernels._triton_utils import (
    FLOAT_DTYPES,
    check_dim,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_power_of_2,
    rank_block,
)


@triton.jit
def _linear_lora_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    a_ptr,  # [slots, NUM_SLICES * R, K]
    b_ptr,  # [slots, N, R]
    token_slots_ptr,  # int32 [M]: -1 = no adapter, else the batch's one slot
    seg_slots_ptr,  # int32 [>= 1]: [0] is the batch's slot
    seg_ranks_ptr,  # int32 [>= 1]: [0] is its rank
    seg_scalings_ptr,  # float32 [>= 1]: [0] is its scaling
    slice_offsets_ptr,  # int32 [NUM_SLICES + 1]
    M,
    N,
    rank_max,
    x_stride,
    w_stride,
    out_stride,
    a_stride_slot,
    a_stride_row,
    b_stride_slot,
    b_stride_row,
    K: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    HAS_LORA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    M_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = (pid % M_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n0 = (pid // M_BLOCKS) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        slot = tl.load(seg_slots_ptr).to(tl.int64)
        rank = tl.minimum(tl.load(seg_ranks_ptr), rank_max)
        scaling = tl.load(seg_scalings_ptr)
        slice_id = 0
        for i in tl.static_range(1, NUM_SLICES):
            slice_id += (n0 >= tl.load(slice_offsets_ptr + i)).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        r_mask = offs_r < rank  # rows of A / columns of B at or beyond the rank are never read
        a_rows = slice_id * rank_max + offs_r
        a_ptrs = (
            a_ptr + slot * a_stride_slot + a_rows[None, :].to(tl.int64) * a_stride_row
        ) + offs_k[:, None]  # [BK, BR]
        y_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        if HAS_LORA:
            a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            y_acc += tl.dot(x, a, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_LORA:
        row_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)  # [BLOCK_M]
        y = tl.where((row_slot >= 0)[:, None], y_acc, 0.0).to(b_ptr.dtype.element_ty)
        b_ptrs = (
            b_ptr + slot * b_stride_slot + offs_n[None, :].to(tl.int64) * b_stride_row
        ) + offs_r[:, None]  # [BR, BN]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += scaling * tl.dot(y, b, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


# Forced block shapes (the sweep below); None: the table in linear_config.
FORCE_CONFIG: LinearConfig | None = None


def _force(config: LinearConfig | None) -> None:
    global FORCE_CONFIG
    FORCE_CONFIG = config


def linear_config(rows: int, n: int, k: int) -> LinearConfig:
    """Block shapes for ``rows`` (decode: one or two row blocks) of an ``[n, k]`` weight.

    Measured on an H200 at Llama-3-8B's shapes (bench/probes/triton_gemm.py): at 16-64 rows a
    single row block with 256- or 128-wide K steps and five stages keeps up with cuBLAS;
    past 64 rows the tiles outgrow shared memory, so rows go in 64-row blocks whose programs
    share each weight tile through L2.
    """
    if FORCE_CONFIG is not None:
        return FORCE_CONFIG
    block_m = max(16, min(64, next_power_of_2(rows)))
    wide = n >= 16384  # gate_up: enough column blocks at 128 columns each
    block_n = 128 if wide else 64
    block_k = 256 if block_m <= 16 and not wide else 128
    stages = 3 if wide else 5
    block_k = min(block_k, max(16, next_power_of_2(k)))
    block_n = min(block_n, max(16, next_power_of_2(n)))
    return LinearConfig(block_m, block_n, block_k, stages, 4)


def linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    token_slots: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    seg_ranks: torch.Tensor | None = None,
    seg_scalings: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T`` (``lora=None``), or ``x W^T + s (x A^T) B^T`` for a batch of one adapter.

    ``lora = (lora_a [slots, slices*R, K], lora_b [slots, N, R], slice_offsets int32
    [slices + 1])`` as the LoRA layers hold them; ``token_slots``
    int32 ``[M]`` (-1: no adapter; every other value must be ``seg_slots[0]``); ``seg_slots``,
    ``seg_ranks``, ``seg_scalings``: the batch info's, whose first entries are that adapter's.
    Every slice width must be a multiple of the config's ``block_n``. No host sync.
    """
    fn = "linear_lora"
    x = check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES, unit_last_stride=True)
    weight = check_tensor(
        fn, "weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_last_stride=True
    )
    check_same_dtype(fn, "weight", weight, "x", x.dtype)
    check_dim(fn, "weight", weight, 1, x.shape[1], "the hidden size of x")
    m, k = x.shape
    n = weight.shape[0]
    config = linear_config(m, n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    m_blocks = triton.cdiv(m, config.block_m)
    dummy = x
    if lora is None:
        a = b = offsets = dummy
        num_slices, rank_max, block_r = 1, 0, 16
        tok = seg = ranks = scal = dummy
    else:
        a, b, offsets = lora
        a = check_tensor(
            fn, "lora_a", a, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True
        )
        b = check_tensor(
            fn, "lora_b", b, ndim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True
        )
        check_same_dtype(fn, "lora_a", a, "x", x.dtype)
        check_same_dtype(fn, "lora_b", b, "x", x.dtype)
        check_dim(fn, "lora_a", a, 2, k, "the hidden size of x")
        check_dim(fn, "lora_b", b, 1, n, "the output size of weight")
        num_slices = offsets.shape[0] - 1
        rank_max = b.shape[2]
        check_dim(fn, "lora_a", a, 1, num_slices * rank_max, "num_slices * max_rank of lora_b")
        block_r = rank_block(rank_max)
        if token_slots is None or seg_slots is None or seg_ranks is None or seg_scalings is None:
            raise ValueError(
                f"{fn}: with lora, give token_slots, seg_slots, seg_ranks and seg_scalings"
            )
        check_dim(fn, "token_slots", token_slots, 0, m, "one slot per row of x")
        tok, seg, ranks, scal = token_slots, seg_slots, seg_ranks, seg_scalings
    _linear_lora_kernel[(m_blocks * triton.cdiv(n, config.block_n),)](
        x,
        weight,
        out,
        a,
        b,
        tok,
        seg,
        ranks,
        scal,
        offsets,
        m,
        n,
        rank_max,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        a.stride(0),
        a.stride(1) if lora is not None else 0,
        b.stride(0),
        b.stride(1) if lora is not None else 0,
        K=k,
        NUM_SLICES=num_slices,
        HAS_LORA=lora is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_R=block_r,
        M_BLOCKS=m_blocks,
        num_stages=config.num_stages,
        num_warps=config.num_warps,
    )
    return out


# name: (slice widths, K)
SHAPES = {
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate_up": ([14336, 14336], 4096),
    "down": ([4096], 14336),
}
R = 16
SWEEP = [
    (32, 256, 5, 4),
    (64, 256, 5, 4),
    (64, 128, 5, 4),
    (128, 128, 3, 4),
    (32, 128, 5, 4),
    (64, 128, 3, 8),
    (128, 128, 4, 4),
    (64, 64, 6, 4),
]


def _us(fn: object) -> float:
    return round(time_graph(fn, "cuda") or 0.0, 2)  # type: ignore[arg-type]


def main(out_path: str) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    rows = []
    for name, (widths, k) in SHAPES.items():
        n = sum(widths)
        offs = [0]
        for w_ in widths:
            offs.append(offs[-1] + w_)
        offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        a = torch.randn(4, len(widths) * R, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(4, n, R, device=dev, dtype=torch.bfloat16) / R**0.5
        for m in (16, 64, 128):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            tok = torch.full((m,), 2, dtype=torch.int32, device=dev)
            seg = torch.tensor([2], dtype=torch.int32, device=dev)
            ranks = torch.tensor([R], dtype=torch.int32, device=dev)
            scal = torch.tensor([0.5], dtype=torch.float32, device=dev)
            indptr = torch.tensor([0, m], dtype=torch.int32, device=dev)
            slot_ranks = torch.full((4,), R, dtype=torch.int32, device=dev)
            slot_scal = torch.full((4,), 0.5, dtype=torch.float32, device=dev)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def cublas_lora() -> None:
                torch.mm(x, w.t(), out=out)  # noqa: B023 (run within this iteration)
                kernels.lora_apply(
                    x,  # noqa: B023
                    a,  # noqa: B023
                    b,  # noqa: B023
                    indptr,  # noqa: B023
                    seg,  # noqa: B023
                    slot_ranks,  # noqa: B023
                    slot_scal,  # noqa: B023
                    None,
                    offsets,  # noqa: B023
                    out,  # noqa: B023
                    m,  # noqa: B023
                    seg_ranks=ranks,  # noqa: B023
                    seg_scalings=scal,  # noqa: B023
                )

            fused = partial(linear_lora, x, w, (a, b, offsets), tok, seg, ranks, scal)
            ref = out.clone()
            cublas_lora()
            ref.copy_(out)
            row: dict[str, object] = {"module": name, "M": m, "N": n, "K": k}
            row["cublas_us"] = _us(partial(F.linear, x, w))
            row["cublas_lora_us"] = _us(cublas_lora)
            row["triton_us"] = _us(partial(linear_lora, x, w))
            row["fused_us"] = _us(fused)
            row["fused_max_abs_vs_cublas_lora"] = float((fused().float() - ref.float()).abs().max())
            row["default_config"] = str(linear_config(m, n, k))
            best: tuple[float, str] | None = None
            for block_m in sorted({max(16, min(64, m)), max(16, m)}):
                for bn, bk, stages, warps in SWEEP:
                    key = f"m{block_m}n{bn}k{bk}s{stages}w{warps}"
                    _force(LinearConfig(block_m, bn, bk, stages, warps))
                    try:
                        fused()
                        us = _us(fused)
                    except Exception as exc:  # out of shared memory: skip the config
                        row[f"fused_{key}_error"] = type(exc).__name__
                        continue
                    finally:
                        _force(None)
                    row[f"fused_{key}_us"] = us
                    if best is None or us < best[0]:
                        best = (us, key)
            if best is not None:
                row["fused_best_us"], row["fused_best"] = best
            print(
                {
                    k2: v
                    for k2, v in row.items()
                    if not (k2.startswith("fused_m") or k2.endswith("_error"))
                },
                flush=True,
            )
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"probe": "triton_gemm", "gpu": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main(sys.argv[1])
