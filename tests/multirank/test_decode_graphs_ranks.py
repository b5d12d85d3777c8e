"""Per-rank decode graphs (engine/graphs.py, ADR 0018) over real ranks (gloo, one process each).

Graph capture needs a GPU; here every rank runs the same static-buffer steps without capture
(``DecodeGraphs(capture=False)``): each DP group's rows padded to the bucket of the largest
group, the gathers and all-reduces on those fixed-size blocks, the LoRA metadata of the local
and the TP-global rows in static buffers. Every decode step must give the tokens and logits of
the eager multi-rank step and of the same requests on one rank, with mixed adapters and base
rows, and with a DP group that has no requests at all.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.worker.check.parity import OurRun, lora_config_for, make_prompts, run_ours
from loraplane.worker.config import ModelConfig
from loraplane.worker.engine.graphs import DecodeGraphs
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.parallel.launch import spawn_ranks
from loraplane.worker.parallel.state import ParallelConfig, ParallelState

pytestmark = pytest.mark.multirank

NEW_TOKENS = 4  # a prefill and 3 decode steps
ROWS = 4  # running requests per DP group at most; the graphs' spare row is row 4
MAX_LEN = 32

# One run's requests: per DP group, (prompt index, slot) pairs.
Plan = list[list[tuple[int, int]]]


def _runner(model_dir: str, adapters: list[tuple[str, str]], device: torch.device, ps: Any) -> Any:
    cfg = RunnerConfig(
        model_dir,
        device=str(device),
        max_seqs=ROWS + 1,
        max_len=MAX_LEN,
        lora_backend="triton",
        cuda_graphs=False,  # (the runs below set the graphs they compare)
    )
    runner = ModelRunner(cfg, lora_config_for(adapters), ps)
    for slot, (name, path) in enumerate(adapters):
        runner.lora.load_slot(slot, runner.read_adapter(name, path))  # type: ignore[union-attr]
    return runner


def _rank_main(
    rank: int,
    ps: ParallelState,
    device: torch.device,
    model_dir: str,
    adapters: list[tuple[str, str]],
    prompts: list[list[int]],
    plans: list[Plan],
    out: str,
) -> None:
    runner = _runner(model_dir, adapters, device, ps)
    results: list[dict[str, Any]] = []
    for plan in plans:
        mine = plan[ps.dp_rank]
        ids, slots = [prompts[i] for i, _ in mine], [s for _, s in mine]
        runner.graphs = None
        eager = run_ours(runner, ids, slots, NEW_TOKENS)
        # (captured on GPUs: tests/gpu/test_decode_graphs_ranks.py)
        capture = device.type == "cuda"
        graphs = runner.graphs = DecodeGraphs(runner, ROWS, spare_row=ROWS, capture=capture)
        static = run_ours(runner, ids, slots, NEW_TOKENS)
        runner.graphs = None
        results.append(
            {
                "eager": _on_host(eager),
                "graph": _on_host(static),
                "captured": graphs.captured,
                "replays": graphs.replays,
                "buckets": sorted({bucket for bucket, _ in graphs._graphs}),
                "lora_shapes": sorted(str(shape) for _, shape in graphs._graphs),
            }
        )
    everyone = ps.all_gather_object_tp(results)
    if rank == 0:
        torch.save(everyone, out)


def _on_host(run: OurRun) -> OurRun:
    return OurRun(run.sequences, run.generated, [t.cpu() for t in run.logprobs])


def _single(
    model_dir: str,
    adapters: list[tuple[str, str]],
    prompts: list[list[int]],
    plan: Plan,
    device: str = "cpu",
) -> OurRun:
    """Every group's requests in one batch on one rank (eager), in group order."""
    runner = _runner(model_dir, adapters, torch.device(device), None)
    rows = [r for group in plan for r in group]
    run = run_ours(runner, [prompts[i] for i, _ in rows], [s for _, s in rows], NEW_TOKENS)
    return _on_host(run)


def _by_request(plan: Plan, per_group: list[OurRun]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The generated tokens and logprobs of every request, in group order."""
    tokens, logprobs = [], []
    for g, group in enumerate(plan):
        for j in range(len(group)):
            tokens.append(per_group[g].generated[j])
            logprobs.append(per_group[g].logprobs[j])
    return tokens, logprobs


CASES = [
    # (arch, tp, dp, plans); slot -1: no adapter. Groups get different adapters, so each
    # group's gathered MLP rows carry adapters only the other group's tokens use.
    ("llama", 2, 2, "busy", [[(0, 0), (1, NO_ADAPTER), (2, 0)], [(3, 1)]]),
    ("llama", 2, 2, "idle", [[(0, 1), (1, NO_ADAPTER)], []]),
    ("qwen3-moe", 2, 2, "busy", [[(0, 0), (1, NO_ADAPTER), (2, 0)], [(3, 1)]]),
    ("qwen3-moe", 2, 2, "idle", [[(0, 1), (1, NO_ADAPTER)], []]),
    ("llama", 2, 1, "busy", [[(0, 0), (1, NO_ADAPTER), (2, 1)]]),
    ("qwen3-moe", 2, 1, "busy", [[(0, 0), (1, NO_ADAPTER), (2, 1)]]),
]


Layout = tuple[str, int, int]  # (arch, tp, dp)
_RUNS: dict[tuple[Layout, str], tuple[list[Plan], list[Any]]] = {}


def _ranked(suite: Any, layout: Layout, device: str = "cpu") -> tuple[list[Plan], list[Any]]:
    """One rank run per layout, every plan of that layout in it (kept for its other tests)."""
    if (layout, device) not in _RUNS:
        arch, tp, dp = layout
        model_dir, adapters = suite[arch]
        pairs = [(n, str(p)) for n, p in adapters[:2]]
        plans = [plan for a, t, d, _, plan in CASES if (a, t, d) == layout]
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        prompts = make_prompts(vocab, 4, seed=3, max_len=10)
        with tempfile.TemporaryDirectory(prefix="loraplane-graphs-") as tmp:
            out = str(Path(tmp) / "ranks.pt")
            spawn_ranks(
                _rank_main,
                ParallelConfig(tp=tp, dp=dp, dp_attention=dp > 1),
                device,
                str(model_dir),
                pairs,
                prompts,
                plans,
                out,
            )
            parts = torch.load(out, weights_only=False)
        _RUNS[(layout, device)] = (plans, [str(model_dir), pairs, prompts, parts])
    return _RUNS[(layout, device)]


# every case of CASES, by name (shared with tests/gpu/test_rank_graphs_nccl.py)
each_case = pytest.mark.parametrize(
    ("arch", "tp", "dp", "name"),
    [(a, t, d, n) for a, t, d, n, _ in CASES],
    ids=[f"{a}-tp{t}-dp{d}-{n}" for a, t, d, n, _ in CASES],
)


@each_case
def test_graph_steps_give_the_eager_and_the_single_rank_tokens_and_logits(
    suite, arch: str, tp: int, dp: int, name: str
) -> None:  # type: ignore[no-untyped-def]
    check_graph_steps(suite, arch, tp, dp, name, "cpu", tolerance=1e-5)


def check_graph_steps(
    suite: Any, arch: str, tp: int, dp: int, name: str, device: str, tolerance: float
) -> None:
    """Every rank took every decode step through its graphs (captured on GPUs), and the
    tokens and logprobs are the eager multi-rank run's and the single-rank run's."""
    plans, (model_dir, pairs, prompts, parts) = _ranked(suite, (arch, tp, dp), device)
    index = [n for a, t, d, n, _ in CASES if (a, t, d) == (arch, tp, dp)].index(name)
    plan = plans[index]
    attn_tp = tp // dp
    leaders = [g * attn_tp for g in range(dp)]
    # every rank, idle or not, took every decode step through the static graph path, in the
    # bucket of the largest group (4 rows busy, 2 idle), LoRA on (a shape, not None)
    rows = max(len(group) for group in plan)
    for rank in range(tp):
        run = parts[rank][index]
        assert run["replays"] == NEW_TOKENS - 1, (rank, run)
        assert run["buckets"] == [4 if rows > 2 else 2], (rank, run)
        assert "None" not in run["lora_shapes"], (rank, run)
        assert run["captured"] == (device == "cuda"), (rank, run)
    eager_tokens, eager_lp = _by_request(plan, [parts[r][index]["eager"] for r in leaders])
    graph_tokens, graph_lp = _by_request(plan, [parts[r][index]["graph"] for r in leaders])
    single = _single(model_dir, pairs, prompts, plan, device)
    assert graph_tokens == eager_tokens == single.generated
    for got, eager, alone in zip(graph_lp, eager_lp, single.logprobs, strict=True):
        assert float((got - eager).abs().max()) <= tolerance
        assert float((got - alone).abs().max()) <= tolerance
    # the prefill is eager in both runs: bitwise the same rows
    for got, eager in zip(graph_lp, eager_lp, strict=True):
        assert torch.equal(got[: -(NEW_TOKENS - 1)], eager[: -(NEW_TOKENS - 1)])


def _worker_tokens(
    suite: Any, monkeypatch: pytest.MonkeyPatch, static: bool, overlap: bool = False
) -> list[list[int]]:
    """The tokens a tp=2 dp=2 worker's steps give, through its ranks' static graph steps
    (``LORAPLANE_CPU_STATIC_DECODE=1``, read by the ranks at start) or eagerly: a prefill of
    both groups, then decode steps of both, then of group 0 alone (group 1 idle). With
    ``overlap``, every step is launched (ADR 0014) with its input tokens carried on the ranks
    from the step before, and the tokens are read after the last launch."""
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.executor import SeqWork
    from loraplane.worker.parallel.executor import MultiRankExecutor

    monkeypatch.setenv("LORAPLANE_CPU_STATIC_DECODE", "1" if static else "0")
    model_dir, adapters = suite["llama"]
    executor = MultiRankExecutor(
        ParallelConfig(tp=2, dp=2, dp_attention=True),
        RunnerConfig(str(model_dir), max_seqs=2, max_len=32, lora_backend="triton"),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=32),
    )
    try:
        for slot, (name, path) in enumerate(adapters[:2]):
            for group in (0, 1):
                executor.read_adapter(group, name, str(path))
            executor.load_slot(slot, name)
        seqs = [[(0, [5, 9, 200], 0), (1, [44, 2], NO_ADAPTER)], [(0, [7, 7, 8, 3], 1)]]
        out: list[list[int]] = [[], []]
        work = [[SeqWork(row, 0, tuple(p), slot) for row, p, slot in g] for g in seqs]
        launched: list[tuple[Any, int]] = []  # each launch, and its group 0's rows
        for step in range(5):
            if overlap:
                after = launched[-1][0] if launched else None
                launched.append((executor.launch(work, after), len(work[0])))
                tokens: list[list[int]] = [[0] * len(g) for g in work]  # (carried instead)
            else:
                tokens = [result.tokens for result in executor.step(work)]
                for g in range(2):
                    out[g] += tokens[g]
            lengths = [[len(p) + step for _, p, _ in g] for g in seqs]
            work = [
                [
                    SeqWork(row, lengths[g][j], (tokens[g][j],), slot, carry=j if overlap else -1)
                    for j, (row, _, slot) in enumerate(seqs[g])
                ]
                if g == 0 or step < 2
                else []  # group 1's request is done: the group idles
                for g in range(2)
            ]
        for step, rows in launched:
            read = step.tokens()
            out[0] += read[:rows]
            out[1] += read[rows:]
        return out
    finally:
        executor.shutdown()


def test_a_workers_ranks_step_through_their_graphs_with_an_idle_group(
    suite, monkeypatch, capfd, caplog
) -> None:  # type: ignore[no-untyped-def]
    """Through ``MultiRankExecutor``: the ranks build their graphs from the runner config, take
    decode steps of both groups and of one group with the other idle, and give the tokens of
    the eager steps; launched ahead (overlapped steps), the graph steps take their input
    tokens carried from each group's previous step."""
    caplog.set_level(logging.INFO)  # (the level the ranks log at)
    eager = _worker_tokens(suite, monkeypatch, static=False)
    capfd.readouterr()
    with_graphs = _worker_tokens(suite, monkeypatch, static=True, overlap=True)
    logs = capfd.readouterr().err
    assert with_graphs == eager
    assert [len(g) for g in eager] == [2 * 5, 3]
    # every rank made its static steps (the ranks log at the driver's level, with their rank)
    for rank in (0, 1):
        assert f"rank{rank} loraplane.worker.engine.graphs: a decode graph's static step" in logs
