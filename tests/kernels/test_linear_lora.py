"""``kernels.linear_lora``: a decode projection with its multi-LoRA in one launch.

Against an independent float64 reference (each row's own slot's weights, explicitly), with
NaN beyond every slot's rank (never read), rows with no adapter, rows gathered out of order,
a rank-0 slot and K split over several programs (the shrink's fix-up inside the launch).
The Triton interpreter has no bf16 dot, so the CPU runs fp16; tests/gpu runs bf16.
"""

from __future__ import annotations

import pytest
import torch

from loraplane.worker.kernels import linear_lora as ll
from loraplane.worker.kernels import shrink
from loraplane.worker.lora.batch_info import LoRABatchInfo

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def make(
    slots: list[int],
    ranks: list[int],
    widths: list[int],
    k: int,
    dtype: torch.dtype,
    max_rank: int = 16,
    seed: int = 0,
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    m, n, s, nsl = len(slots), sum(widths), len(ranks), len(widths)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    a = torch.randn(s, nsl, max_rank, k, generator=gen) / k**0.5
    b = torch.randn(s, n, max_rank, generator=gen)
    for slot, rank in enumerate(ranks):  # never read: poison
        a[slot, :, rank:] = float("nan")
        b[slot, :, rank:] = float("nan")
    scalings = torch.tensor([0.5 + 0.75 * i for i in range(s)])
    rank_t = torch.tensor(ranks, dtype=torch.int32)
    offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32)
    info = LoRABatchInfo.build(slots, rank_t.to(DEVICE), scalings.to(DEVICE), DEVICE)
    assert info is not None

    # float64 reference: out = x W^T + s * (x A_i^T) B_i^T per row, slice by slice
    x64, w64 = x.to(dtype).double(), w.to(dtype).double()
    want = x64 @ w64.t()
    for row, slot in enumerate(slots):
        if slot < 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        for i in range(nsl):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            ai = a[slot, i, :r].to(dtype).double()  # [r, K]
            bi = b[slot, lo:hi, :r].to(dtype).double()  # [n_i, r]
            want[row, lo:hi] += float(scalings[slot]) * ((x64[row] @ ai.t()) @ bi.t())
    return {
        "x": x.to(dtype).to(DEVICE),
        "weight": w.to(dtype).to(DEVICE),
        "lora_a": a.reshape(s, nsl * max_rank, k).to(dtype).to(DEVICE),
        "lora_b": b.to(dtype).to(DEVICE),
        "slice_offsets": offsets.to(DEVICE),
        "slice_widths": widths,
        "info": info,
        "want": want,
        "base": x64 @ w64.t(),
    }


def run(case: dict[str, object]) -> torch.Tensor:
    info = case["info"]
    assert isinstance(info, LoRABatchInfo)
    return ll.linear_lora(  # type: ignore[no-any-return]
        case["x"],  # type: ignore[arg-type]
        case["weight"],  # type: ignore[arg-type]
        case["lora_a"],  # type: ignore[arg-type]
        case["lora_b"],  # type: ignore[arg-type]
        case["slice_offsets"],  # type: ignore[arg-type]
        case["slice_widths"],  # type: ignore[arg-type]
        info.token_slots,
        info.seg_indptr,
        info.seg_slots,
        info.seg_ranks,
        info.slot_ranks,
        info.slot_scalings,
        info.row_order,
        info.max_seg_len,
    )


def check(case: dict[str, object], dtype: torch.dtype) -> torch.Tensor:
    out = run(case)
    want = case["want"]
    assert isinstance(want, torch.Tensor)
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(
        out.cpu().double(), want, atol=tol * want.abs().max().item(), rtol=tol
    )
    assert not shrink.split_counts(DEVICE).any(), "a launch left its counters behind"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_slots_rows_out_of_order_and_base_rows(dtype: torch.dtype) -> None:
    # qkv-like slices; slots 1, 0, 1 interleaved (row_order gathers them), a rank-0 slot (3),
    # rows with no adapter; K 640 is split over programs whose last sums the partials.
    slots = [1, -1, 0, 1, 3, 2, -1]
    case = make(slots, [16, 8, 4, 0], [64, 128, 64], 640, dtype)
    info = case["info"]
    assert isinstance(info, LoRABatchInfo) and info.row_order is not None
    out = check(case, dtype)
    base = case["base"]
    assert isinstance(base, torch.Tensor)
    for row in (1, 4, 6):  # no adapter, or a rank-0 one: the base alone
        torch.testing.assert_close(out[row].cpu().double(), base[row], atol=2e-2, rtol=2e-2)
    lora_rows = [0, 2, 3, 5]
    assert (out[lora_rows].cpu().double() - base[lora_rows]).abs().max() > 0.5, (
        "the LoRA must visibly change its rows, or this tests nothing"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_adapter_for_every_row_repeats_bit_for_bit(dtype: torch.dtype) -> None:
    case = make([2] * 16, [8, 16, 16], [128], 2048, dtype, seed=3)
    first = check(case, dtype)
    for _ in range(2):  # the counters were zeroed: the next launches take the same path
        assert torch.equal(run(case), first)


def test_a_shrink_split_over_k_is_summed_inside_the_launch() -> None:
    """K 2048 at one token per adapter: the shrink programs split K (fix-up counts used)."""
    config = shrink.shrink_config(1, 16, 2048, 2)
    assert shrink.split_k_for(3 * 2, 2048, config.block_k) > 1
    check(make([0, 1, 2], [16, 4, 12], [64, 64], 2048, torch.float16, seed=5), torch.float16)


def test_supported_shapes() -> None:
    assert ll.linear_lora_supported(64, [4096, 1024, 1024], 4096, 16, 16)
    assert not ll.linear_lora_supported(65, [4096], 4096, 4, 16)  # past the decode rows
    assert not ll.linear_lora_supported(16, [4096], 4096, 32, 16)  # 512 stacked rank rows
    assert not ll.linear_lora_supported(16, [96, 32], 256, 4, 16)  # a column block straddles


def test_bad_inputs_name_the_operand() -> None:
    case = make([0, -1], [8], [64], 256, torch.float16)
    info = case["info"]
    assert isinstance(info, LoRABatchInfo)
    args = [case[k] for k in ("x", "weight", "lora_a", "lora_b", "slice_offsets", "slice_widths")]
    rest = [
        info.token_slots,
        info.seg_indptr,
        info.seg_slots,
        info.seg_ranks,
        info.slot_ranks,
        info.slot_scalings,
        info.row_order,
        info.max_seg_len,
    ]
    with pytest.raises(ValueError, match="token_slots"):
        ll.linear_lora(*args, info.token_slots[:1], *rest[1:])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slice_widths"):
        ll.linear_lora(*args[:5], [32, 32, 0], *rest)  # type: ignore[arg-type]
    wide = torch.zeros(80, 256, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="not supported for 80 rows"):
        ll.linear_lora(
            wide, *args[1:], torch.zeros(80, dtype=torch.int32, device=DEVICE), *rest[1:]
        )  # type: ignore[arg-type]
    assert not shrink.split_counts(DEVICE).any()
