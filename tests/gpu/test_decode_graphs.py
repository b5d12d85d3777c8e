"""GPU tier: the runtime's CUDA-graph decode (engine/graphs.py) against its eager decode.

Same runner, same batches: prefill, then decode steps replayed from graphs vs run eagerly,
for a dense and an MoE fixture, mixed batches (adapters and base rows), a batch size that
pads into its bucket, and an adapter loaded after the graphs were captured. fp32, so any
difference beyond the kernels' summation order is a bug. Runs through the device tool
(scripts/gpu-numerics.sh); there is no GPU on the CI machine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8], [90, 1], [3, 4, 5]]


def _runner(suite, arch: str, graphs: bool):  # type: ignore[no-untyped-def]
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.runner import ModelRunner, RunnerConfig

    model_dir, adapters = suite[arch]
    cfg = RunnerConfig(
        str(model_dir), device="cuda", dtype="float32", max_seqs=8, max_len=48, cuda_graphs=graphs
    )
    lora = LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    runner = ModelRunner(cfg, lora)
    for slot, (name, path) in enumerate(adapters[:2]):
        runner.lora.load_slot(slot, runner.read_adapter(name, path))
    return runner, adapters


def _decode(runner, slots_per_row: list[int], steps: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    from loraplane.worker.engine.runner import decode_batch, prefill_batch

    n = len(slots_per_row)
    prompts = PROMPTS[:n]
    rows = list(range(n))
    slots = [s for p, s in zip(prompts, slots_per_row, strict=True) for _ in p]
    logits = runner.forward(prefill_batch(prompts, rows, all_logits=False, device="cuda"), slots)
    out = [logits.float().cpu()]
    tokens = logits.argmax(-1).tolist()
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        logits = runner.forward(decode_batch(tokens, rows, lengths, "cuda"), slots_per_row)
        out.append(logits.float().cpu())
        tokens = logits.argmax(-1).tolist()
        lengths = [x + 1 for x in lengths]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_graph_decode_matches_eager_decode(suite, arch: str) -> None:  # type: ignore[no-untyped-def]
    graph_runner, adapters = _runner(suite, arch, graphs=True)
    eager_runner, _ = _runner(suite, arch, graphs=False)
    assert graph_runner.graphs is not None and eager_runner.graphs is None
    for slots in ([0, -1, 1, 0], [1, 1, -1], [-1, -1, -1, -1, -1]):  # 3 rows pad into 4
        want = _decode(eager_runner, slots, steps=6)
        got = _decode(graph_runner, slots, steps=6)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{slots} step {step}")
    assert graph_runner.graphs.replays == 18
    # An adapter loaded after capture: the graphs read the slot buffers in place.
    for r in (graph_runner, eager_runner):
        name, path = adapters[2]
        r.lora.load_slot(0, r.read_adapter(name, path))
    want = _decode(eager_runner, [0, 1, 0, -1], steps=3)
    got = _decode(graph_runner, [0, 1, 0, -1], steps=3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3-moe"])
def test_fused_rope_and_norm_match_the_torch_ops(suite, arch: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """kernels/rope.py and kernels/norm.py against the model's torch ops (the CPU path),
    through prefill, eager and graph decode steps: staged batches add the qkv LoRA inside the
    rotation, Qwen3 norms each head first, Qwen2 has a qkv bias. fp32, so a wrong column,
    head or cache slot shows far above the tolerance."""
    from loraplane.worker.kernels import rope
    from loraplane.worker.models.layers import RMSNorm
    from loraplane.worker.models.model import Attention

    staged = []
    original = rope.rope_qkv

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        staged.append(kwargs.get("stage") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(rope, "rope_qkv", spy)

    def run(fused: bool) -> list[torch.Tensor]:
        Attention.fused_rope = RMSNorm.fused = fused
        try:
            runner, _ = _runner(suite, arch, graphs=True)
            return [t for slots in ([0, -1, 1, 0], [1, 1, -1]) for t in _decode(runner, slots, 4)]
        finally:
            Attention.fused_rope = RMSNorm.fused = True

    for step, (g, w) in enumerate(zip(run(True), run(False), strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    # the fused path ran, and for the staged graph steps with the qkv LoRA inside it (Qwen2's
    # qkv bias keeps its qkv unstaged)
    assert staged and (any(staged) == (arch != "qwen2"))


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_eager_staged_steps_keep_base_rows_bitwise(suite, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Eager bf16 steps stage on CUDA (LoRAManager._staged_info): rows without an adapter get
    the LoRA-off step's logits bit for bit (the base GEMM runs as in the LoRA-off step, the
    stage's rows apart), and rows with one get the shrink + expand kernels' logits to bf16
    tolerance. Fixed tokens (no sampling), prefill then 4 decode steps, no graphs. (In fp32
    the fused epilogues differ from the LoRA-off ops in the last bits: fp32 models do not
    stage eager batches, checked last.)"""
    dtype = "bfloat16"
    from loraplane.worker.config import LoRARuntimeConfig
    from loraplane.worker.engine.runner import (
        ModelRunner,
        RunnerConfig,
        decode_batch,
        prefill_batch,
    )

    model_dir, adapters = suite[arch]
    cfg = RunnerConfig(
        str(model_dir), device="cuda", dtype=dtype, max_seqs=8, max_len=48, cuda_graphs=False
    )
    runner = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    )
    lora = runner.lora
    assert lora is not None and lora.eager_stage_rows > 0
    for slot, (name, path) in enumerate(adapters[:2]):
        lora.load_slot(slot, runner.read_adapter(name, path))
    prompts, per_row = PROMPTS[:4], [0, -1, 1, 0]
    rows, lengths = [0, 1, 2, 3], [len(p) for p in PROMPTS[:4]]

    def run(slots_per_row: list[int], stage_rows: int) -> list[torch.Tensor]:
        lora.eager_stage_rows = stage_rows
        slots = [s for p, s in zip(prompts, slots_per_row, strict=True) for _ in p]
        out = [runner.forward(prefill_batch(prompts, rows, all_logits=True, device="cuda"), slots)]
        for step in range(4):
            tokens = [(7 * step + 3 * r) % 200 + 1 for r in rows]
            lens = [n + step for n in lengths]
            out.append(runner.forward(decode_batch(tokens, rows, lens, "cuda"), slots_per_row))
        return [t.float().cpu() for t in out]

    copies = lora.stage.copies
    staged = run(per_row, 256)
    assert lora.stage.copies > copies, "the eager steps staged their adapters"
    unstaged = run(per_row, 0)
    off = run([-1] * 4, 256)
    token_slots = [s for p, s in zip(prompts, per_row, strict=True) for _ in p]
    prefill_base = [t for t, s in enumerate(token_slots) if s < 0]  # the prefill's base rows
    assert prefill_base
    for step, (s, u, o) in enumerate(zip(staged, unstaged, off, strict=True)):
        base = prefill_base if step == 0 else [1]
        assert torch.equal(s[base], o[base]), f"step {step}: base rows changed"
        assert torch.equal(u[base], o[base]), f"step {step}: base rows changed (unstaged)"
        # The fused epilogues round once where the kernels round twice. On the MoE model that
        # flips some tokens' experts after a few steps (teacher-forced rows then drift
        # apart), so its rows are compared on the prefill and the first decode step.
        if arch == "llama" or step <= 1:
            rel = float((s - u).norm() / u.norm())
            assert rel < 1e-2, f"step {step}: staged vs unstaged relative error {rel:.2e}"
        assert not torch.allclose(s, o, atol=1e-3), f"step {step}: the adapters did nothing"
    fp32 = ModelRunner(
        RunnerConfig(str(model_dir), device="cuda", dtype="float32", max_seqs=8, max_len=48),
        LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32),
    )
    assert fp32.lora is not None and fp32.lora.eager_stage_rows == 0


def test_graphs_are_captured_while_another_thread_page_locks_adapters(suite) -> None:  # type: ignore[no-untyped-def]
    """An adapter read (and page-locked) on the adapter thread while the engine captures
    decode graphs at new batch sizes and adapter mixes: every capture succeeds (CUDA refuses
    page-locked allocations from other threads during a capture; CUDA_CAPTURE_LOCK keeps
    them apart) and every read adapter ends up page-locked."""
    import threading

    runner, adapters = _runner(suite, "llama", graphs=True)
    name, path = adapters[2]
    stop, reads, errors = threading.Event(), [], []

    def read_in_a_loop() -> None:
        try:
            while not stop.is_set():
                w = runner.read_adapter(name, path)
                reads.append(all(a.is_pinned() and b.is_pinned() for a, b in w.dense.values()))
        except Exception as exc:  # (reported below, not lost in the thread)
            errors.append(exc)

    reader = threading.Thread(target=read_in_a_loop)
    reader.start()
    try:
        for slots in ([0, -1, 1, 0], [1, 1, -1], [-1] * 5, [0], [0, 1], [-1, -1]):
            _decode(runner, slots, steps=2)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors
    assert not runner.graphs._failed, f"captures failed: {runner.graphs._failed}"
    assert runner.graphs.replays == 12
    assert reads and all(reads)


def _busy(stream: torch.cuda.Stream, ms: float) -> None:
    """Keep ``stream`` busy for about ``ms`` (a spinning kernel), so what is queued on it
    next starts late."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1e-3 * 2e9))  # ~2 GHz SM clock


@pytest.mark.parametrize("graphs", [False, True])
def test_slot_loads_copy_beside_the_steps_in_order(suite, graphs: bool) -> None:  # type: ignore[no-untyped-def]
    """Slot loads go on a copy stream of their own (ADR 0011), ordered both ways:
    - a load into a slot that a queued step still reads copies after that step (the step
      sees the old adapter; checked on the graph path);
    - a step that uses a slot whose copy is late waits for it on the device (it sees the new
      adapter), while a step without it does not wait."""
    from loraplane.worker.engine.runner import decode_batch

    runner, adapters = _runner(suite, "llama", graphs=graphs)
    reference, _ = _runner(suite, "llama", graphs=False)
    lora = runner.lora
    assert lora.overlap_loads and lora._copy_stream is not None
    names = [runner.read_adapter(n, p) for n, p in adapters[:3]]
    ref_names = [reference.read_adapter(n, p) for n, p in adapters[:3]]
    rows, tokens, lengths = [0, 1], [5, 9], [3, 3]

    def step(r, slots):  # type: ignore[no-untyped-def]
        return r.forward(decode_batch(tokens, rows, lengths, "cpu"), slots)  # (host inputs)

    _decode(runner, [0, 1], steps=1)  # (captures this shape's graph)
    _decode(reference, [0, 1], steps=1)
    step(runner, [-1, -1])  # (a first step may wait for the whole device: a module load)
    want_old = step(reference, [0, 1]).float().cpu()
    reference.lora.load_slot(0, ref_names[2])
    want_new = step(reference, [0, 1]).float().cpu()
    want_base = step(reference, [-1, -1]).float().cpu()
    assert not torch.allclose(want_old, want_new)

    if graphs:  # 1. the step queued behind a busy step stream still reads adapter 0
        torch.cuda.synchronize()
        _busy(torch.cuda.current_stream(), 200)
        logits = step(runner, [0, 1])
        lora.load_slot(0, names[2])
        assert not torch.cuda.current_stream().query(), "the step ran before the load was queued"
        torch.testing.assert_close(logits.float().cpu(), want_old, rtol=1e-4, atol=1e-4)
        torch.cuda.synchronize()

    # 2. a late copy: a base step does not wait for it; a step that uses the slot does
    lora.load_slot(0, names[0])
    torch.cuda.synchronize()
    _busy(lora._copy_stream, 300)
    lora.load_slot(0, names[2])
    base = step(runner, [-1, -1]).float().cpu()
    assert not lora.slot_loaded(0), "the base step waited for the slot's copy"
    torch.testing.assert_close(base, want_base, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step(runner, [0, 1]).float().cpu(), want_new, rtol=1e-4, atol=1e-4)
