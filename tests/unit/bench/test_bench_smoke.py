"""CPU smoke test of the GPU benchmarks at tiny shapes (Triton interpreter): every JSON field
the reports rely on is present and the ratios are computed. No timing assertions."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytestmark = pytest.mark.unit


def test_kernels_bench_tiny(tmp_path):
    from loraplane.worker.bench.kernels import run_kernels_bench, summary_table

    out = tmp_path / "kernels.json"
    res = run_kernels_bench("cpu", [4], [2], ["tiny"], out, tokens=[3], rep_ms=1.0)
    assert json.loads(out.read_text())["cases"] == json.loads(json.dumps(res["cases"]))
    assert not res.get("errors"), res.get("errors")
    assert res["peak"]["gbytes_per_s"] > 0
    assert {c["module"] for c in res["cases"]} == {"qkv", "down", "moe_gate_up", "moe_down"}
    for c in res["cases"]:
        for key in (
            "shrink_us",
            "expand_us",
            "lora_us",
            "dense_us",
            "shrink_bytes",
            "expand_bytes",
            "shrink_weight_bytes",
            "expand_weight_bytes",
            "shrink_pct_peak",
            "expand_pct_peak",
            "lora_pct_peak",
            "lora_over_dense",
        ):
            assert c[key] is not None and c[key] > 0, key
        assert c["ref_us"] > 0 and c["ref_over_lora"] == pytest.approx(c["ref_us"] / c["lora_us"])
        assert c["rel_err"] < 1e-5  # fp32 in the interpreter
        if c["kind"] == "moe":
            assert c["routing_us"] > 0 and c["base_grouped_us"] > 0 and c["pairs"] == 6
    assert "tiny/qkv" in summary_table(res)


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_decode_bench_tiny(tmp_path, shape):
    from loraplane.worker.bench.decode import run_decode_bench, summary_table

    out = tmp_path / "decode.json"
    res = run_decode_bench(
        "cpu", [2], [2], 1, shape, False, out, rank=4, context=4, steps=1, warmup=1
    )
    assert not res.get("errors"), res.get("errors")
    assert json.loads(out.read_text())["settings"]["shape"] == shape
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"head", "off", "none", "2"}
    assert rows["off"]["ratio_vs_off"] == 1.0
    assert all(r["timed_steps"] == 3 for r in rows.values())  # 3 rounds x 1 step, pooled
    for v in ("none", "2"):
        r = rows[v]
        assert r["tok_s"] > 0 and r["step_ms"] > 0
        assert r["ratio_vs_off"] == pytest.approx(r["tok_s"] / rows["off"]["tok_s"])
        # one ratio per round (its median step against the same round's `off`): the spread
        # the table prints beside the pooled ratio
        assert len(r["ratio_by_round"]) == 3 and all(x > 0 for x in r["ratio_by_round"])
        assert "projected_ratio_full_depth" in r
        assert r["projected_ratio_full_depth"] is None or math.isfinite(
            r["projected_ratio_full_depth"]
        )
    table = summary_table(res)
    assert "bs" in table and "by round" in table


def _one_round(decode, **kw):
    """The tiny bench on the CPU: bs 2, 2 adapters, one round of 1 warm-up and 2 timed
    steps a variant; no errors."""
    res = decode.run_decode_bench(
        "cpu", [2], [2], 1, "tiny", False, None, rank=4, context=4, steps=2, warmup=1,
        rounds=1, **kw,
    )  # fmt: skip
    assert not res.get("errors"), res.get("errors")
    return res


@pytest.mark.parametrize("order", ["step", "variant"])
def test_decode_bench_orders_the_variants_steps(monkeypatch, order):
    """``order="step"``: step s of every variant before step s + 1 of any (a slow phase of
    the machine falls on all of them), in turns that change from step to step (no variant
    always follows the same one); ``"variant"``: each variant's steps back to back."""
    from loraplane.worker.bench import decode

    seen: list[tuple[str, int]] = []
    real_step = decode._step

    def recording_step(runner, bs, slots, context, s, sampling="greedy"):
        variant = (
            "head"
            if len(runner.model.layers) == 0
            else "off"
            if runner.lora is None
            else "none"
            if slots[0] < 0
            else "2"
        )
        seen.append((variant, s))
        return real_step(runner, bs, slots, context, s, sampling)

    monkeypatch.setattr(decode, "_step", recording_step)
    res = _one_round(decode, order=order)
    assert res["settings"]["order"] == order
    names = ["head", "off", "none", "2"]
    warm = [(v, s) for v in names for s in range(1)]  # each variant's untimed warm-up first
    assert seen[: len(warm)] == warm
    timed = seen[len(warm) :]
    if order == "step":  # every variant's step s before any step s + 1, each once
        assert [s for _, s in timed] == [s for s in range(3) for _ in names]
        assert all(sorted(v for v, s in timed if s == k) == sorted(names) for k in range(3))
        # the turns change: `off` does not always come right after the same variant
        before_off = {timed[i - 1][0] for i, (v, _) in enumerate(timed) if v == "off" and i}
        assert len(before_off) > 1
    else:
        assert timed == [(v, s) for v in names for s in range(3)]
    assert all(r["timed_steps"] == 2 for r in res["rows"])


def test_decode_bench_control_runs_lora_off_a_second_time(monkeypatch):
    """``control=True`` adds ``off2``, LoRA-off again in its turn after ``off`` (on a GPU with
    graphs of its own): a ratio against ``off`` that only the run's noise moves, printed
    with the rest."""
    from loraplane.worker.bench import decode

    lora_off_steps: list[int] = []
    real_step = decode._step

    def recording_step(runner, bs, slots, context, s, sampling="greedy"):
        if runner.lora is None and len(runner.model.layers) > 0:
            lora_off_steps.append(s)
        return real_step(runner, bs, slots, context, s, sampling)

    monkeypatch.setattr(decode, "_step", recording_step)
    res = _one_round(decode, control=True)
    assert res["settings"]["control"] is True
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["head", "off", "off2", "none", "2"]
    assert lora_off_steps == [0, 0, 0, 0, 1, 1, 2, 2]  # warm-ups, then each step twice
    off2 = rows["off2"]
    assert off2["ratio_vs_off"] == pytest.approx(off2["tok_s"] / rows["off"]["tok_s"])
    assert "off2" in decode.summary_table(res)


@pytest.mark.parametrize("n", [2, 4, 5, 8])
def test_decode_bench_turns_are_balanced(n):
    """Over a cycle of steps (n, or 2n for an odd count) each variant goes first equally
    often and follows each other variant equally often: no variant's steps always come after
    the same one's (a light step before a heavy one changes the heavy one's time)."""
    import itertools
    from collections import Counter

    from loraplane.worker.bench.decode import turn_order

    names = [f"v{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    rows = [turn_order(names, s) for s in range(cycle)]
    assert all(sorted(row) == names for row in rows)
    firsts = Counter(row[0] for row in rows)
    pairs = Counter(p for row in rows for p in itertools.pairwise(row))
    assert set(firsts) == set(names) and len(set(firsts.values())) == 1
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def test_decode_bench_refuses_an_unknown_order():
    from loraplane.worker.bench.decode import run_decode_bench

    with pytest.raises(ValueError, match="order: unknown 'random'"):
        run_decode_bench("cpu", [2], [2], 1, "tiny", False, None, order="random")


@pytest.mark.parametrize("sampling", ["greedy", "chat", "chat-triton"])
def test_decode_bench_steps_sample_as_asked(monkeypatch, sampling):
    """``sampling="chat"``: every step picks its tokens with the server's sampler
    (``sample_rows``, temperature 0.7, top_p 0.9), ``"chat-triton"`` with its fused one;
    ``"greedy"``: with the argmax alone."""
    from loraplane.worker.bench import decode
    from loraplane.worker.engine import sampling as sampler

    calls: list[tuple[int, float, str | None]] = []
    real = sampler.sample_rows

    def counting(logits, params, indices, name=None):
        calls.append((len(params), params[0].temperature, name))
        return real(logits, params, indices, name)

    monkeypatch.setattr(sampler, "sample_rows", counting)
    res = _one_round(decode, sampling=sampling)
    assert res["settings"]["sampling"] == sampling
    if sampling != "greedy":  # 4 variants' warm-up step, then 3 timed steps each
        name = "triton" if sampling == "chat-triton" else "torch"
        assert calls == [(2, 0.7, name)] * (4 * 1 + 4 * 3)
    else:
        assert calls == []
    with pytest.raises(ValueError, match="sampling: unknown 'beam'"):
        decode.run_decode_bench("cpu", [2], [2], 1, "tiny", False, None, sampling="beam")
