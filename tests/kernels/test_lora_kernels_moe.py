"""MoE LoRA: weights chosen per (token, k) pair by (slot, expert); Triton vs reference vs dense."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from loraplane.worker.kernels import moe, reference

pytestmark = pytest.mark.kernels

ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class MoeCase:
    x: torch.Tensor  # [P // topk, K]
    topk: int
    lora_a: torch.Tensor  # [num_slots, E, num_slices * R, K], NaN beyond each rank
    lora_b: torch.Tensor  # [num_slots, E, N_total, R], NaN beyond each rank
    pair_expert: torch.Tensor  # int32 [P]
    pair_slot: torch.Tensor  # int32 [P], -1 = no adapter
    slot_ranks: torch.Tensor  # int32 [num_slots]
    slot_scalings: torch.Tensor  # float32 [num_slots]
    slice_offsets: torch.Tensor  # int32 [num_slices + 1]

    @property
    def num_slices(self) -> int:
        return self.slice_offsets.shape[0] - 1


def make_moe_case(
    *,
    token_slots: list[int],
    topk: int,
    slot_ranks: list[int],
    num_experts: int = 4,
    max_rank: int = 16,
    hidden: int = 24,
    offsets: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> MoeCase:
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets or [0, 20, 40]  # gate_up of an intermediate size 20
    num_slices, num_slots, n_total = len(offsets) - 1, len(slot_ranks), offsets[-1]
    tokens = len(token_slots)
    x = torch.randn(tokens, hidden, generator=gen)
    # Each token's k experts are distinct; pairs of one token share that token's adapter.
    experts = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]
        or [torch.zeros(0, topk, dtype=torch.int64)]
    )
    pair_expert = experts.flatten().to(torch.int32)  # [P], pair p = token * topk + k
    pair_slot = torch.tensor(token_slots, dtype=torch.int32).repeat_interleave(topk)  # [P]

    lora_a = torch.randn(num_slots, num_experts, num_slices, max_rank, hidden, generator=gen) * 0.3
    lora_b = torch.randn(num_slots, num_experts, n_total, max_rank, generator=gen) * 0.3
    for slot, rank in enumerate(slot_ranks):
        lora_a[slot, :, :, rank:] = float("nan")
        lora_b[slot, :, :, rank:] = float("nan")
    scalings = torch.tensor([0.5 + 1.25 * slot for slot in range(num_slots)], dtype=torch.float32)
    return MoeCase(
        x=x.to(dtype).to(DEVICE),
        topk=topk,
        lora_a=lora_a.reshape(num_slots, num_experts, num_slices * max_rank, hidden)
        .to(dtype)
        .to(DEVICE),
        lora_b=lora_b.to(dtype).to(DEVICE),
        pair_expert=pair_expert.to(DEVICE),
        pair_slot=pair_slot.to(DEVICE),
        slot_ranks=torch.tensor(slot_ranks, dtype=torch.int32).to(DEVICE),
        slot_scalings=scalings.to(DEVICE),
        slice_offsets=torch.tensor(offsets, dtype=torch.int32).to(DEVICE),
    )


def dense_moe_delta(case: MoeCase) -> torch.Tensor:
    """Independent float64 delta per pair with that pair's own (slot, expert) weights."""
    num_slots, num_experts, _, hidden = case.lora_a.shape
    max_rank = case.lora_b.shape[3]
    keep = (
        torch.arange(max_rank)[None, :] < case.slot_ranks.cpu().to(torch.int64)[:, None]
    )  # [slots, R]
    zero = torch.zeros((), dtype=torch.float64)
    a = case.lora_a.cpu().double().view(num_slots, num_experts, case.num_slices, max_rank, hidden)
    a = torch.where(keep[:, None, None, :, None], a, zero)
    b = torch.where(keep[:, None, None, :], case.lora_b.cpu().double(), zero)
    slot = case.pair_slot.cpu().to(torch.int64)
    expert = case.pair_expert.cpu().to(torch.int64)
    w = slot.clamp(min=0)
    x_pairs = case.x.cpu().double().repeat_interleave(case.topk, dim=0)  # [P, K]
    h = torch.einsum("pc,pirc->pir", x_pairs, a[w, expert])  # [P, slices, R]
    offsets = case.slice_offsets.tolist()
    delta = torch.zeros(slot.shape[0], offsets[-1], dtype=torch.float64)
    b_pairs = b[w, expert]  # [P, N, R]
    for i in range(case.num_slices):
        lo, hi = offsets[i], offsets[i + 1]
        delta[:, lo:hi] = torch.einsum("pr,pnr->pn", h[:, i], b_pairs[:, lo:hi])
    delta *= case.slot_scalings.cpu().double()[w][:, None]
    delta[slot < 0] = 0.0
    return delta


def run_pipeline(
    impl: object, case: MoeCase, out: torch.Tensor, routing: object | None = None
) -> torch.Tensor:
    y = impl.moe_lora_shrink(  # type: ignore[attr-defined]
        case.x,
        case.lora_a,
        case.pair_expert,
        case.pair_slot,
        case.slot_ranks,
        case.num_slices,
        topk=case.topk,
        routing=routing,
    )
    impl.moe_lora_expand(  # type: ignore[attr-defined]
        y,
        case.lora_b,
        case.pair_expert,
        case.pair_slot,
        case.slot_ranks,
        case.slot_scalings,
        case.slice_offsets,
        out,
        routing=routing,
    )
    return y  # type: ignore[no-any-return]


# Tokens on slots 0..2 and on no adapter (-1); slot 2 has the max rank, slot 3 is empty (0).
TOKEN_SLOTS = [0, -1, 2, 1, 0, 3, -1, 2, 1, 1, 0]
SLOT_RANKS = [4, 8, 16, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("topk", "offsets"), [(2, [0, 20, 40]), (1, [0, 24])], ids=["gate_up_top2", "down_top1"]
)
def test_moe_matches_reference_and_dense(dtype: torch.dtype, topk: int, offsets: list[int]) -> None:
    case = make_moe_case(
        token_slots=TOKEN_SLOTS, topk=topk, slot_ranks=SLOT_RANKS, offsets=offsets, dtype=dtype
    )
    tol = TOL[dtype]
    num_pairs = case.pair_expert.shape[0]
    out0 = (
        torch.randn(num_pairs, offsets[-1], generator=torch.Generator().manual_seed(3))
        .to(dtype)
        .to(DEVICE)
    )

    out_ref, out_tri = out0.clone(), out0.clone()
    y_ref = run_pipeline(reference, case, out_ref)
    routing = moe.moe_lora_routing(
        case.pair_expert, case.pair_slot, len(SLOT_RANKS), case.lora_a.shape[1]
    )
    y_tri = run_pipeline(moe, case, out_tri, routing=routing)
    torch.testing.assert_close(y_tri, y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out_tri, out_ref, atol=tol, rtol=tol)

    dense_tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        out_ref.cpu().double() - out0.cpu().double(),
        dense_moe_delta(case),
        atol=dense_tol,
        rtol=dense_tol,
    )

    no_adapter = (case.pair_slot < 0).nonzero().flatten()
    assert no_adapter.numel() > 0
    assert torch.equal(out_tri[no_adapter], out0[no_adapter])
    assert not y_tri[no_adapter].any()
    assert torch.isfinite(out_tri).all()


def test_moe_each_pair_uses_its_own_slot_and_expert() -> None:
    """Garbage in every (slot, expert) weight no pair routes to changes nothing; and the dense
    check fails if pairs are given one another's experts."""
    case = make_moe_case(token_slots=[0, 1, 2, 1, 0], topk=2, slot_ranks=[4, 8, 16], num_experts=6)
    num_pairs = case.pair_expert.shape[0]
    out0 = torch.zeros(num_pairs, 40, device=DEVICE)
    clean = out0.clone()
    run_pipeline(moe, case, clean)
    torch.testing.assert_close(clean.cpu().double(), dense_moe_delta(case), atol=1e-4, rtol=1e-4)

    used = set(zip(case.pair_slot.tolist(), case.pair_expert.tolist(), strict=True))
    dirty_case = MoeCase(**case.__dict__)
    dirty_case.lora_a, dirty_case.lora_b = case.lora_a.clone(), case.lora_b.clone()
    for slot in range(3):
        for expert in range(6):
            if (slot, expert) not in used:
                dirty_case.lora_a[slot, expert] = float("nan")
                dirty_case.lora_b[slot, expert] = float("nan")
    dirty = out0.clone()
    run_pipeline(moe, dirty_case, dirty)
    assert torch.equal(dirty, clean)

    shifted = MoeCase(**case.__dict__)
    shifted.pair_expert = torch.roll(case.pair_expert, 1)
    wrong = out0.clone()
    run_pipeline(moe, shifted, wrong)
    assert not torch.allclose(wrong.cpu().double(), dense_moe_delta(case), atol=1e-3, rtol=1e-3)


def test_moe_routing_groups_pairs_by_slot_then_expert() -> None:
    pair_expert = torch.tensor([1, 0, 1, 2, 0, 1], dtype=torch.int32, device=DEVICE)
    pair_slot = torch.tensor([1, -1, 0, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    routing = moe.moe_lora_routing(pair_expert, pair_slot, num_slots=2, num_experts=3)
    # keys (slot * 3 + expert): p0 4, p1 none, p2 1, p3 5, p4 0, p5 4
    assert routing.seg_indptr.tolist() == [0, 1, 2, 2, 2, 4, 5]
    order = routing.row_order.tolist()
    assert [order[0:1], order[1:2], sorted(order[2:4]), order[4:5], order[5:]] == [
        [4],
        [2],
        [0, 5],
        [3],
        [1],
    ]
    valid = routing.tile_seg >= 0
    assert sorted(routing.tile_seg[valid].tolist()) == [0, 1, 4, 5]
    assert routing.tile_blk[valid].tolist() == [0, 0, 0, 0]


def test_moe_routing_tiles_cover_long_groups() -> None:
    """A group of 40 pairs (3 tiles of 16) next to single pairs; padding tiles are -1."""
    pair_expert = torch.tensor([2] * 40 + [0, 1], dtype=torch.int32, device=DEVICE)
    pair_slot = torch.tensor([1] * 40 + [0, -1], dtype=torch.int32, device=DEVICE)
    routing = moe.moe_lora_routing(pair_expert, pair_slot, num_slots=2, num_experts=3)
    tiles = sorted(
        zip(routing.tile_seg.tolist(), routing.tile_blk.tolist(), strict=True), reverse=True
    )
    real = [t for t in tiles if t[0] >= 0]
    assert real == [(5, 2), (5, 1), (5, 0), (0, 0)]
    assert len(tiles) == 3 + 6  # bound: ceil(P / 16) + min(G, P) with P = 42, G = 6
    assert sorted(routing.row_order.tolist()[1:41]) == list(range(40))


def test_moe_routing_tiles_list_their_pairs_and_ranks() -> None:
    """Each tile names its pairs (what its program reads in place of segment bounds and the
    sorted order) and, given the slot ranks, its slot's rank."""
    pair_expert = torch.tensor([2] * 40 + [0, 1, 2], dtype=torch.int32, device=DEVICE)
    pair_slot = torch.tensor([1] * 40 + [0, -1, 0], dtype=torch.int32, device=DEVICE)
    ranks = torch.tensor([4, 12], dtype=torch.int32, device=DEVICE)
    routing = moe.moe_lora_routing(pair_expert, pair_slot, 2, 3, slot_ranks=ranks)
    assert routing.tile_rank is not None and routing.ranks_of is ranks
    seen: dict[int, list[int]] = {}
    for t, key in enumerate(routing.tile_seg.tolist()):
        if key < 0:
            continue
        n = int(routing.tile_len[t])
        assert 1 <= n <= 16
        pairs = routing.tile_rows[t * 16 : t * 16 + n].tolist()
        assert all(int(pair_slot[p]) * 3 + int(pair_expert[p]) == key for p in pairs)
        assert int(routing.tile_rank[t]) == int(ranks[key // 3])
        seen.setdefault(key, []).extend(pairs)
    assert {k: sorted(v) for k, v in seen.items()} == {0: [40], 2: [42], 5: list(range(40))}
    # Without the ranks the tiles carry none, and the kernels read slot_ranks themselves.
    plain = moe.moe_lora_routing(pair_expert, pair_slot, 2, 3)
    assert plain.tile_rank is None and plain.tile_map(ranks).ranks is None


def test_moe_kernels_read_the_ranks_they_are_given() -> None:
    """A routing whose tiles carry other ranks than the kernels' slot_ranks is not trusted:
    the kernels read the ranks passed to them (weights past each rank are NaN here)."""
    case = make_moe_case(token_slots=TOKEN_SLOTS, topk=2, slot_ranks=SLOT_RANKS)
    num_pairs = case.pair_expert.shape[0]
    out_ref = torch.zeros(num_pairs, 40, device=DEVICE)
    run_pipeline(reference, case, out_ref)
    full = torch.full_like(case.slot_ranks, 16)
    for ranks_of in (case.slot_ranks, full):
        routing = moe.moe_lora_routing(
            case.pair_expert, case.pair_slot, len(SLOT_RANKS), 4, slot_ranks=ranks_of
        )
        out = torch.zeros_like(out_ref)
        run_pipeline(moe, case, out, routing=routing)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)


def test_moe_all_pairs_without_adapter_and_no_pairs() -> None:
    for token_slots in ([-1, -1, -1], []):
        case = make_moe_case(token_slots=token_slots, topk=2, slot_ranks=[4, 8])
        out0 = torch.randn(len(token_slots) * 2, 40).to(DEVICE)
        out = out0.clone()
        y = run_pipeline(moe, case, out)
        assert torch.equal(out, out0) and not y.any()


def _tiles(routing: moe.MoeLoraRouting) -> dict[int, list[int]]:
    """Each key's pairs over the routing's tiles (the order within a key is unspecified)."""
    seen: dict[int, list[int]] = {}
    for t, key in enumerate(routing.tile_seg.tolist()):
        if key >= 0:
            n = int(routing.tile_len[t])
            seen.setdefault(key, []).extend(routing.tile_rows[t * 16 : t * 16 + n].tolist())
    return {key: sorted(pairs) for key, pairs in seen.items()}


def test_moe_routing_reads_each_tokens_slot_in_place() -> None:
    """``slot_div=topk`` routes pair p with the slot of token p // topk: the same groups as a
    per-pair copy of the slots, without making that copy; ``pair_slot=None`` is slot 0 for
    every pair (the base experts' grouping)."""
    case = make_moe_case(token_slots=TOKEN_SLOTS, topk=2, slot_ranks=SLOT_RANKS)
    token_slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32, device=DEVICE)
    per_pair = moe.moe_lora_routing(case.pair_expert, case.pair_slot, 4, 4)
    per_token = moe.moe_lora_routing(case.pair_expert, token_slots, 4, 4, slot_div=2)
    assert torch.equal(per_token.seg_indptr, per_pair.seg_indptr)
    assert _tiles(per_token) == _tiles(per_pair) and len(_tiles(per_pair)) > 3

    base = moe.moe_lora_routing(case.pair_expert, None, 1, 4)
    zeros = moe.moe_lora_routing(case.pair_expert, torch.zeros_like(case.pair_expert), 1, 4)
    assert _tiles(base) == _tiles(zeros)
    assert sum(len(p) for p in _tiles(base).values()) == case.pair_expert.shape[0]


@pytest.mark.parametrize(
    ("pair_slot", "num_slots", "slot_div", "message"),
    [
        (torch.zeros(5, dtype=torch.int32), 2, 2, "pair_slot.shape[0] * slot_div must equal"),
        (torch.zeros(6, dtype=torch.int32), 2, 0, "slot_div must be an int >= 1, got 0"),
        (None, 2, 1, "pair_slot=None puts every pair in slot 0, so num_slots must be 1"),
    ],
    ids=["length", "slot_div", "none_with_slots"],
)
def test_moe_routing_rejects_slots_that_do_not_match_the_pairs(
    pair_slot: torch.Tensor | None, num_slots: int, slot_div: int, message: str
) -> None:
    pair_expert = torch.zeros(12, dtype=torch.int32, device=DEVICE)
    slots = pair_slot.to(DEVICE) if pair_slot is not None else None
    with pytest.raises(ValueError, match="moe_lora_routing") as excinfo:
        moe.moe_lora_routing(pair_expert, slots, num_slots, 3, slot_div=slot_div)
    assert message in str(excinfo.value)


@pytest.mark.parametrize("topk", [2, 1], ids=["gate_up_top2", "down_top1"])
def test_runtime_moe_kernels_match_the_checked_ones(topk: int) -> None:
    """The runtime's shrink leaves the rows of pairs with no adapter unwritten (no fill) and
    its expand never reads them: the output is the checked kernels' to the bit."""
    case = make_moe_case(token_slots=TOKEN_SLOTS, topk=topk, slot_ranks=SLOT_RANKS)
    token_slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32, device=DEVICE)
    routing = moe.moe_lora_routing(
        case.pair_expert, token_slots, 4, 4, slot_ranks=case.slot_ranks, slot_div=topk
    )
    num_pairs = case.pair_expert.shape[0]
    out0 = torch.randn(num_pairs, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    checked = out0.clone()
    y_checked = run_pipeline(moe, case, checked, routing=routing)

    runtime = out0.clone()
    y = moe.runtime_moe_shrink(case.x, case.lora_a, case.slot_ranks, 2, topk, routing)
    routed = (case.pair_slot >= 0) & (case.slot_ranks[case.pair_slot.clamp(min=0).long()] > 0)
    assert torch.equal(y[routed], y_checked[routed])
    assert not y_checked[~routed].any() and (~routed).any()
    y[~routed] = float("nan")  # what an unwritten row may hold: the expand must not read it
    moe.runtime_moe_expand(
        y, case.lora_b, case.slot_ranks, case.slot_scalings, case.slice_offsets, runtime, routing
    )
    assert torch.equal(runtime, checked)
