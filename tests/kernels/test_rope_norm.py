"""RMSNorm (kernels/norm.py) and rotary + KV write (kernels/rope.py) against their torch
references and against the model's own torch path (RMSNorm, RotaryEmbedding, the cache
index writes), which is what the GPU path replaces."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.kernels.test_lora_kernels_segmented import DEVICE, DTYPES, TOL
from tests.kernels.test_stacked import R, _batch, _rows

from loraplane.worker.config import RopeScaling
from loraplane.worker.kernels import norm, reference, rope, stacked
from loraplane.worker.models.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.kernels

H, KV, D = 4, 2, 32  # heads, KV heads, head size: q | k | v is 256 columns
N_QKV = (H + 2 * KV) * D
ROWS, MAX_LEN = 6, 40  # sequences and positions
PAGE = 8  # KV-cache positions per page: a row's 40 positions on 5 pages, scattered


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol)


# --- RMSNorm -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (37, 96), (0, 64), (5, 4096)])
def test_rms_norm_matches_the_models_module(dtype: torch.dtype, rows: int, cols: int) -> None:
    x = (torch.randn(rows, cols) * 3).to(dtype).to(DEVICE)
    module = RMSNorm(cols, 1e-5).to(dtype).to(DEVICE)
    module.weight.data.copy_(torch.rand(cols) + 0.5)
    got = norm.rms_norm(x, module.weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, module(x), dtype)
    _close(got, reference.rms_norm(x, module.weight, 1e-5), dtype)


def test_rms_norm_reads_a_row_strided_view_and_names_bad_input() -> None:
    wide = torch.randn(9, 100).to(DEVICE)
    w = torch.rand(64).to(DEVICE)
    got = norm.rms_norm(wide[:, :64], w, 1e-6)
    _close(got, reference.rms_norm(wide[:, :64].contiguous(), w, 1e-6), torch.float32)
    with pytest.raises(ValueError, match=r"rms_norm: weight.shape\[0\] must be 64"):
        norm.rms_norm(wide[:, :64], torch.ones(63, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have dtype torch.float32"):
        norm.rms_norm(wide[:, :64], w.half(), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm: eps must be >= 0"):
        norm.rms_norm(wide[:, :64], w, -1.0)


# --- rotary + KV write ---------------------------------------------------------------------


def _rope_inputs(
    t: int, dtype: torch.dtype, d: int = D, seed: int = 0, scaling: RopeScaling | None = None
) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    n = (H + 2 * KV) * d
    rotary = RotaryEmbedding(d, 10000.0, scaling).to(DEVICE)
    positions = torch.randint(0, MAX_LEN, (t,), generator=g)
    cache_rows = torch.randperm(ROWS, generator=g)[:t] if t <= ROWS else torch.arange(t) % ROWS
    # distinct (row, position) pairs, as a batch writes them
    positions = positions if t <= ROWS else torch.arange(t) // ROWS
    # each row's pages, a permutation of the pool: the slot of (row, position)
    per_row = MAX_LEN // PAGE
    pages = torch.randperm(max(ROWS, t) * per_row, generator=g).view(-1, per_row)
    slots = pages[cache_rows, positions // PAGE] * PAGE + positions % PAGE
    shape = (pages.numel(), PAGE, KV, d)  # [pages, page_size, KV, d]
    return {
        "qkv": (torch.randn(t, n, generator=g) * 2).to(dtype).to(DEVICE),
        "positions": positions.to(DEVICE),
        "slots": slots.to(DEVICE),
        "cos_sin": rotary.cos_sin(MAX_LEN, dtype),
        "k_cache": torch.zeros(shape, dtype=dtype, device=DEVICE),
        "v_cache": torch.zeros(shape, dtype=dtype, device=DEVICE),
        "rotary": rotary,
    }


def _torch_path(inp: dict, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):  # type: ignore[no-untyped-def, type-arg]
    """What ``Attention.forward`` does on the CPU: split, per-head norms, rotate, write."""
    qkv, d = inp["qkv"], inp["k_cache"].shape[3]
    t = qkv.shape[0]
    q, k, v = qkv.split([H * d, KV * d, KV * d], dim=-1)
    q, k, v = q.reshape(t, H, d), k.reshape(t, KV, d), v.reshape(t, KV, d)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = inp["rotary"](inp["positions"], q, k)
    k_cache, v_cache = inp["k_cache"].clone(), inp["v_cache"].clone()
    k_cache.view(-1, KV, d)[inp["slots"]] = k
    v_cache.view(-1, KV, d)[inp["slots"]] = v
    return q, k_cache, v_cache


def _args(inp: dict) -> tuple:  # type: ignore[type-arg]
    keys = ("qkv", "positions", "slots", "cos_sin", "k_cache", "v_cache")
    return tuple(inp[k] for k in keys)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(5, D), (21, D), (3, 16), (0, D)])
def test_rope_qkv_rotates_q_and_writes_k_and_v_as_the_torch_path(
    dtype: torch.dtype, t: int, d: int
) -> None:
    inp = _rope_inputs(t, dtype, d)
    want_q, want_k, want_v = _torch_path(inp)
    ref = _rope_inputs(t, dtype, d)
    ref_q = reference.rope_qkv(*_args(ref), H)
    q = rope.rope_qkv(*_args(inp), H)
    assert q.shape == (t, H, d) and q.dtype == dtype and q.is_contiguous()
    # the torch path rotates in the model dtype; the kernel in fp32, rounded once
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for got, want in ((q, want_q), (inp["k_cache"], want_k), (inp["v_cache"], want_v)):
        torch.testing.assert_close(got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol)
    _close(q, ref_q, dtype)
    _close(inp["k_cache"], ref["k_cache"], dtype)
    # v is copied bit for bit, and only the batch's (row, position) pairs were written
    assert torch.equal(inp["v_cache"], want_v)
    assert int((inp["k_cache"] != 0).any(-1).any(-1).sum()) == t


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_reads_yarns_scaled_table_as_the_torch_path(dtype: torch.dtype) -> None:
    """YaRN's scaled frequencies and attention factor live in the cos | sin table, which the
    kernel reads as it is: the same rotation as the torch path's."""
    yarn = RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.2
    )
    inp = _rope_inputs(11, dtype, scaling=yarn)
    plain = _rope_inputs(11, dtype)
    assert not torch.equal(inp["cos_sin"], plain["cos_sin"])
    want_q, want_k, _ = _torch_path(inp)
    q = rope.rope_qkv(*_args(inp), H)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(q.cpu().float(), want_q.cpu().float(), rtol=tol, atol=tol)
    torch.testing.assert_close(
        inp["k_cache"].cpu().float(), want_k.cpu().float(), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_applies_qwen3s_per_head_norms_first(dtype: torch.dtype) -> None:
    inp = _rope_inputs(11, dtype)
    q_norm = RMSNorm(D, 1e-6).to(dtype).to(DEVICE)
    k_norm = RMSNorm(D, 1e-6).to(dtype).to(DEVICE)
    q_norm.weight.data.copy_(torch.rand(D) + 0.5)
    k_norm.weight.data.copy_(torch.rand(D) * 2)
    want_q, want_k, _ = _torch_path(inp, q_norm, k_norm)
    q = rope.rope_qkv(*_args(inp), H, q_norm=q_norm.weight, k_norm=k_norm.weight, eps=1e-6)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(q.cpu().float(), want_q.cpu().float(), rtol=tol, atol=tol)
    torch.testing.assert_close(
        inp["k_cache"].cpu().float(), want_k.cpu().float(), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("kernel", ["by-tile", "by-rows", "no-tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 2, 8])
def test_rope_qkv_adds_a_staged_lora_per_head_before_rotating(
    dtype: torch.dtype, width: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qkv`` is a stacked GEMM's ``full``: the LoRA of each row's stage position goes in
    first; rows without an adapter come out exactly as the base path's. Each kernel: a
    program per (tile of a position's rows, head) as decode steps run it
    (``StageInfo.tiles``), and per (row block, head) visiting its rows' positions as prompt
    steps do (``stacked.ROWS_KERNEL_MIN``), which a ``StageInfo`` without tiles gets at any
    size."""
    if kernel == "by-rows":
        monkeypatch.setattr(stacked, "ROWS_KERNEL_MIN", 1)
    rows = 40
    full, b, stage = _batch(rows, N_QKV, 3, dtype, width)
    if kernel == "no-tiles":
        stage = dataclasses.replace(stage, tiles=None)
    inp = _rope_inputs(rows, dtype)
    inp["qkv"] = full
    ref = _rope_inputs(rows, dtype)
    ref["qkv"] = full
    base = _rope_inputs(rows, dtype)
    base["qkv"] = full[:, :N_QKV].contiguous()
    q = rope.rope_qkv(*_args(inp), H, lora_b=b, stage=stage)
    want_q = reference.rope_qkv(*_args(ref), H, lora_b=b, stage=stage)
    base_q = rope.rope_qkv(*_args(base), H)
    _close(q, want_q, dtype)
    _close(inp["k_cache"], ref["k_cache"], dtype)
    _close(inp["v_cache"], ref["v_cache"], dtype)
    with_adapter, no_adapter = _rows(stage)
    assert torch.equal(q[no_adapter], base_q[no_adapter])
    for cache in ("k_cache", "v_cache"):  # and the cache slots they wrote
        slots = base["slots"][no_adapter]
        assert torch.equal(inp[cache].view(-1, KV, D)[slots], base[cache].view(-1, KV, D)[slots])
    assert (q[with_adapter].float() - base_q[with_adapter].float()).abs().max() > 0.1
    # the same as adding the LoRA first (stacked_plain), then the base path's rotation
    plain = _rope_inputs(rows, dtype)
    offsets = torch.tensor([0, H * D, (H + KV) * D, N_QKV], dtype=torch.int32, device=DEVICE)
    plain["qkv"] = reference.stacked_plain(full, N_QKV, 3 * R, b, stage, offsets)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(
        q.cpu().float(), rope.rope_qkv(*_args(plain), H).cpu().float(), rtol=tol, atol=tol
    )


def test_rope_qkv_names_a_bad_input() -> None:
    inp = _rope_inputs(5, torch.float32)
    args = list(_args(inp))
    with pytest.raises(ValueError, match=r"rope_qkv: qkv must have \(num_heads 4 \+ 2 x KV 2\)"):
        rope.rope_qkv(args[0][:, :100], *args[1:], H)
    with pytest.raises(ValueError, match=r"rope_qkv: positions.shape\[0\] must be 5"):
        rope.rope_qkv(args[0], args[1][:4], *args[2:], H)
    with pytest.raises(ValueError, match=r"rope_qkv: positions must have dtype in \(torch.int64\)"):
        rope.rope_qkv(args[0], args[1].int(), *args[2:], H)
    with pytest.raises(ValueError, match=r"rope_qkv: slots must be contiguous"):
        rope.rope_qkv(*args[:2], torch.stack([args[2], args[2]], 1)[:, 0], *args[3:], H)
    with pytest.raises(ValueError, match=r"rope_qkv: cos_sin.shape\[1\] must be 32"):
        rope.rope_qkv(*args[:3], args[3][:, :16], *args[4:], H)
    with pytest.raises(ValueError, match=r"rope_qkv: v_cache must have k_cache's shape"):
        rope.rope_qkv(*args[:5], args[5][:, :, :1], H)
    with pytest.raises(ValueError, match=r"rope_qkv: q_norm and k_norm go together"):
        rope.rope_qkv(*args, H, q_norm=torch.ones(D, device=DEVICE))
    _, b, stage = _batch(12, N_QKV, 3, torch.float32)
    with pytest.raises(ValueError, match=r"rope_qkv: lora_b and stage go together"):
        rope.rope_qkv(*args, H, lora_b=b)
    inp = _rope_inputs(12, torch.float32)
    args = list(_args(inp))
    with pytest.raises(
        ValueError, match=r"rope_qkv: qkv must have at least 448 columns \(N 256 \+ width 4 x nR 48"
    ):
        rope.rope_qkv(*args, H, lora_b=b, stage=stage)
