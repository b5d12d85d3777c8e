"""Torch references of the segmented LoRA kernels.

Every function here has the same signature and the same semantics as its Triton twin in
``shrink.py`` / ``expand.py`` / ``moe.py``; tests compare the two, and the worker's ``torch``
backend calls these directly. They favour clarity over speed: a Python loop over segments
(or over ``(slot, expert)`` groups), one matmul each, accumulation in fp32. They do read
device tensors back to the host (``tolist``), which the Triton versions never do.

Layouts (see ``docs/kernels.md``):

* ``x [T, K]`` token rows; segment ``s`` covers positions ``j`` in
  ``seg_indptr[s]:seg_indptr[s+1]``, each reading row ``t = row_order[j]`` (or ``t = j``).
* ``lora_a [num_slots, num_slices * R, K]``: slice ``i`` of slot ``w`` is rows
  ``i*R : i*R + rank(w)``; rows beyond the rank are never read.
* ``lora_b [num_slots, N_total, R]``: slice ``i`` owns output columns
  ``slice_offsets[i]:slice_offsets[i+1]``; columns ``>= rank(w)`` are never read.
* ``y [positions, num_slices * R]`` is indexed by segment position ``j`` and is unscaled; the
  scaling is applied by expand.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "lora_expand",
    "lora_shrink",
    "moe_combine",
    "moe_lora_expand",
    "moe_lora_shrink",
    "rms_norm",
    "rope_qkv",
    "silu_and_mul",
    "stacked_lora_terms",
    "stacked_plain",
    "stacked_residual",
    "stacked_silu_mul",
]


def _positions(seg_indptr: torch.Tensor, row_order: torch.Tensor | None, num_rows: int) -> int:
    """Rows of ``y``: one per segment position (``row_order`` given) or one per token row."""
    return int(row_order.shape[0]) if row_order is not None else num_rows


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    row_order: torch.Tensor | None,
    num_slices: int,
    max_seg_len: int,
) -> torch.Tensor:
    """``y[j, i*R + k] = sum_c x[t, c] * lora_a[w, i*R + k, c]`` for ``k < rank(w)``, else 0.

    Returns ``y [positions, num_slices * R]`` in ``x.dtype``; positions not covered by any
    segment (and columns at or beyond a slot's rank) are zero. ``max_seg_len`` is unused here
    (the Triton version sizes its grid with it).
    """
    del max_seg_len
    rank_max = lora_a.shape[1] // num_slices
    y = torch.zeros(
        (_positions(seg_indptr, row_order, x.shape[0]), num_slices * rank_max),
        dtype=x.dtype,
        device=x.device,
    )
    bounds = seg_indptr.tolist()
    slots = seg_slots.tolist()
    ranks = slot_ranks.tolist()
    for s, slot in enumerate(slots):
        start, end = bounds[s], bounds[s + 1]
        rank = ranks[slot]
        if end <= start or rank == 0:
            continue
        rows = row_order[start:end] if row_order is not None else slice(start, end)
        xs = x[rows].float()  # [seg_len, K]
        for i in range(num_slices):
            a = lora_a[slot, i * rank_max : i * rank_max + rank].float()  # [rank, K]
            y[start:end, i * rank_max : i * rank_max + rank] = (xs @ a.T).to(x.dtype)
    return y


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    row_order: torch.Tensor | None,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int,
) -> None:
    """In place: ``out[t, cols_i] += scaling(w) * y[j, i*R : i*R+rank] @ lora_b[w, cols_i, :rank].T``.

    ``cols_i = slice_offsets[i]:slice_offsets[i+1]``. The product is accumulated in fp32, added to
    ``out`` in fp32 and rounded once to ``out.dtype``. Rows in no segment are untouched.
    """
    del max_seg_len
    num_slices = slice_offsets.shape[0] - 1
    rank_max = lora_b.shape[2]
    bounds = seg_indptr.tolist()
    slots = seg_slots.tolist()
    ranks = slot_ranks.tolist()
    scalings = slot_scalings.tolist()
    offsets = slice_offsets.tolist()
    for s, slot in enumerate(slots):
        start, end = bounds[s], bounds[s + 1]
        rank = ranks[slot]
        if end <= start or rank == 0:
            continue
        rows = row_order[start:end] if row_order is not None else torch.arange(start, end)
        rows = rows.to(out.device)
        for i in range(num_slices):
            lo, hi = offsets[i], offsets[i + 1]
            ys = y[start:end, i * rank_max : i * rank_max + rank].float()  # [seg_len, rank]
            b = lora_b[slot, lo:hi, :rank].float()  # [hi - lo, rank]
            delta = scalings[slot] * (ys @ b.T)  # [seg_len, hi - lo]
            out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)


def moe_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
    topk: int = 1,
    routing: object | None = None,
) -> torch.Tensor:
    """Shrink for routed experts: pair ``p`` uses ``lora_a[pair_slot[p], pair_expert[p]]``.

    ``x`` holds ``P // topk`` rows and pair ``p`` reads row ``p // topk`` (``topk=1``: one row per
    pair). Returns ``y [P, num_slices * R]`` in pair order; pairs with ``pair_slot == -1`` (no
    adapter) get zero rows. ``routing`` is accepted for signature parity and ignored.
    """
    del routing
    num_pairs = pair_expert.shape[0]
    rank_max = lora_a.shape[2] // num_slices
    y = torch.zeros((num_pairs, num_slices * rank_max), dtype=x.dtype, device=x.device)
    ranks = slot_ranks.tolist()
    slot_of_pair = pair_slot.to(torch.int64)
    expert_of_pair = pair_expert.to(torch.int64)
    groups = sorted(
        {
            (w, e)
            for w, e in zip(slot_of_pair.tolist(), expert_of_pair.tolist(), strict=True)
            if w >= 0
        }
    )
    for slot, expert in groups:
        rank = ranks[slot]
        if rank == 0:
            continue
        pairs = torch.nonzero((slot_of_pair == slot) & (expert_of_pair == expert)).flatten()
        xs = x[pairs // topk].float()  # [group_len, K]
        for i in range(num_slices):
            a = lora_a[slot, expert, i * rank_max : i * rank_max + rank].float()  # [rank, K]
            y[pairs, i * rank_max : i * rank_max + rank] = (xs @ a.T).to(x.dtype)
    return y


def moe_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_slot: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: torch.Tensor,
    out: torch.Tensor,
    routing: object | None = None,
) -> None:
    """In place: ``out[p, cols_i] += scaling(w) * y[p, i*R : i*R+rank] @ lora_b[w, e, cols_i, :rank].T``.

    ``w = pair_slot[p]``, ``e = pair_expert[p]``; pairs with ``w == -1`` are untouched.
    ``routing`` is accepted for signature parity and ignored.
    """
    del routing
    num_slices = slice_offsets.shape[0] - 1
    rank_max = lora_b.shape[3]
    ranks = slot_ranks.tolist()
    scalings = slot_scalings.tolist()
    offsets = slice_offsets.tolist()
    slot_of_pair = pair_slot.to(torch.int64)
    expert_of_pair = pair_expert.to(torch.int64)
    groups = sorted(
        {
            (w, e)
            for w, e in zip(slot_of_pair.tolist(), expert_of_pair.tolist(), strict=True)
            if w >= 0
        }
    )
    for slot, expert in groups:
        rank = ranks[slot]
        if rank == 0:
            continue
        pairs = torch.nonzero((slot_of_pair == slot) & (expert_of_pair == expert)).flatten()
        for i in range(num_slices):
            lo, hi = offsets[i], offsets[i + 1]
            ys = y[pairs, i * rank_max : i * rank_max + rank].float()  # [group_len, rank]
            b = lora_b[slot, expert, lo:hi, :rank].float()  # [hi - lo, rank]
            delta = scalings[slot] * (ys @ b.T)  # [group_len, hi - lo]
            out[pairs, lo:hi] = (out[pairs, lo:hi].float() + delta).to(out.dtype)


def silu_and_mul(gu: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu [T, 2I]`` (gate | up) plus ``delta`` (same shape, added in
    fp32), in fp32 and rounded once: ``[T, I]``."""
    full = gu.float()
    if delta is not None:  # a zero delta leaves the value as it is (-0.0 included)
        extra = delta.float()
        full = torch.where(extra != 0, full + extra, full)
    gate, up = full.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gu.dtype)


def moe_combine(
    d: torch.Tensor, topk_weights: torch.Tensor, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * (d + delta)[t * k + j]`` over each token's ``k`` pairs
    (``d [T * k, H]``, ``topk_weights [T, k]``), in fp32 and rounded once: ``[T, H]``."""
    t, k = topk_weights.shape
    full = d.float() if delta is None else d.float() + delta.float()
    weighted = full.reshape(t, k, d.shape[1]) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(d.dtype)


def stacked_lora_terms(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: Any,
    col_slices: list[tuple[int, int, int]],
) -> torch.Tensor:
    """fp32 ``[T, cols]``: each row's ``s * y B`` over ``col_slices`` ``(lo, hi, y offset)``,
    from the y columns of its stage position; zero for rows at position -1, past the width or
    at a position with no slot. ``stage`` is a ``StageInfo``."""
    rank_max = stage.rank
    cols = max(hi for _, hi, _ in col_slices)
    terms = torch.zeros(full.shape[0], cols, dtype=torch.float32, device=full.device)
    row_pos = stage.row_pos.tolist()
    slots, scal = stage.pos_slots.tolist(), stage.pos_scalings.tolist()
    for p in range(stage.width):
        at = [t for t, q in enumerate(row_pos) if q == p]
        if not at:
            continue
        if slots[p] < 0:  # a position with no slot adds nothing (as in the kernels)
            continue
        rows = torch.tensor(at, dtype=torch.long, device=full.device)
        y0 = n_base + p * n_r
        for lo, hi, y_off in col_slices:
            y = full[rows, y0 + y_off : y0 + y_off + rank_max].float()
            b = lora_b[slots[p], lo:hi, :rank_max].float()  # [hi - lo, r]
            terms[rows, lo:hi] += scal[p] * (y @ b.T)
    return terms


def stacked_plain(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: Any,
    slice_offsets: torch.Tensor,
) -> torch.Tensor:
    """``full[:, :N] + s * y B`` (see ``kernels/stacked.py``), fp32 math, rounded once."""
    offs = slice_offsets.tolist()
    r = stage.rank
    col_slices = [(offs[i], offs[i + 1], i * r) for i in range(len(offs) - 1)]
    terms = stacked_lora_terms(full, n_base, n_r, lora_b, stage, col_slices)
    return (full[:, :n_base].float() + terms).to(full.dtype)


def stacked_residual(
    full: torch.Tensor,
    n_base: int,
    n_r: int,
    lora_b: torch.Tensor,
    stage: Any,
    residual: torch.Tensor,
) -> torch.Tensor:
    """``residual += full[:, :N] + s * y B`` in place; returns ``residual``."""
    terms = stacked_lora_terms(full, n_base, n_r, lora_b, stage, [(0, n_base, 0)])
    residual.copy_((residual.float() + (full[:, :n_base].float() + terms)).to(residual.dtype))
    return residual


def stacked_silu_mul(
    full: torch.Tensor, n_base: int, n_r: int, lora_b: torch.Tensor, stage: Any
) -> torch.Tensor:
    """``silu(g + s y_g B_g) * (u + s y_u B_u)``, gate | up stacked in ``full[:, :N]``."""
    inter, r = n_base // 2, stage.rank
    terms = stacked_lora_terms(
        full, n_base, n_r, lora_b, stage, [(0, inter, 0), (inter, n_base, r)]
    )
    gu = full[:, :n_base].float() + terms
    return (F.silu(gu[:, :inter]) * gu[:, inter:]).to(full.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``: the model's ``RMSNorm``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    lora_b: torch.Tensor | None = None,
    stage: Any = None,
) -> torch.Tensor:
    """``kernels/rope.py``'s semantics: LoRA added in fp32 (staged batches), per-head norms
    rounded as ``RMSNorm`` rounds, the rotation in fp32 with ``cos_sin`` as given, rounded
    once; k and v written into the caches at their slots; returns ``q [T, H, d]``."""
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    n_base = (num_heads + 2 * kv_heads) * d
    t, dtype = qkv.shape[0], qkv.dtype
    val = qkv[:, :n_base].float()
    if lora_b is not None:
        r = stage.rank
        sizes = [0, num_heads * d, (num_heads + kv_heads) * d, n_base]
        col_slices = [(sizes[i], sizes[i + 1], i * r) for i in range(3)]
        val = val + stacked_lora_terms(qkv, n_base, 3 * r, lora_b, stage, col_slices)
    heads = val.view(t, num_heads + 2 * kv_heads, d)
    qk = heads[:, : num_heads + kv_heads]
    if q_norm is not None and k_norm is not None:
        w = torch.cat([q_norm.expand(num_heads, d), k_norm.expand(kv_heads, d)])  # [H+KV, d]
        normed = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
        qk = (w * normed.to(dtype)).float()
    half = d // 2
    cs = cos_sin[positions].float()[:, None, :]  # [T, 1, d]
    cos, sin = cs[..., :half], cs[..., half:]
    lo, hi = qk[..., :half], qk[..., half:]
    rotated = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1).to(dtype)
    k_cache.view(-1, kv_heads, d)[slots] = rotated[:, num_heads:]  # [pages * page_size, KV, d]
    v_cache.view(-1, kv_heads, d)[slots] = heads[:, num_heads + kv_heads :].to(dtype)
    return rotated[:, :num_heads].contiguous()
