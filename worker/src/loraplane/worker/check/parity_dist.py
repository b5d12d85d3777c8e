"""`check parity --tp N --dp N`: the same mixed batch over several ranks started here.

Prompts go to DP groups so that every group sees a different set of adapters (group g
gets the adapters a with a % dp != g, plus base rows), which makes the MLP/MoE of every
shard apply adapters that only another group's tokens use. `--idle-rank G` gives DP group
G no prompts at all: it still joins every prefill and decode collective.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.check.parity import (
    OurRun,
    ParityReport,
    compare_with_references,
    lora_config_for,
    make_prompts,
    run_ours,
    run_single,
)
from loraplane.worker.config import ModelConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.parallel.launch import spawn_ranks
from loraplane.worker.parallel.state import ParallelConfig, ParallelState


def plan_groups(
    prompts: int, n_adapters: int, dp: int, idle: int | None
) -> tuple[list[int], list[int | None]]:
    """(DP group, adapter index or None) of every prompt."""
    active = [g for g in range(dp) if g != idle] or [0]
    groups, assignment = [], []
    per_group_count = dict.fromkeys(active, 0)
    for i in range(prompts):
        g = active[i % len(active)]
        own = [a for a in range(n_adapters) if dp == 1 or a % dp != g] or list(range(n_adapters))
        choices: list[int | None] = [None, *own]  # base rows first, then the group's own adapters
        assignment.append(choices[per_group_count[g] % len(choices)])
        per_group_count[g] += 1
        groups.append(g)
    return groups, assignment


def _rank_main(
    rank: int,
    ps: ParallelState,
    device: torch.device,
    model_dir: str,
    adapters: list[tuple[str, str]],
    prompt_ids: list[list[int]],
    groups: list[int],
    slots: list[int],
    max_new_tokens: int,
    backend: str,
    dtype: str,
    out_path: str,
) -> None:
    mine = [i for i, g in enumerate(groups) if g == ps.dp_rank]
    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + 1
    rcfg = RunnerConfig(
        model_dir,
        device=str(device),
        dtype=dtype,
        max_seqs=max(1, len(prompt_ids)),
        max_len=max_len,
        lora_backend=backend,
    )
    runner = ModelRunner(rcfg, lora_config_for(adapters), ps)
    # Every rank holds the union of adapters the global batch needs, in the same slots.
    for slot, (name, path) in enumerate(adapters):
        runner.lora.load_slot(slot, runner.read_adapter(name, path))  # type: ignore[union-attr]
    lora_run = run_ours(
        runner, [prompt_ids[i] for i in mine], [slots[i] for i in mine], max_new_tokens
    )
    del runner
    plain = ModelRunner(rcfg, None, ps)
    base_run = run_ours(
        plain,
        [prompt_ids[i] for i in mine],
        [NO_ADAPTER] * len(mine),
        max_new_tokens,
        forced=lora_run.generated,
    )

    def to_cpu(r: OurRun) -> OurRun:
        return OurRun(r.sequences, r.generated, [t.cpu() for t in r.logprobs])

    gathered = ps.all_gather_object_tp((mine, to_cpu(lora_run), to_cpu(base_run)))
    if rank == 0:
        torch.save(gathered, out_path)


def _assemble(parts: list[Any], n: int, leaders: Sequence[int]) -> tuple[OurRun, OurRun]:
    runs: list[list[Any]] = [[None] * n, [None] * n, [None] * n]
    lora_logp: list[Any] = [None] * n
    base_logp: list[Any] = [None] * n
    for r in leaders:
        idxs, lora_run, base_run = parts[r]
        for j, i in enumerate(idxs):
            runs[0][i] = lora_run.sequences[j]
            runs[1][i] = lora_run.generated[j]
            lora_logp[i] = lora_run.logprobs[j]
            base_logp[i] = base_run.logprobs[j]
            runs[2][i] = base_run.generated[j]
    return OurRun(runs[0], runs[1], lora_logp), OurRun(runs[0], runs[2], base_logp)


def check_parity_dist(
    model_dir: str | Path,
    adapters: Sequence[tuple[str, str | Path]],
    *,
    prompts: int = 12,
    max_new_tokens: int = 6,
    backend: str = "triton",
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    tp: int = 2,
    dp: int = 1,
    dp_attention: bool = False,
    idle_rank: int | None = None,
) -> ParityReport:
    pconf = ParallelConfig(
        tp=tp, dp=dp, dp_attention=dp_attention
    )  # checked before any process starts
    if idle_rank is not None and not 0 <= idle_rank < dp:
        raise ValueError(f"--idle-rank {idle_rank} is not a DP group of dp={dp}")
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    dtype_name = dtype or config.torch_dtype
    adapters = [(n, str(p)) for n, p in adapters]
    lora_config_for(adapters)  # rejects bad adapter configs before any rank starts
    prompt_ids = make_prompts(config.vocab_size, prompts, seed)
    groups, assignment = plan_groups(prompts, len(adapters), dp, idle_rank)
    slots = [a if a is not None else NO_ADAPTER for a in assignment]
    with tempfile.TemporaryDirectory(prefix="loraplane-parity-") as tmp:
        out = str(Path(tmp) / "ranks.pt")
        spawn_ranks(
            _rank_main,
            pconf,
            device,
            str(model_dir),
            adapters,
            prompt_ids,
            groups,
            slots,
            max_new_tokens,
            backend,
            dtype_name,
            out,
        )
        parts = torch.load(out, weights_only=False)
    leaders = [g * pconf.attn_tp for g in range(dp)]
    lora_run, base_run = _assemble(parts, prompts, leaders)
    single_lora, _ = run_single(
        model_dir,
        adapters,
        prompt_ids,
        slots,
        max_new_tokens,
        backend=backend,
        device=device,
        dtype=dtype_name,
    )
    # Compare positions whose context is the same in both runs: in bf16 a greedy choice can
    # flip between the two, after which the sequences (and their logprobs) differ by design.
    vs_single = 0.0
    bitwise_single = True
    for seq_a, seq_b, lp_a, lp_b in zip(
        lora_run.sequences,
        single_lora.sequences,
        lora_run.logprobs,
        single_lora.logprobs,
        strict=True,
    ):
        same = next(
            (k for k, (x, y) in enumerate(zip(seq_a, seq_b, strict=True)) if x != y), len(seq_a)
        )
        a, b = lp_a[:same].cpu(), lp_b[:same].cpu()
        vs_single = max(vs_single, float((a - b).abs().max()) if same else 0.0)
        bitwise_single &= bool(torch.equal(a, b)) and same == len(seq_a)
    report = compare_with_references(
        model_dir,
        adapters,
        prompt_ids,
        assignment,
        lora_run,
        base_run,
        backend=backend,
        dtype=dtype_name,
        reference_device=device,
    )
    adapters_per_group = {
        g: sorted(
            {
                adapters[a][0] if a is not None else "<base>"
                for a, gg in zip(assignment, groups, strict=True)
                if gg == g
            }
        )
        for g in range(dp)
    }
    report.extra.update(
        tp=tp,
        dp=dp,
        dp_attention=dp_attention,
        idle_rank=idle_rank,
        vs_single_rank_max_abs_logprob_diff=vs_single,
        vs_single_rank_bitwise_equal=bitwise_single,
        adapters_per_dp_group=adapters_per_group,
    )
    return report
