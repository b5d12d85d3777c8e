"""The base routed experts' grouped GEMM (kernels/experts.py) against one matmul per expert."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import pytest
import torch

from loraplane.worker.kernels import experts

pytestmark = pytest.mark.kernels

ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def per_expert_reference(
    x: torch.Tensor, w: torch.Tensor, pair_expert: torch.Tensor, x_row_div: int
) -> torch.Tensor:
    """fp64: pair p times its expert's weight, one matmul per expert present."""
    rows = x.double()[torch.arange(pair_expert.shape[0], device=x.device) // x_row_div]
    out = torch.zeros(pair_expert.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e in pair_expert.unique().tolist():
        sel = pair_expert == e
        out[sel] = rows[sel] @ w[e].double().t()
    return out


def routed_case(
    tokens: int, topk: int, num_experts: int, n_out: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens * 31 + num_experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(num_experts, n_out, hidden, generator=gen) * hidden**-0.5
    # Distinct experts per token; with few tokens many experts get no pair at all.
    choice = [torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]
    pair_expert = torch.stack(choice).flatten().to(torch.int32)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), pair_expert.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "topk", "num_experts", "block_m"),
    [
        (5, 2, 8, None),  # decode: a pair or two per expert, experts left empty
        (40, 2, 4, 16),  # several tiles per expert
        (37, 3, 6, 32),  # ragged last tiles, block larger than most experts' pairs
        (1, 1, 3, None),  # one pair
    ],
)
def test_grouped_matmul_matches_one_matmul_per_expert(
    tokens: int, topk: int, num_experts: int, block_m: int | None, dtype: torch.dtype
) -> None:
    x, w, pair_expert = routed_case(tokens, topk, num_experts, n_out=72, hidden=40, dtype=dtype)
    routing = experts.moe_expert_routing(pair_expert, num_experts, block_m)
    out = experts.moe_grouped_matmul(x, w, routing, x_row_div=topk)
    want = per_expert_reference(x, w, pair_expert, topk)
    assert out.shape == (tokens * topk, 72) and out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_grouped_matmul_writes_into_out_and_reuses_routing() -> None:
    """gate_up then down over one routing, as Experts.forward does."""
    x, w_up, pair_expert = routed_case(9, 2, 5, n_out=48, hidden=32, dtype=torch.float32)
    w_down = torch.randn(5, 32, 48, device=DEVICE) * 48**-0.5
    routing = experts.moe_expert_routing(pair_expert, 5)
    up = experts.moe_grouped_matmul(x, w_up, routing, x_row_div=2)
    out = torch.full((18, 32), float("nan"), device=DEVICE)
    experts.moe_grouped_matmul(up, w_down, routing, out=out)
    want = per_expert_reference(
        per_expert_reference(x, w_up, pair_expert, 2), w_down.double(), pair_expert, 1
    )
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_block_m_follows_pairs_per_expert() -> None:
    assert experts.expert_block_m(512, 128) == 16  # decode: 4 pairs per expert
    assert experts.expert_block_m(2048, 128) == 16
    assert experts.expert_block_m(4096, 128) == 32
    assert experts.expert_block_m(16384, 128) == 64  # prefill: capped


def bad_call(**override: object) -> None:
    x, w, pair_expert = routed_case(4, 2, 3, n_out=16, hidden=16, dtype=torch.float32)
    args: dict[str, object] = {
        "x": x,
        "w": w,
        "routing": experts.moe_expert_routing(pair_expert, 3),
        "x_row_div": 2,
    }
    args.update(override)
    experts.moe_grouped_matmul(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"x": torch.zeros(4, 8)},
            "moe_grouped_matmul: w.shape[2] must be 8 (the hidden size of x)",
        ),
        ({"w": torch.zeros(3, 16, 16, dtype=torch.float16)}, "w must have dtype torch.float32"),
        ({"x_row_div": 1}, "x.shape[0] * x_row_div must equal the routed pairs, got 4 * 1 != 8"),
        ({"w": torch.zeros(2, 16, 16)}, "routing was built for 3 experts, w has 2"),
        ({"routing": None}, "routing must come from moe_expert_routing"),
        ({"out": torch.zeros(8, 15)}, "out.shape[1] must be 16 (w.shape[1])"),
    ],
    ids=["hidden", "dtype", "row-div", "experts", "routing", "out"],
)
def test_bad_arguments_name_the_field(override: dict[str, object], message: str) -> None:
    override = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in override.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        bad_call(**override)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "topk", "hidden"), [(5, 2, 40), (33, 8, 2100), (0, 8, 40)])
def test_combine_weights_each_tokens_pairs(
    dtype: torch.dtype, tokens: int, topk: int, hidden: int
) -> None:
    """``moe_combine``: each token's k pair rows (plus a LoRA delta) weighted by the router,
    in fp32, against fp64; each token's bits do not depend on the other tokens (ADR 0001)."""
    gen = torch.Generator().manual_seed(tokens + topk)
    d = torch.randn(tokens * topk, hidden, generator=gen).to(DEVICE, dtype)
    delta = torch.randn(tokens * topk, hidden, generator=gen).to(DEVICE, dtype) * 0.1
    w = torch.rand(tokens, topk, generator=gen).to(DEVICE, dtype)
    want = (
        ((d.double() + delta.double()).view(tokens, topk, hidden) * w.double()[..., None])
        .sum(1)
        .cpu()
    )
    got = experts.moe_combine(d, w, delta)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    tol = TOL[dtype] * 4
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    plain = experts.moe_combine(d, w)
    torch.testing.assert_close(
        plain.double().cpu(),
        (d.double().view(tokens, topk, hidden) * w.double()[..., None]).sum(1).cpu(),
        atol=tol,
        rtol=tol,
    )
    if tokens > 1:
        head = experts.moe_combine(d[:topk], w[:1], delta[:topk])
        assert torch.equal(head, got[:1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"d": torch.zeros(6, 8)}, "moe_combine: d must have one row per (token, k) pair"),
        ({"delta": torch.zeros(8, 7)}, "moe_combine: delta must have the shape of d"),
        ({"topk_weights": torch.zeros(4)}, "moe_combine: topk_weights must be a 2-D tensor"),
    ],
    ids=["pairs", "delta", "weights"],
)
def test_combine_names_a_bad_input(args: dict[str, torch.Tensor], message: str) -> None:
    call = {"d": torch.zeros(8, 8), "topk_weights": torch.zeros(4, 2), "delta": None, **args}
    call = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    with pytest.raises(ValueError) as excinfo:
        experts.moe_combine(**call)
    assert message in str(excinfo.value)


# --- the experts' LoRA inside the base kernels (moe_experts_lora) -------------------------


def lora_case(
    tokens: int,
    topk: int,
    num_experts: int,
    ranks: tuple[int, ...],
    dtype: torch.dtype,
    hidden: int = 48,
    inter: int = 40,
    rank: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, experts.ExpertLoRA]:
    """Random experts, routing and LoRA buffers as the runtime keeps them (zero past each
    slot's rank), tokens spread over the slots and over no adapter (-1)."""
    gen = torch.Generator().manual_seed(tokens * 7 + num_experts + len(ranks))
    e, s = num_experts, len(ranks)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    a_gate_up = torch.randn(s, e, 2 * rank, hidden, generator=gen) * hidden**-0.5
    b_gate_up = torch.randn(s, e, 2 * inter, rank, generator=gen) * 0.3
    a_down = torch.randn(s, e, rank, inter, generator=gen) * inter**-0.5
    b_down = torch.randn(s, e, hidden, rank, generator=gen) * 0.3
    for slot, r in enumerate(ranks):
        a_gate_up[slot, :, r:rank] = 0
        a_gate_up[slot, :, rank + r :] = 0
        b_gate_up[slot, ..., r:] = 0
        a_down[slot, :, r:] = 0
        b_down[slot, ..., r:] = 0
        if r == 0:  # a cleared slot adds nothing, whatever its buffers hold
            for buf in (a_gate_up, b_gate_up, a_down, b_down):
                buf[slot] = float("nan")
    choice = [torch.randperm(e, generator=gen)[:topk] for _ in range(tokens)]
    pair_expert = torch.stack(choice).flatten().to(torch.int32)
    token_slots = torch.randint(-1, s, (tokens,), generator=gen).to(torch.int32)
    scalings = torch.linspace(0.5, 2.0, s)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE)

    lora = experts.ExpertLoRA(
        *(dev(t) for t in (a_gate_up, b_gate_up, a_down, b_down)),
        token_slots=token_slots.to(DEVICE),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=DEVICE),
        slot_scalings=scalings.to(DEVICE),
        topk=topk,
    )
    return dev(x), dev(w_gate_up), dev(w_down), pair_expert.to(DEVICE), lora


@contextlib.contextmanager
def nan_allocations() -> Iterator[None]:
    """Inside, every float tensor from ``torch.empty`` or ``Tensor.new_empty`` starts as NaN:
    a row a kernel reads before writing it, or never writes, shows (instead of reused memory
    that may hold an earlier call's right answer)."""
    new_empty, empty = torch.Tensor.new_empty, torch.empty

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", lambda *a, **k: poisoned(new_empty(*a, **k)))
        mp.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
        yield


def experts_lora_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    pair_expert: torch.Tensor,
    lora: experts.ExpertLoRA,
) -> torch.Tensor:
    """fp64: one matmul per expert, the LoRA from the per-pair references around the SwiGLU."""
    from loraplane.worker.kernels import reference

    topk, inter, hidden = lora.topk, w_down.shape[2], w_down.shape[1]
    pair_slot = lora.token_slots.repeat_interleave(topk)
    pair_slot = torch.where(lora.slot_ranks[pair_slot.clamp(min=0).long()] > 0, pair_slot, -1)
    ranks, scalings = lora.slot_ranks, lora.slot_scalings.double()
    gu = per_expert_reference(x, w_gate_up, pair_expert, topk)
    y = reference.moe_lora_shrink(
        x.double(), lora.a_gate_up.double(), pair_expert, pair_slot, ranks, 2, topk
    )
    offsets = torch.tensor([0, inter, 2 * inter], dtype=torch.int32, device=x.device)
    reference.moe_lora_expand(
        y, lora.b_gate_up.double(), pair_expert, pair_slot, ranks, scalings, offsets, gu
    )
    gate, up = gu.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    y = reference.moe_lora_shrink(act, lora.a_down.double(), pair_expert, pair_slot, ranks, 1)
    d = per_expert_reference(act, w_down, pair_expert, 1)
    offsets = torch.tensor([0, hidden], dtype=torch.int32, device=x.device)
    reference.moe_lora_expand(
        y, lora.b_down.double(), pair_expert, pair_slot, ranks, scalings, offsets, d
    )
    return d  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "topk", "num_experts", "ranks", "block_m"),
    [
        (5, 2, 6, (16, 8, 0), None),  # decode; a slot of rank 0 adds nothing
        (40, 2, 4, (16, 4, 12), 16),  # several slots in one expert tile, several tiles
        (37, 3, 6, (8,), 32),  # one adapter, ragged tiles
        (1, 1, 3, (16,), None),
    ],
)
def test_experts_lora_matches_the_references(
    dtype: torch.dtype,
    tokens: int,
    topk: int,
    num_experts: int,
    ranks: tuple[int, ...],
    block_m: int | None,
) -> None:
    """Each pair's expert output with its token's LoRA (gate_up's in the GEMM and the
    SwiGLU, down's in the SwiGLU and the down GEMM), against fp64 references; pairs with
    no adapter (or a slot of rank 0, whose buffers hold NaN) equal the base kernels' bits.
    Every buffer the kernels allocate starts as NaN: a row read before it is written shows."""
    x, w_gate_up, w_down, pair_expert, lora = lora_case(tokens, topk, num_experts, ranks, dtype)
    routing = experts.moe_expert_routing(pair_expert, num_experts, block_m)
    with nan_allocations():
        d, delta = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, lora)
    want = experts_lora_reference(x, w_gate_up, w_down, pair_expert, lora)
    for out in (d, delta):
        assert out.shape == (tokens * topk, w_down.shape[1]) and out.dtype == dtype
    # y, act and delta are rounded to the dtype on the way (as the separate kernels round them)
    tol = TOL[dtype] * (4 if dtype == torch.float32 else 8)
    got = d.double() + delta.double()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    combined = experts.moe_combine(d, torch.ones(tokens, topk, dtype=dtype, device=DEVICE), delta)
    torch.testing.assert_close(
        combined.double(), want.view(tokens, topk, -1).sum(1), atol=2 * tol, rtol=tol
    )

    from loraplane.worker.kernels import swiglu

    gu = experts.moe_grouped_matmul(x, w_gate_up, routing, x_row_div=topk)
    base = experts.moe_grouped_matmul(swiglu.silu_and_mul(gu), w_down, routing)
    slots = lora.token_slots.repeat_interleave(topk).long()
    without = (slots < 0) | (lora.slot_ranks[slots.clamp(min=0)] == 0)
    assert torch.equal(d[without], base[without]) and not delta[without].any()
    if (~without).any():  # the LoRA matters where there is one
        assert (got[~without] - base[~without]).abs().max() > 10 * tol
        assert delta[~without].abs().max() > 10 * tol


def test_experts_lora_expand_spans_several_program_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Down's LoRA expand split over program columns (two blocks of N each, the last one
    past the hidden size) gives the one-column result bit for bit, and the references'."""
    x, w_gate_up, w_down, pair_expert, lora = lora_case(
        9, 2, 4, (16, 8), torch.float32, hidden=160, inter=40
    )
    routing = experts.moe_expert_routing(pair_expert, 4)
    one = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, lora)
    monkeypatch.setattr(experts, "EXPAND_CHUNKS", 2)  # 3 blocks of 64: 2 columns
    two = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, lora)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    want = experts_lora_reference(x, w_gate_up, w_down, pair_expert, lora)
    tol = TOL[torch.float32] * 4
    torch.testing.assert_close(two[0].double() + two[1].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("split", [2, 4])
def test_experts_lora_tiles_share_their_shrink(monkeypatch: pytest.MonkeyPatch, split: int) -> None:
    """With many adapters in a batch, several programs share each expert tile's gate_up
    shrink, a pass over K per distinct slot each in turn (some find no slot left): the same
    bits as one program doing them all, and the references' result."""
    import dataclasses

    x, w_gate_up, w_down, pair_expert, lora = lora_case(
        40, 2, 4, (16, 4, 12, 8, 16), torch.float32, hidden=160, inter=40
    )
    routing = experts.moe_expert_routing(pair_expert, 4, 16)  # ~5 slots in a tile of 16
    assert experts.shrink_split(lora.adapters) == 1
    one = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, lora)
    monkeypatch.setattr(experts, "SHRINK_SPLIT", split)
    many = dataclasses.replace(lora, adapters=experts.SHRINK_SPLIT_FROM)
    assert experts.shrink_split(many.adapters) == split
    with nan_allocations():  # a pass no program made shows, not the first call's memory
        shared = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, many)
    assert all(torch.equal(a, b) for a, b in zip(one, shared, strict=True))
    want = experts_lora_reference(x, w_gate_up, w_down, pair_expert, lora)
    tol = TOL[torch.float32] * 4
    torch.testing.assert_close(shared[0].double() + shared[1].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("adapters", 0, "lora.adapters must be an int >= 1, got 0"),
        ("b_down", torch.zeros(2, 3, 16, 8), "lora.b_down must have shape (2, 3, 16, 16)"),
        ("slot_ranks", torch.zeros(2), "lora.slot_ranks must have dtype in (torch.int32)"),
        ("slot_scalings", torch.zeros(3), "lora.slot_scalings.shape[0] must be 2 (one per slot)"),
        ("token_slots", torch.zeros(5, dtype=torch.int32), "lora.token_slots.shape[0] must be 4"),
        ("topk", 0, "lora.topk must be an int >= 1, got 0"),
        ("topk", 3, "x.shape[0] * lora.topk must equal the routed pairs, got 4 * 3 != 8"),
        ("a_down", torch.zeros(2, 3, 0, 16), "lora.a_down must have a max rank (dim 2) >= 1"),
    ],
    ids=[
        "adapters",
        "b-shape",
        "ranks-dtype",
        "scalings-size",
        "slots-size",
        "topk",
        "topk-pairs",
        "rank-0",
    ],
)
def test_experts_lora_names_a_bad_operand(field: str, value: object, message: str) -> None:
    import dataclasses

    x, w_gate_up, w_down, pair_expert, lora = lora_case(
        4, 2, 3, (16, 8), torch.float32, hidden=16, inter=16
    )
    routing = experts.moe_expert_routing(pair_expert, 3)
    if isinstance(value, torch.Tensor):
        value = value.to(DEVICE)
    bad = dataclasses.replace(lora, **{field: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, bad)
