"""The launch wrappers reject bad arguments with a ValueError naming the argument."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from loraplane.worker.kernels import expand, moe, shrink

pytestmark = pytest.mark.kernels

T, K, R, SLOTS, N = 6, 32, 8, 3, 48


def shrink_args() -> dict[str, Any]:
    return dict(
        x=torch.randn(T, K),
        lora_a=torch.randn(SLOTS, 2 * R, K),
        seg_indptr=torch.tensor([0, 2, 6], dtype=torch.int32),
        seg_slots=torch.tensor([0, 2], dtype=torch.int32),
        slot_ranks=torch.tensor([8, 4, 2], dtype=torch.int32),
        row_order=None,
        num_slices=2,
        max_seg_len=4,
    )


def expand_args() -> dict[str, Any]:
    return dict(
        y=torch.randn(T, 2 * R),
        lora_b=torch.randn(SLOTS, N, R),
        seg_indptr=torch.tensor([0, 2, 6], dtype=torch.int32),
        seg_slots=torch.tensor([0, 2], dtype=torch.int32),
        slot_ranks=torch.tensor([8, 4, 2], dtype=torch.int32),
        slot_scalings=torch.tensor([1.0, 2.0, 0.5]),
        row_order=None,
        slice_offsets=torch.tensor([0, 32, 48], dtype=torch.int32),
        out=torch.zeros(T, N),
        max_seg_len=4,
    )


def apply_args() -> dict[str, Any]:
    args = expand_args()
    del args["y"]
    return dict(args, x=torch.randn(T, K), lora_a=torch.randn(SLOTS, 2 * R, K))


def moe_shrink_args() -> dict[str, Any]:
    return dict(
        x=torch.randn(T, K),
        lora_a=torch.randn(SLOTS, 4, R, K),
        pair_expert=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], dtype=torch.int32),
        pair_slot=torch.tensor([0, 0, 1, 1, -1, -1, 2, 2, 0, 0, 1, 1], dtype=torch.int32),
        slot_ranks=torch.tensor([8, 4, 2], dtype=torch.int32),
        num_slices=1,
        topk=2,
    )


def moe_expand_args() -> dict[str, Any]:
    return dict(
        y=torch.randn(2 * T, R),
        lora_b=torch.randn(SLOTS, 4, K, R),
        pair_expert=torch.zeros(2 * T, dtype=torch.int32),
        pair_slot=torch.zeros(2 * T, dtype=torch.int32),
        slot_ranks=torch.tensor([8, 4, 2], dtype=torch.int32),
        slot_scalings=torch.tensor([1.0, 2.0, 0.5]),
        slice_offsets=torch.tensor([0, K], dtype=torch.int32),
        out=torch.zeros(2 * T, K),
    )


CASES: list[tuple[str, Callable[..., Any], Callable[[], dict[str, Any]], dict[str, Any], str]] = [
    (
        "x_3d",
        shrink.lora_shrink,
        shrink_args,
        {"x": torch.randn(1, T, K)},
        "lora_shrink: x must be a 2-D tensor",
    ),
    (
        "x_int",
        shrink.lora_shrink,
        shrink_args,
        {"x": torch.ones(T, K, dtype=torch.int32)},
        "x must have dtype in",
    ),
    (
        "x_strided",
        shrink.lora_shrink,
        shrink_args,
        {"x": torch.randn(K, T).T},
        "x must have unit stride",
    ),
    (
        "a_dtype",
        shrink.lora_shrink,
        shrink_args,
        {"lora_a": torch.randn(SLOTS, 2 * R, K).half()},
        "lora_a must have dtype torch.float32 (same as x)",
    ),
    (
        "a_hidden",
        shrink.lora_shrink,
        shrink_args,
        {"lora_a": torch.randn(SLOTS, 2 * R, K + 1)},
        "lora_a.shape[2] must be 32",
    ),
    (
        "a_noncontig",
        shrink.lora_shrink,
        shrink_args,
        {"lora_a": torch.randn(SLOTS, K, 2 * R).transpose(1, 2)},
        "lora_a must be contiguous",
    ),
    (
        "a_slices",
        shrink.lora_shrink,
        shrink_args,
        {"num_slices": 3},
        "not a multiple of num_slices=3",
    ),
    (
        "indptr_dtype",
        shrink.lora_shrink,
        shrink_args,
        {"seg_indptr": torch.tensor([0, 2, 6])},
        "seg_indptr must have dtype in (torch.int32)",
    ),
    (
        "slots_len",
        shrink.lora_shrink,
        shrink_args,
        {"seg_slots": torch.tensor([0], dtype=torch.int32)},
        "seg_slots.shape[0] must be 2",
    ),
    (
        "ranks_len",
        shrink.lora_shrink,
        shrink_args,
        {"slot_ranks": torch.tensor([8], dtype=torch.int32)},
        "slot_ranks.shape[0] must be 3",
    ),
    (
        "row_order_dtype",
        shrink.lora_shrink,
        shrink_args,
        {"row_order": torch.arange(6, dtype=torch.int32)},
        "row_order must have dtype in (torch.int64)",
    ),
    (
        "max_seg_len",
        shrink.lora_shrink,
        shrink_args,
        {"max_seg_len": torch.tensor(4)},
        "max_seg_len must be a host int",
    ),
    (
        "y_width",
        expand.lora_expand,
        expand_args,
        {"y": torch.randn(T, R)},
        "lora_expand: y.shape[1] must be 16",
    ),
    (
        "y_rows",
        expand.lora_expand,
        expand_args,
        {"y": torch.randn(T + 1, 2 * R)},
        "y.shape[0] must be 6",
    ),
    (
        "b_dtype",
        expand.lora_expand,
        expand_args,
        {"lora_b": torch.randn(SLOTS, N, R).double()},
        "lora_b must have dtype in",
    ),
    (
        "out_width",
        expand.lora_expand,
        expand_args,
        {"out": torch.zeros(T, N - 1)},
        "out.shape[1] must be 48",
    ),
    (
        "scalings_dtype",
        expand.lora_expand,
        expand_args,
        {"slot_scalings": torch.tensor([1.0, 2.0, 0.5]).double()},
        "slot_scalings must have dtype in (torch.float32)",
    ),
    (
        "offsets_short",
        expand.lora_expand,
        expand_args,
        {"slice_offsets": torch.tensor([0], dtype=torch.int32)},
        "slice_offsets must have num_slices + 1 >= 2",
    ),
    (
        "moe_topk",
        moe.moe_lora_shrink,
        moe_shrink_args,
        {"topk": 3},
        "moe_lora_shrink: x.shape[0] * topk must equal the number of pairs",
    ),
    (
        "moe_a_ndim",
        moe.moe_lora_shrink,
        moe_shrink_args,
        {"lora_a": torch.randn(SLOTS, R, K)},
        "lora_a must be a 4-D tensor",
    ),
    (
        "moe_pair_slot",
        moe.moe_lora_shrink,
        moe_shrink_args,
        {"pair_slot": torch.zeros(5, dtype=torch.int32)},
        "pair_slot.shape[0] must be 12",
    ),
    (
        "moe_out_rows",
        moe.moe_lora_expand,
        moe_expand_args,
        {"out": torch.zeros(T, K)},
        "moe_lora_expand: out.shape[0] must be 12",
    ),
    (
        "apply_b_rank",
        expand.lora_apply,
        apply_args,
        {"lora_b": torch.randn(SLOTS, N, 2 * R)},
        "lora_apply: lora_b.shape[2] must be 8 (the max rank of lora_a per slice)",
    ),
    (
        "apply_b_dtype",
        expand.lora_apply,
        apply_args,
        {"lora_b": torch.randn(SLOTS, N, R, dtype=torch.float16)},
        "lora_apply: lora_b must have dtype torch.float32 (same as x)",
    ),
    (
        "apply_out_rows",
        expand.lora_apply,
        apply_args,
        {"out": torch.zeros(T + 1, N)},
        "lora_apply: out.shape[0] must be 6 (one row per row of x)",
    ),
    (
        "apply_seg_ranks_alone",
        expand.lora_apply,
        apply_args,
        {"seg_ranks": torch.tensor([8, 2], dtype=torch.int32)},
        "lora_apply: give seg_ranks and seg_scalings together, or neither",
    ),
    (
        "apply_seg_ranks_length",
        expand.lora_apply,
        apply_args,
        {
            "seg_ranks": torch.tensor([8, 2, 4], dtype=torch.int32),
            "seg_scalings": torch.tensor([1.0, 0.5, 2.0]),
        },
        "lora_apply: seg_ranks.shape[0] must be 2 (one per segment: len(seg_slots))",
    ),
    (
        "apply_slices",
        expand.lora_apply,
        apply_args,
        {"slice_offsets": torch.tensor([0, 16, 32, 48], dtype=torch.int32)},
        "lora_apply: lora_a.shape[1] must be num_slices * max_rank",
    ),
]


@pytest.mark.parametrize(
    ("fn", "make_args", "change", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_wrapper_rejects_with_named_argument(
    fn: Callable[..., Any],
    make_args: Callable[[], dict[str, Any]],
    change: dict[str, Any],
    message: str,
) -> None:
    args = make_args()
    args.update(change)
    with pytest.raises(ValueError, match=None) as excinfo:
        fn(**args)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    ("fn", "make_args"),
    [
        (shrink.lora_shrink, shrink_args),
        (expand.lora_expand, expand_args),
        (moe.moe_lora_shrink, moe_shrink_args),
        (moe.moe_lora_expand, moe_expand_args),
        (expand.lora_apply, apply_args),
    ],
)
def test_valid_arguments_are_accepted(
    fn: Callable[..., Any], make_args: Callable[[], dict[str, Any]]
) -> None:
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make_args().items()}
    fn(**args)


def test_routing_built_for_other_weights_is_rejected() -> None:
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
    args = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moe_shrink_args().items()
    }
    routing = moe.moe_lora_routing(
        args["pair_expert"], args["pair_slot"], num_slots=SLOTS, num_experts=8
    )
    with pytest.raises(ValueError, match="routing was built for 3 slots x 8 experts"):
        moe.moe_lora_shrink(**args, routing=routing)


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (torch.zeros(SLOTS, dtype=torch.int64), "slot_ranks must have dtype in (torch.int32)"),
        (torch.zeros(SLOTS + 1, dtype=torch.int32), "slot_ranks.shape[0] must be 3"),
    ],
    ids=["dtype", "slots"],
)
def test_routing_rejects_bad_slot_ranks(ranks: torch.Tensor, message: str) -> None:
    args = moe_shrink_args()
    with pytest.raises(ValueError) as excinfo:
        moe.moe_lora_routing(args["pair_expert"], args["pair_slot"], SLOTS, 4, slot_ranks=ranks)
    assert message in str(excinfo.value) and "moe_lora_routing" in str(excinfo.value)


def test_routing_with_too_few_tile_rows_is_rejected() -> None:
    """The kernels load a tile's rows without a mask: a routing built by hand must hold
    block_s rows per tile."""
    import dataclasses

    args = moe_shrink_args()
    routing = moe.moe_lora_routing(args["pair_expert"], args["pair_slot"], SLOTS, 4)
    with pytest.raises(ValueError, match="tile_rows must have shape"):
        dataclasses.replace(routing, tile_rows=routing.tile_rows[:-1])
