"""Issue 3 acceptance: DP-attention multi-LoRA over real ranks (gloo, one process per rank).

Every DP group gets a different set of adapters, so the gathered MLP/MoE of every shard
must apply adapters that only another group's tokens use. Compared with HF + PEFT and with
the same batch on one rank.
"""

from __future__ import annotations

import pytest
from tests.unit.runtime.test_parity import assert_parity

from loraplane.worker.check.parity_dist import check_parity_dist, plan_groups
from loraplane.worker.config import ConfigError

pytestmark = pytest.mark.multirank

LAYOUTS = [
    # (tp, dp, dp_attention)
    (2, 2, True),
    (4, 2, True),  # attn-TP 2
    (4, 4, True),
    (2, 1, False),  # plain TP
    (2, 1, True),  # --dp-attention with one group: plain TP, nothing gathered
]


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
@pytest.mark.parametrize(
    ("tp", "dp", "dp_attention"),
    LAYOUTS,
    ids=[f"tp{t}-dp{d}" + ("-dpattn" if a and d == 1 else "") for t, d, a in LAYOUTS],
)
def test_layout_matches_peft_and_single_rank(
    suite, arch: str, tp: int, dp: int, dp_attention: bool
) -> None:
    model_dir, adapters = suite[arch]
    report = check_parity_dist(
        model_dir,
        adapters,
        prompts=max(8, 4 * dp),  # every group gets base rows and each of its own adapters
        max_new_tokens=4,
        backend="torch",
        tp=tp,
        dp=dp,
        dp_attention=dp_attention,
    )
    assert_parity(report)
    assert report.extra["vs_single_rank_max_abs_logprob_diff"] <= 1e-5, report.extra
    if dp > 1:
        sets = [frozenset(s) for s in report.extra["adapters_per_dp_group"].values()]
        assert len(set(sets)) == dp, "every DP group must see a different set of adapters"


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_idle_dp_group_changes_nothing(suite, arch: str) -> None:
    """DP group 1 has no requests for the whole run (prefill and every decode step): it joins
    every collective, raises nothing, and the other group's adapters still apply on its shard."""
    model_dir, adapters = suite[arch]
    report = check_parity_dist(
        model_dir,
        adapters,
        prompts=6,
        max_new_tokens=4,
        backend="torch",
        tp=2,
        dp=2,
        dp_attention=True,
        idle_rank=1,
    )
    assert report.extra["adapters_per_dp_group"][1] == []
    assert_parity(report)
    assert report.extra["vs_single_rank_max_abs_logprob_diff"] <= 1e-5


def test_groups_see_different_adapter_sets() -> None:
    groups, assignment = plan_groups(12, 4, 2, None)
    g0 = {a for a, g in zip(assignment, groups, strict=True) if g == 0}
    g1 = {a for a, g in zip(assignment, groups, strict=True) if g == 1}
    assert g0 == {1, 3, None} and g1 == {0, 2, None}
    groups, assignment = plan_groups(16, 4, 4, None)
    sets = [
        frozenset(a for a, g in zip(assignment, groups, strict=True) if g == k) for k in range(4)
    ]
    assert len(set(sets)) == 4 and all(None in s for s in sets)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3, "dp": 2, "dp_attention": True}, "tp (3) must be divisible by dp (2)"),
        ({"tp": 2, "dp": 2, "dp_attention": False}, "needs --dp-attention"),
        ({"tp": 2, "dp": 2, "dp_attention": True, "idle_rank": 5}, "--idle-rank 5"),
    ],
)
def test_bad_layouts_fail_before_any_rank_starts(suite, kwargs: dict, message: str) -> None:
    model_dir, adapters = suite["llama"]
    with pytest.raises(
        (ConfigError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        check_parity_dist(
            model_dir, adapters, prompts=4, max_new_tokens=2, backend="torch", **kwargs
        )


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (2, 2)], ids=["tp2", "tp2-dp2"])
def test_moe_lora_inside_the_experts_kernels_over_ranks(
    suite, monkeypatch, tp: int, dp: int
) -> None:  # type: ignore[no-untyped-def]
    """The experts' LoRA inside the base kernels (the CUDA path, here through Triton's
    interpreter) with the intermediate size split over ranks: down's shrink is a partial
    sum over the ranks' columns, reduced with the base output. The ranks take the path
    through the environment; the single-rank run they are compared with (in this process)
    takes it too, and is counted."""
    from loraplane.worker.kernels import experts
    from loraplane.worker.models.model import Experts

    calls: list[int] = []
    fused = experts.moe_experts_lora

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setenv("LORAPLANE_CPU_DEVICE_KERNELS", "1")
    monkeypatch.setattr(Experts, "device_kernels", True)
    monkeypatch.setattr(experts, "moe_experts_lora", counted)
    model_dir, adapters = suite["qwen3-moe"]
    report = check_parity_dist(
        model_dir,
        adapters,
        prompts=max(8, 4 * dp),
        max_new_tokens=4,
        backend="triton",
        tp=tp,
        dp=dp,
        dp_attention=dp > 1,
    )
    assert calls, "the single-rank run never took the fused experts' path"
    assert_parity(report)
    assert report.extra["vs_single_rank_max_abs_logprob_diff"] <= 1e-5, report.extra
