"""The base routed experts' grouped GEMM (kernels/experts.py) against one matmul per expert."""

from __future__ import annotations

import os
import re

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
