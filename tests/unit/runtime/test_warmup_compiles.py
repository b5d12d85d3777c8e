"""Nothing compiles after the warm-up (ADR 0008): every Triton kernel variant a serving
workload launches is one the warm-up launched.

A GPU compiles a Triton kernel once per specialization key; the CPU runs Triton's
interpreter, which compiles nothing, so ``tests.triton_keys`` computes the key the GPU's JIT
would use for every launch. A tiny worker (the Triton LoRA backend and sampler, the paged
KV cache, decode steps through the static graph path as on a GPU, chunked prefill) warms up
while the keys are recorded, then serves a seeded random workload: prompts shorter and longer
than the chunked-prefill size, more adapters than slots, base rows, prompt chunks beside
decodes of every count. The decode attention kernel runs only on CUDA (the CPU attends with
torch); its launches at the same operands are recorded without running (``shadowing``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.triton_keys import Recorder, describe, record_keys

from loraplane.worker.engine.executor import LocalExecutor
from loraplane.worker.engine.sampling import SamplingParams
from loraplane.worker.server.factory import ServeConfig, build_engine

pytestmark = pytest.mark.unit

MAX_RUNNING = 8
CHUNK = 40  # --chunked-prefill-size
SLOTS = 2  # --max-loras-per-batch: fewer than the adapters in use
STAGE = 1  # --stage-slots: batches of 2 adapters run the shrink and expand kernels
GRAPH_TOKENS = 32  # --graph-max-tokens: prompt steps of fewer tokens replay the static path


@pytest.fixture
def gpu_shaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' launch rules as a small GPU's, scaled to the tiny model, so that its
    steps meet the variety of variants a GPU's do: decode steps through the decode graphs'
    static batches (captured on a GPU), eager batches staged (CUDA's bf16 rule), the
    shrink's K split over 16-column steps for a GPU of 16 programs in flight (staged prompt
    steps take the fused epilogues' tiles, as a GPU's up to 4,096 rows do),
    and the decode attention's split count for a GPU of 8 multiprocessors (the CPU's rule
    gives 8 rows of the tiny model one or two split counts)."""
    from loraplane.worker.engine import warmup
    from loraplane.worker.kernels import _triton_utils, attention
    from loraplane.worker.lora import manager
    from loraplane.worker.models.model import Attention

    monkeypatch.setenv("LORAPLANE_CPU_STATIC_DECODE", "1")  # decode steps as a GPU's graphs
    # prompt chunks through the Triton kernel, so short prompt steps take the static path of
    # the prompt graphs (engine/prompt_graphs.py) as on a GPU
    monkeypatch.setattr(Attention, "prompt_kernel", True)
    monkeypatch.setattr(manager, "stages_eager_batches", lambda _device, _dtype: True)
    # prefill sizes as the warm-up's own (in and past each row block, multiples of 16 and
    # not), at the scale of this worker's steps (at most CHUNK + MAX_RUNNING tokens)
    monkeypatch.setattr(warmup, "PREFILL_TOKENS", (16, 29, 48, 61))
    monkeypatch.setattr(_triton_utils, "SHRINK_OVERRIDE", (16, 4, 3))
    monkeypatch.setattr(_triton_utils, "MIN_K_PER_SPLIT", 16)
    monkeypatch.setattr(_triton_utils, "TARGET_PROGRAMS", 16)
    sms = 8

    def splits_for(tokens: int, kv_heads: int, _device: Any) -> int:
        want = attention.PROGRAMS_PER_SM * sms
        return min(attention.MAX_SPLITS, max(1, -(-want // max(1, tokens * kv_heads))))

    monkeypatch.setattr(attention, "splits_for", splits_for)


@pytest.fixture
def decode_attention_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Recorder]]:
    """Every one-token-per-row attention (a decode step's rows, the decode rows of a mixed
    step) also launches ``kernels.decode_attention``, as the CUDA path does, at the same
    operands, recorded by the recorder the test puts in the list and not run."""
    from loraplane.worker import kernels
    from loraplane.worker.models import model

    recorders: list[Recorder] = []
    cls = next(
        c for c in vars(model).values() if isinstance(c, type) and "_attend_one_each" in vars(c)
    )
    original = vars(cls)["_attend_one_each"]

    def attend(self: Any, q: Any, cache_rows: Any, positions: Any, kv: Any) -> Any:
        if recorders:
            with recorders[0].shadowing():
                kernels.decode_attention(
                    q,
                    kv.k[self.layer],
                    kv.v[self.layer],
                    kv.page_table,
                    cache_rows,
                    positions + 1,
                    self.scale,
                )
        return original(self, q, cache_rows, positions, kv)

    monkeypatch.setattr(cls, "_attend_one_each", attend)
    yield recorders


def _serve(engine: Any, adapters: list[str | None], seed: int) -> int:
    """A seeded random workload in waves: each wave submits 1..MAX_RUNNING + 2 requests of
    1..2 x CHUNK + 5 prompt tokens and 1..10 new tokens, some greedy and some sampled, and waits
    for a random share of them, so that prompts arrive while others decode. Returns the
    requests served."""
    rng = random.Random(seed)
    vocab = engine.executor.model_config.vocab_size
    pending: list[threading.Event] = []
    served = 0
    for wave in range(6):
        for i in range(rng.randint(1, MAX_RUNNING + 2)):
            done = threading.Event()
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 2 * CHUNK + 5))]
            sampled = rng.random() < 0.3
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 10),
                temperature=0.8 if sampled else 0.0,
                top_p=0.9 if sampled else 1.0,
                top_k=rng.choice((0, 20)) if sampled else 0,
                seed=rng.choice((None, 3)) if sampled else None,
                ignore_eos=True,
            )

            def sink(event: Any, done: threading.Event = done) -> None:
                assert event.error is None, event.error
                if event.finished:
                    done.set()

            engine.submit(f"w{wave}-{i}", prompt, params, rng.choice(adapters), sink)
            pending.append(done)
            served += 1
        # let some finish and others run on while the next wave's prompts come in
        keep = rng.randint(0, len(pending))
        for done in pending[keep:]:
            assert done.wait(120), "a request did not finish"
        pending = pending[:keep]
        time.sleep(rng.random() * 0.05)
    for done in pending:
        assert done.wait(120), "a request did not finish"
    return served


@pytest.mark.parametrize("rows_kernel_min", [None, 24], ids=["tiles", "row-blocks-from-24"])
def test_a_served_workload_launches_no_kernel_variant_the_warm_up_did_not(  # type: ignore[no-untyped-def]
    suite,
    gpu_shaped: None,
    decode_attention_on_cpu: list[Recorder],
    monkeypatch: pytest.MonkeyPatch,
    rows_kernel_min: int | None,
) -> None:
    """``row-blocks-from-24``: staged steps of 24 rows or more run the fused epilogues and the
    rotation by row blocks (``BY_ROWS``), as a GPU's staged steps of ``ROWS_KERNEL_MIN`` rows
    or more do (prompt-step graphs past 4,096 tokens, ``--graph-max-tokens``)."""
    if rows_kernel_min is not None:
        from loraplane.worker.kernels import stacked
        from loraplane.worker.lora import batch_info

        monkeypatch.setattr(stacked, "ROWS_KERNEL_MIN", rows_kernel_min)
        monkeypatch.setattr(batch_info, "ROWS_KERNEL_MIN", rows_kernel_min)
    model_dir, adapter_dirs = suite["llama"]
    config = ServeConfig(
        model=str(model_dir),
        warmup=True,
        lora_backend="triton",
        sampler="triton",
        max_running=MAX_RUNNING,
        max_loras_per_batch=SLOTS,
        stage_slots=STAGE,
        max_loaded_loras=4,
        max_lora_rank=16,
        max_model_len=160,
        chunked_prefill_size=CHUNK,
        graph_max_tokens=GRAPH_TOKENS,
        engine_process=False,
    )
    with record_keys() as recorder:
        decode_attention_on_cpu.append(recorder)
        recorder.phase = "warm-up"
        engine = build_engine(config)
        assert isinstance(engine.executor, LocalExecutor)  # (engine_process=False, one rank)
        runner = engine.executor.runner
        decode_graphs, prompt_graphs = runner.graphs, runner.prompt_graphs
        assert decode_graphs is not None and prompt_graphs is not None
        warmed_graphs = (set(decode_graphs._graphs), prompt_graphs.keys)
        replays = prompt_graphs.replays
        try:
            recorder.phase = "serving"
            engine.start()
            names = [name for name, _ in adapter_dirs if name != "a32"]  # (ranks up to 16)
            for name, path in adapter_dirs:
                if name in names:
                    assert engine.load_adapter(name, str(path)).result().success
            served = _serve(engine, [None, *names], seed=7)
        finally:
            engine.stop()
    warmed, serving = recorder.seen("warm-up"), recorder.seen("serving")
    assert served > 20 and len(serving) > 10  # (the workload launched kernels)
    assert any(key[0] == "_decode_attention_kernel" for key in serving)
    by_rows = any(
        key[0] == "_stacked_lora_kernel" and ("BY_ROWS", "constexpr", True) in key[1]
        for key in serving
    )
    assert by_rows == (rows_kernel_min is not None)  # (the row blocks past the patched size)
    missing = sorted(describe(key) for key in serving - warmed)
    assert missing == [], (
        f"{len(missing)} Triton kernel variants would compile after the warm-up:\n"
        + "\n".join(missing)
    )
    # nothing is captured after the warm-up either: every decode and prompt step the
    # workload ran had its graph already (and prompt steps did replay them)
    assert prompt_graphs.replays > replays
    assert (set(decode_graphs._graphs), prompt_graphs.keys) == warmed_graphs


@pytest.mark.parametrize(("hidden", "block_k"), [(4096, 128), (14336, 128), (2048, 64), (64, 16)])
def test_grids_of_one_split_class_give_every_projection_the_same_split(
    hidden: int, block_k: int
) -> None:
    """The warm-up runs one grid per ``split_class``: every grid of that class must give a
    shrink of each slice count the same K split (the kernel's constexpr), whatever its cap."""
    from loraplane.worker.kernels._triton_utils import split_class, split_k_for

    by_class: dict[tuple[int, ...], tuple[int, ...]] = {}
    for grid in range(1, 300):
        splits = tuple(split_k_for(grid * s, hidden, block_k) for s in (1, 2, 3))
        assert by_class.setdefault(split_class(grid), splits) == splits, grid


@pytest.mark.parametrize(
    ("max_rows", "max_len", "segments", "longest"),
    [(64, 4096, 32, 4160), (8, 160, 2, 48), (6, 40, 6, 234), (256, 2048, 16, 4352)],
)
def test_the_eager_lora_steps_meet_every_row_block_and_split_class(
    max_rows: int, max_len: int, segments: int, longest: int
) -> None:
    """Every (row block, split class) an eager step can launch the shrink at (its longest
    segment of 1..``longest`` rows over rows of ``max_len - 1``, 1..``segments`` segments,
    at most ``max_rows`` rows) is met by one of ``lora_shapes``' steps, and they meet no other."""
    from loraplane.worker.engine.warmup import lora_shapes
    from loraplane.worker.kernels._triton_utils import cdiv, segment_block, split_class

    def key(length: int, count: int) -> tuple[int, tuple[int, ...]]:
        block = segment_block(length)
        return block, split_class(cdiv(length, block) * count)

    reachable = {
        key(length, count)
        for length in range(1, longest + 1)
        for count in range(1, segments + 1)
        if cdiv(length, max_len - 1) + count - 1 <= max_rows
    }
    steps = lora_shapes(max_rows, max_len, segments, longest)
    assert {key(length, count) for length, count in steps} == reachable
    assert len(steps) == len(reachable)  # (one step each)


def test_the_mixed_steps_meet_every_decode_attention_split_count() -> None:
    """One mixed step per split count the decode attention picks for 1..63 one-token rows
    (here an H200's rule: 132 multiprocessors, 8 KV heads), and every count where the rule
    is not known."""
    from loraplane.worker.engine.warmup import single_row_counts

    def splits(n: int) -> int:
        return min(16, max(1, -(-4 * 132 // (n * 8))))

    counts = single_row_counts(63, splits)
    assert {splits(n) for n in counts} == {splits(n) for n in range(1, 64)}
    assert len(counts) == len({splits(n) for n in counts}) < 16
    assert single_row_counts(5, None) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("width", [0, 1, 2, 4])
def test_every_part_of_a_static_lora_batch_is_16_byte_aligned(width: int) -> None:
    """An eager staged batch's static buffers are sized by its own row count; a part that
    is 16-byte aligned at some counts and not at others would be a kernel variant per
    alignment (Triton specializes pointers on it), which no warm-up of a few sizes meets."""
    import torch

    from loraplane.worker.lora.batch_info import StaticLoRABatch

    ranks, scalings = torch.tensor([8, 16], dtype=torch.int32), torch.tensor([1.0, 2.0])
    for rows in range(1, 11):
        for segments in (1, 2, 3):
            batch = StaticLoRABatch(
                rows, segments, ranks, scalings, torch.device("cpu"), stage_width=width
            )
            used = 2 if segments > 1 and width != 1 else 1  # (adapters in the batch)
            slots = [i % used for i in range(rows)]
            batch.fill(slots, positions={0: 0, 1: width - 1} if width else None)
            info = batch.info()
            parts = [info.token_slots, info.seg_indptr, info.seg_slots, info.seg_ranks]
            parts += [info.seg_scalings, info.row_order]
            if info.stage is not None:
                parts += [info.stage.row_pos, info.stage.pos_slots, info.stage.pos_scalings]
            assert [p.data_ptr() % 16 for p in parts] == [0] * len(parts), (rows, segments)
            assert info.token_slots.tolist() == slots
            distinct = min(used, rows)
            assert info.seg_ranks.tolist()[:distinct] == [8, 16][:distinct]
