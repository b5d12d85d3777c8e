"""`loraplane check parity`: one mixed batch through our runtime and through the references.

Prompts are spread over the adapters and over no adapter, interleaved so that rows of one
adapter are not contiguous. Our runtime prefills them in one batch and decodes greedily in
batched steps; the references (HF transformers + PEFT, and the adapter merged into the base
weights) are run on the same token sequences, one sequence at a time.

Figures (see docs/numerics.md):
- max_abs_logprob_diff: max |Δ| of the full-vocabulary log-softmax at every position.
- mean_abs_logprob_diff: mean |Δ| of the logprob of the realised next token.
- delta_corr: correlation of (ours with LoRA − our base) with (merged − HF base), realised tokens.
- lora_effect: mean |ours with LoRA − our base|, realised tokens (LoRA must visibly matter).
- greedy_identical: prompts whose reference argmax equals our greedy token at every step.
- base_rows_bitwise_equal: rows with no adapter equal bit for bit the same model without LoRA.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplane.worker.config import LoRARuntimeConfig, ModelConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, decode_batch, prefill_batch
from loraplane.worker.lora.adapter import read_adapter_config
from loraplane.worker.lora.batch_info import NO_ADAPTER


@dataclass(slots=True)
class OurRun:
    sequences: list[list[int]]  # prompt + generated tokens fed back (len L + T - 1)
    generated: list[list[int]]
    logprobs: list[torch.Tensor]  # [len(sequence), vocab] per prompt, fp32


def make_prompts(
    vocab: int, n: int, seed: int, min_len: int = 4, max_len: int = 20
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def assign_adapters(n_prompts: int, n_adapters: int) -> list[int | None]:
    """Prompt i -> adapter i mod (n + 1); index n means no adapter."""
    return [
        (i % (n_adapters + 1)) if i % (n_adapters + 1) < n_adapters else None
        for i in range(n_prompts)
    ]


def run_ours(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    slots: Sequence[int],
    max_new_tokens: int,
    forced: Sequence[Sequence[int]] | None = None,
) -> OurRun:
    """Prefill all prompts in one batch, then batched greedy decode (or teacher-forced)."""
    device = runner.device
    rows = list(range(len(prompts)))
    batch = prefill_batch(prompts, rows, all_logits=True, device=device)
    token_slots = [s for p, s in zip(prompts, slots, strict=True) for _ in p]
    logits = runner.forward(batch, token_slots)
    logprobs: list[list[torch.Tensor]] = []
    offset = 0
    for p in prompts:
        logprobs.append([torch.log_softmax(logits[offset : offset + len(p)].float(), dim=-1)])
        offset += len(p)
    generated: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        last = [lp[-1][-1] for lp in logprobs]
        for i, row in enumerate(last):
            token = int(forced[i][step]) if forced is not None else int(torch.argmax(row))
            generated[i].append(token)
        if step == max_new_tokens - 1:
            break
        starts = [len(p) + step for p in prompts]
        batch = decode_batch([g[-1] for g in generated], rows, starts, device)
        logits = runner.forward(batch, list(slots))
        for i in range(len(prompts)):
            logprobs[i].append(torch.log_softmax(logits[i : i + 1].float(), dim=-1))
    sequences = [list(p) + g[:-1] for p, g in zip(prompts, generated, strict=True)]
    return OurRun(sequences, generated, [torch.cat(lp) for lp in logprobs])


def _token_logprobs(lp: torch.Tensor, seq: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """Logprob of the realised next token at every position: [len(seq)]."""
    nxt = torch.tensor([*seq[1:], generated[-1]], dtype=torch.long)
    return lp.cpu().gather(1, nxt[:, None])[:, 0]


@dataclass(slots=True)
class ParityReport:
    arch: str
    backend: str
    dtype: str
    prompts: int
    adapters: dict[str, int | None]  # prompts per adapter name ("<base>" for none)
    max_abs_logprob_diff: float  # vs PEFT
    max_abs_logprob_diff_merged: float
    mean_abs_logprob_diff: float  # vs PEFT, realised tokens
    mean_abs_logprob_diff_merged: float
    delta_corr: float
    lora_effect: float
    greedy_identical: str
    greedy_identical_count: int
    base_rows_bitwise_equal: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom else float("nan")


def lora_config_for(adapters: Sequence[tuple[str, str | Path]]) -> LoRARuntimeConfig:
    configs = [read_adapter_config(n, Path(p)) for n, p in adapters]
    ranks = [max([int(c["r"]), *map(int, (c.get("rank_pattern") or {}).values())]) for c in configs]
    return LoRARuntimeConfig(
        max_loras_per_batch=max(1, len(adapters)),
        max_loaded_loras=max(1, len(adapters)),
        max_lora_rank=max(ranks, default=8),
    )


def run_single(
    model_dir: Path,
    adapters: Sequence[tuple[str, str | Path]],
    prompt_ids: list[list[int]],
    slots: list[int],
    max_new_tokens: int,
    *,
    backend: str,
    device: str,
    dtype: str,
) -> tuple[OurRun, OurRun]:
    """Our runtime in one process: the mixed batch with LoRA, and the same tokens without LoRA."""
    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + 1
    rcfg = RunnerConfig(
        str(model_dir),
        device=device,
        dtype=dtype,
        max_seqs=len(prompt_ids),
        max_len=max_len,
        lora_backend=backend,
    )
    ours = ModelRunner(rcfg, lora_config_for(adapters))
    for slot, (name, path) in enumerate(adapters):
        ours.lora.load_slot(slot, ours.read_adapter(name, path))  # type: ignore[union-attr]
    lora_run = run_ours(ours, prompt_ids, slots, max_new_tokens)
    del ours
    plain = ModelRunner(rcfg, None)
    base_run = run_ours(
        plain, prompt_ids, [NO_ADAPTER] * len(prompt_ids), max_new_tokens, forced=lora_run.generated
    )
    return lora_run, base_run


def check_parity(
    model_dir: str | Path,
    adapters: Sequence[tuple[str, str | Path]],
    *,
    prompts: int = 10,
    max_new_tokens: int = 6,
    backend: str = "triton",
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    reference_device: str | None = None,
    fp32_reference: bool = False,
) -> ParityReport:
    """Our runtime against the references; with ``fp32_reference``, also ours and HF + PEFT
    in ``dtype`` against HF + PEFT in fp32 (``extra["fp32_reference"]``,
    ``fp32_reference_figures``)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    dtype_name = dtype or config.torch_dtype
    prompt_ids = make_prompts(config.vocab_size, prompts, seed)
    assignment = assign_adapters(prompts, len(adapters))
    slots = [a if a is not None else NO_ADAPTER for a in assignment]
    lora_run, base_run = run_single(
        model_dir,
        adapters,
        prompt_ids,
        slots,
        max_new_tokens,
        backend=backend,
        device=device,
        dtype=dtype_name,
    )
    report = compare_with_references(
        model_dir,
        adapters,
        prompt_ids,
        assignment,
        lora_run,
        base_run,
        backend=backend,
        dtype=dtype_name,
        reference_device=reference_device or device,
    )
    if fp32_reference:
        report.extra["fp32_reference"] = fp32_reference_figures(
            model_dir,
            adapters,
            prompt_ids,
            assignment,
            lora_run,
            base_run,
            dtype=dtype_name,
            reference_device=reference_device or device,
        )
    return report


def compare_with_references(
    model_dir: Path,
    adapters: Sequence[tuple[str, str | Path]],
    prompt_ids: list[list[int]],
    assignment: list[int | None],
    lora_run: OurRun,
    base_run: OurRun,
    *,
    backend: str,
    dtype: str,
    reference_device: str,
) -> ParityReport:
    config = ModelConfig.from_dir(model_dir)
    dtype_name = dtype
    prompts = len(prompt_ids)
    ref_device = reference_device
    max_peft = max_merged = 0.0
    mean_peft: list[torch.Tensor] = []
    mean_merged: list[torch.Tensor] = []
    ours_delta: list[torch.Tensor] = []
    ref_delta: list[torch.Tensor] = []
    effect: list[torch.Tensor] = []
    greedy = 0
    bitwise = True
    from loraplane.worker.check import reference as ref

    base_lp = ref.cached_logprobs(
        "base", model_dir, None, dtype_name, ref_device, lora_run.sequences
    )
    by_adapter: dict[int | None, list[int]] = {}
    for i, a in enumerate(assignment):
        by_adapter.setdefault(a, []).append(i)
    for a, idxs in by_adapter.items():
        if a is None:
            peft_lp = {i: base_lp[i] for i in idxs}
            merged_lp = peft_lp
            for i in idxs:
                bitwise &= bool(torch.equal(lora_run.logprobs[i], base_run.logprobs[i]))
        else:
            _, path = adapters[a]
            seqs = [lora_run.sequences[i] for i in idxs]
            peft_lp = dict(
                zip(
                    idxs,
                    ref.cached_logprobs("peft", model_dir, path, dtype_name, ref_device, seqs),
                    strict=True,
                )
            )
            merged_lp = dict(
                zip(
                    idxs,
                    ref.cached_logprobs("merged", model_dir, path, dtype_name, ref_device, seqs),
                    strict=True,
                )
            )
        for i in idxs:
            seq, gen = lora_run.sequences[i], lora_run.generated[i]
            mine = lora_run.logprobs[i].cpu()
            max_peft = max(max_peft, float((mine - peft_lp[i]).abs().max()))
            max_merged = max(max_merged, float((mine - merged_lp[i]).abs().max()))
            t_mine = _token_logprobs(mine, seq, gen)
            mean_peft.append((t_mine - _token_logprobs(peft_lp[i], seq, gen)).abs())
            mean_merged.append((t_mine - _token_logprobs(merged_lp[i], seq, gen)).abs())
            prompt_len = len(prompt_ids[i])
            ref_tokens = peft_lp[i][prompt_len - 1 :].argmax(dim=-1).tolist()
            greedy += int(ref_tokens == gen)
            if a is not None:
                t_base = _token_logprobs(base_run.logprobs[i].cpu(), seq, gen)
                ours_delta.append(t_mine - t_base)
                ref_delta.append(
                    _token_logprobs(merged_lp[i], seq, gen) - _token_logprobs(base_lp[i], seq, gen)
                )
                effect.append((t_mine - t_base).abs())
    counts: dict[str, int | None] = {}
    for a in assignment:
        key = adapters[a][0] if a is not None else "<base>"
        counts[key] = (counts.get(key) or 0) + 1
    return ParityReport(
        arch=config.arch,
        backend=backend,
        dtype=dtype_name,
        prompts=prompts,
        adapters=counts,
        max_abs_logprob_diff=max_peft,
        max_abs_logprob_diff_merged=max_merged,
        mean_abs_logprob_diff=float(torch.cat(mean_peft).mean()),
        mean_abs_logprob_diff_merged=float(torch.cat(mean_merged).mean()),
        delta_corr=_corr(torch.cat(ours_delta), torch.cat(ref_delta))
        if ours_delta
        else float("nan"),
        lora_effect=float(torch.cat(effect).mean()) if effect else 0.0,
        greedy_identical=f"{greedy}/{prompts}",
        greedy_identical_count=greedy,
        base_rows_bitwise_equal=bitwise,
    )


def fp32_reference_figures(
    model_dir: Path,
    adapters: Sequence[tuple[str, str | Path]],
    prompt_ids: list[list[int]],
    assignment: list[int | None],
    lora_run: OurRun,
    base_run: OurRun,
    *,
    dtype: str,
    reference_device: str,
) -> dict[str, float | str]:
    """Our run (in ``dtype``) and HF + PEFT in ``dtype``, each against HF + PEFT in fp32 on the
    same token sequences: how much of a gap is ours and how much is the dtype's own.

    ``ours_*`` / ``hf_*``: mean |Δ| of the realised tokens' logprobs, max |Δ| over the full
    vocabulary, delta corr of the LoRA's effect (with LoRA − base) against fp32's, and the
    prompts whose every greedy token is fp32's argmax. ``mean_ratio``: ours / HF's mean |Δ|
    (the issue's acceptance: at most 1.2)."""
    from loraplane.worker.check import reference as ref

    seqs = lora_run.sequences

    def logprobs(kind: str, dt: str) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(seqs)
        base = ref.cached_logprobs("base", model_dir, None, dt, reference_device, seqs)
        for a in set(assignment):
            idxs = [i for i, x in enumerate(assignment) if x == a]
            if a is None or kind == "base":
                got = [base[i] for i in idxs]
            else:
                got = ref.cached_logprobs(
                    "peft", model_dir, adapters[a][1], dt, reference_device, [seqs[i] for i in idxs]
                )
            for i, lp in zip(idxs, got, strict=True):
                out[i] = lp
        return [lp for lp in out if lp is not None]

    fp32, fp32_base = logprobs("peft", "float32"), logprobs("base", "float32")
    hf, hf_base = logprobs("peft", dtype), logprobs("base", dtype)
    ours = [lp.cpu() for lp in lora_run.logprobs]
    ours_base = [lp.cpu() for lp in base_run.logprobs]
    figures: dict[str, float | str] = {}
    for who, mine, mine_base in (("ours", ours, ours_base), ("hf", hf, hf_base)):
        mean, delta, truth_delta = [], [], []
        worst, greedy = 0.0, 0
        for i, seq in enumerate(seqs):
            gen = lora_run.generated[i]
            t_mine = _token_logprobs(mine[i], seq, gen)
            t_fp32 = _token_logprobs(fp32[i], seq, gen)
            mean.append((t_mine - t_fp32).abs())
            worst = max(worst, float((mine[i] - fp32[i]).abs().max()))
            start = len(prompt_ids[i]) - 1
            greedy += int(
                mine[i][start:].argmax(-1).tolist() == fp32[i][start:].argmax(-1).tolist()
            )
            if assignment[i] is not None:
                delta.append(t_mine - _token_logprobs(mine_base[i], seq, gen))
                truth_delta.append(t_fp32 - _token_logprobs(fp32_base[i], seq, gen))
        figures[f"{who}_vs_fp32_mean_abs"] = float(torch.cat(mean).mean())
        figures[f"{who}_vs_fp32_max_abs"] = worst
        figures[f"{who}_vs_fp32_delta_corr"] = (
            _corr(torch.cat(delta), torch.cat(truth_delta)) if delta else float("nan")
        )
        figures[f"{who}_vs_fp32_greedy"] = f"{greedy}/{len(seqs)}"
    hf_mean = float(figures["hf_vs_fp32_mean_abs"])
    figures["mean_ratio"] = (
        float(figures["ours_vs_fp32_mean_abs"]) / hf_mean if hf_mean else float("nan")
    )
    return figures
