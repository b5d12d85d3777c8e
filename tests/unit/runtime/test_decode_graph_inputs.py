"""What a captured decode step reads: static, padded inputs and LoRA metadata (engine/graphs.py).

Graph capture itself needs a GPU (tests/gpu); here `DecodeGraphs(capture=False)` runs the
same static-buffer steps eagerly on the CPU, with the Triton LoRA kernels interpreted, and
must give every real row the logits of the ordinary eager step.
"""

from __future__ import annotations

import pytest
import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.graphs import DecodeGraphs, graph_buckets, graphs_enabled
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, decode_batch, prefill_batch
from loraplane.worker.kernels._triton_utils import (
    ROWS_KERNEL_MIN,
    TILE_ROWS,
    TILE_WORDS,
    stage_tile_capacity,
    stage_tiles,
)
from loraplane.worker.lora.batch_info import (
    NO_ADAPTER,
    StaticLoRABatch,
    segments_of,
    static_shape,
)

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 200, 31], [44, 2, 2], [7, 7, 7, 7, 8], [90, 1]]


@pytest.fixture(scope="module", params=["llama", "qwen3-moe"])
def runner(request, suite) -> ModelRunner:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite[request.param]
    cfg = RunnerConfig(str(model_dir), lora_backend="triton", max_seqs=6, max_len=32)
    r = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    )
    for slot, (name, path) in enumerate(adapters[1:]):  # ranks 8, 16, 32
        r.lora.load_slot(slot, r.read_adapter(name, path))  # type: ignore[union-attr]
    return r


def decode_step(r: ModelRunner, tokens: list[int]) -> object:
    """Prefill every prompt into rows 0..3, then one decode batch of those rows."""
    r.forward(prefill_batch(PROMPTS, [0, 1, 2, 3], all_logits=False, device="cpu"))
    return decode_batch(tokens, [0, 1, 2, 3], [len(p) for p in PROMPTS], "cpu")


@pytest.mark.parametrize(
    "slots",
    [
        [NO_ADAPTER, 1, 0, 1],  # adapters interleaved with a base row
        [2, 2, 2, 2],  # one adapter
        [NO_ADAPTER] * 4,  # no adapter: the LoRA-off step
    ],
    ids=["mixed", "one", "none"],
)
def test_static_padded_step_matches_the_eager_step(runner: ModelRunner, slots: list[int]) -> None:
    tokens = [11, 12, 13, 14]
    want = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    # max_batch 8: the 4-row batch replays the bucket of 4 and a 3-row prefix the bucket of 4
    # with one padding row in the spare cache row 5.
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    runner.graphs = graphs
    try:
        # A graph step's logits are a view the next step rewrites: keep copies.
        got = runner.forward(decode_step(runner, tokens), slots).clone()  # type: ignore[arg-type]
        got3 = runner.forward(first_rows(runner, tokens, 3), slots[:3]).clone()  # type: ignore[arg-type]
    finally:
        runner.graphs = None
    assert graphs.replays == 2
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(got3, want[:3], rtol=0, atol=2e-5)
    # the adapters were staged: the static steps took the stacked-GEMM path
    used = {s for s in slots if s != NO_ADAPTER}
    assert used <= set(runner.lora.stage.slot_at)  # type: ignore[union-attr]
    assert all(shape[2] > 0 for _, shape in graphs._graphs if shape is not None)


def test_carried_tokens_are_the_host_tokens_eagerly_and_in_the_static_step(
    runner: ModelRunner,
) -> None:
    """Overlapped steps (ADR 0014) feed decode rows the previous step's sampled ids on the
    device (``carry``): eagerly and through the static graph buffers, the logits are those of
    the same ids sent from the host."""
    slots = [NO_ADAPTER, 1, 0, 1]
    want = runner.forward(decode_step(runner, [11, 12, 13, 14]), slots).clone()  # type: ignore[arg-type]
    # the previous step sampled [99, 13, 77, 11]: its rows 3 and 1 are rows 0 and 2's inputs
    carry = (torch.tensor([99, 13, 77, 11]), torch.tensor([[0, 2], [3, 1]]))
    host = [0, 12, 0, 14]  # (placeholders where carried)
    eager = runner.forward(decode_step(runner, host), slots, carry).clone()  # type: ignore[arg-type]
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    runner.graphs = graphs
    try:
        static = runner.forward(decode_step(runner, host), slots, carry).clone()  # type: ignore[arg-type]
    finally:
        runner.graphs = None
    assert graphs.replays == 1
    torch.testing.assert_close(eager, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(static, want, rtol=0, atol=2e-5)


def test_more_adapters_than_stage_positions_run_the_shrink_kernels(suite) -> None:  # type: ignore[no-untyped-def]
    """With 2 stage positions (of rank 32, the slots' and the batches' stage rank: a rank-32
    adapter in each), a 3-adapter batch is not staged (width 0) and a 2-adapter batch is;
    both give the eager step's logits, and staging the second evicts nothing it needs."""
    model_dir, adapters = suite["llama"]
    cfg = RunnerConfig(str(model_dir), lora_backend="triton", max_seqs=6, max_len=32)
    r = ModelRunner(
        cfg,
        LoRARuntimeConfig(
            max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32, stage_slots=2
        ),
    )
    for slot, (name, path) in enumerate(adapters[1:]):  # ranks 8, 16, 32
        r.lora.load_slot(slot, r.read_adapter(name, path))  # type: ignore[union-attr]
    tokens = [11, 12, 13, 14]
    three, two = [2, 1, 0, 1], [NO_ADAPTER, 2, 0, 0]
    want = {n: r.forward(decode_step(r, tokens), s) for n, s in (("3", three), ("2", two))}  # type: ignore[arg-type]
    graphs = r.graphs = DecodeGraphs(r, 8, spare_row=5, capture=False)
    for name, slots in (("3", three), ("2", two), ("3", three)):
        got = r.forward(decode_step(r, tokens), slots)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want[name], rtol=0, atol=2e-5, msg=name)
    widths = sorted(shape[2] for _, shape in graphs._graphs if shape is not None)
    assert widths == [0, 2]
    assert sorted(s for s in r.lora.stage.slot_at if s is not None) == [0, 2]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("arch", "slots", "rank", "stage_slots", "positions"),
    [
        ("llama", 8, 16, None, 8),
        ("llama", 32, 64, None, 32),
        ("llama", 16, 64, None, 16),
        ("llama", 32, 64, 4, 16),
        ("qwen3-moe", 8, 16, None, 8),
        ("qwen3-moe", 8, 16, 16, 8),
        ("qwen3-moe", 8, 16, 2, 2),
    ],
)
def test_the_stage_positions_default_by_model(  # type: ignore[no-untyped-def]
    suite, arch: str, slots: int, rank: int, stage_slots: int | None, positions: int
) -> None:
    """Unset, a dense model stages every GPU slot's adapter at rank 16 (K * 16 / R positions
    of the buffers' rank, from 4 to 8: 32 rank-16 positions at K = 32, R = 64; 16 at K = 16),
    and one with routed experts (only its attention projections stack) 16 positions, never
    more than the GPU slots; a value given wins. (Positions are counted at rank 16 here.)"""
    model_dir, _ = suite[arch]
    cfg = RunnerConfig(str(model_dir), lora_backend="triton", max_seqs=4, max_len=16)
    lora = LoRARuntimeConfig(
        max_loras_per_batch=slots,
        max_loaded_loras=slots,
        max_lora_rank=rank,
        stage_slots=stage_slots,
    )
    assert ModelRunner(cfg, lora).lora.stage.positions == positions  # type: ignore[union-attr]


def test_repeated_and_alternating_batches_reuse_metadata_correctly(runner: ModelRunner) -> None:
    """Steady decode repeats the last step's adapters (the metadata copy is skipped); a batch
    that changes them, then changes back, must still see its own adapters."""
    tokens = [11, 12, 13, 14]
    mixed, other = [NO_ADAPTER, 1, 0, 1], [0, 0, 1, 1]  # the same graph shape (2 adapters)
    want = {
        name: runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
        for name, slots in (("mixed", mixed), ("other", other))
    }
    runner.graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    try:
        for name, slots in (("mixed", mixed), ("mixed", mixed), ("other", other), ("mixed", mixed)):
            got = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
            torch.testing.assert_close(got, want[name], rtol=0, atol=2e-5, msg=name)  # read now
    finally:
        runner.graphs = None


def first_rows(r: ModelRunner, tokens: list[int], n: int) -> object:
    decode_step(r, tokens)  # the same cache contents as the 4-row step
    return decode_batch(tokens[:n], list(range(n)), [len(p) for p in PROMPTS[:n]], "cpu")


def test_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    with pytest.raises(ValueError, match="the largest graph batch must be >= 1, got 0"):
        graph_buckets(0)


def test_static_lora_batch_pads_segments_and_rows() -> None:
    ranks = torch.tensor([8, 16, 4], dtype=torch.int32)
    scalings = torch.tensor([1.0, 2.0, 0.5])
    static = StaticLoRABatch(8, 3, ranks, scalings, torch.device("cpu"))
    static.fill([2, NO_ADAPTER, 0, 2, 0])
    assert static.token_slots.tolist() == [2, -1, 0, 2, 0, -1, -1, -1]
    assert static.seg_indptr.tolist() == [0, 2, 4, 4]  # slot 0: rows 2, 4; slot 2: rows 0, 3
    assert static.seg_slots.tolist() == [0, 2, 0]  # the padding segment is empty
    assert static.row_order[:4].tolist() == [2, 4, 0, 3]
    info = static.info()
    assert info.seg_ranks.tolist() == [8, 4, 8] and info.max_seg_len == 8
    assert info.seg_scalings.tolist() == [1.0, 0.5, 1.0]  # read back from the slot tensors
    # The runtime passes the host's values: they are what the step reads, with no gather.
    static.fill([2, NO_ADAPTER, 0, 2, 0], slot_values=([3, 5, 7], [0.25, 4.0, 1.5]))
    info = static.info()
    assert info.seg_ranks.tolist() == [3, 7, 3] and info.seg_scalings.tolist() == [0.25, 1.5, 0.25]
    assert info.seg_ranks.data_ptr() == static.seg_ranks.data_ptr()  # a view, no kernel
    with pytest.raises(ValueError, match="a batch of 9 rows does not fit a graph of 8 rows"):
        static.fill([0] * 9)
    few = StaticLoRABatch(4, 2, ranks, scalings, torch.device("cpu"))  # 2 segments
    with pytest.raises(ValueError, match="3 adapters in a batch of 4 rows; the graph has 2"):
        few.fill([0, 1, 2, 2])


def test_static_lora_batch_gives_each_row_its_stage_position() -> None:
    """A staged graph's epilogues read each row's stage position and each position's B (the
    stage's, at the position: ``LoRALayer.staged_b``) and scaling; a position this batch does
    not read names no B."""
    ranks = torch.tensor([8, 16, 4], dtype=torch.int32)
    static = StaticLoRABatch(
        6, 2, ranks, torch.zeros(3), torch.device("cpu"), stage_width=4, stage_rank=16
    )
    values = ([8, 16, 4], [1.0, 2.0, 0.5])
    static.fill([2, NO_ADAPTER, 0, 2], positions={0: 3, 2: 0, 1: 1}, slot_values=values)
    stage = static.info().stage
    assert stage is not None and (stage.width, stage.rank) == (4, 16)
    assert stage.row_pos.tolist() == [0, -1, 3, 0, -1, -1]  # padding rows: no adapter
    assert stage.pos_slots.tolist() == [0, -1, -1, 3]  # slot 1 sits at 1, unread here
    assert stage.pos_scalings.tolist() == [0.5, 0.0, 0.0, 1.0]
    assert static.seg_scalings.tolist() == [1.0, 0.5]  # the segments' view beside it
    # the rows by position in tiles of 16: position 0 (slot 2), 3 (slot 0), then the rows
    # with no adapter, the graph's padding rows among them; then padding tiles
    assert stage.tiles is not None
    tiles = stage.tiles.view(-1, TILE_WORDS).tolist()
    assert len(tiles) == stage_tile_capacity(6, 4) == 6
    half = torch.tensor([0.5, 1.0]).view(torch.int32).tolist()
    assert [(t[:TILE_ROWS], t[TILE_ROWS:]) for t in tiles[:3]] == [
        ([0, 3, *[-1] * 14], [0, 0, half[0], 0]),
        ([2, *[-1] * 15], [3, 3, half[1], 0]),
        ([1, 4, 5, *[-1] * 13], [-1, -1, 0, 0]),
    ]
    assert all(t == [-1] * (TILE_ROWS + 2) + [0, 0] for t in tiles[3:])
    static.fill([1, 1], positions={1: 2}, slot_values=values)  # refilled in place
    assert stage.row_pos.tolist() == [2, 2, -1, -1, -1, -1]
    assert stage.pos_slots.tolist() == [-1, -1, 2, -1]
    assert [t[: TILE_ROWS + 2] for t in stage.tiles.view(-1, TILE_WORDS).tolist()[:2]] == [
        [0, 1, *[-1] * 14, 2, 2],
        [2, 3, 4, 5, *[-1] * 12, -1, -1],
    ]
    with pytest.raises(ValueError, match="positions must give a stage position for every slot"):
        static.fill([0, 1], positions={1: 2})
    with pytest.raises(ValueError, match=r"positions must lie in 0..3"):
        static.fill([0], positions={0: 4})
    with pytest.raises(ValueError, match=r"its own stage position, got \{0: 1, 2: 1\}"):
        static.fill([0, 2], positions={0: 1, 2: 1})


def test_stage_tiles_split_each_positions_rows_and_fit_their_capacity() -> None:
    """A position's rows past 16 go on in another tile; rows at a position with no slot or
    past the width get the base's tile; the capacity is the most any layout needs, and a
    layout past it is refused. A prompt-step graph's staged batch has tiles too; one of
    ``ROWS_KERNEL_MIN`` rows or more has none (its epilogues run by row blocks)."""
    bits = [11, 22]
    rows = [0] * 17 + [1] * 3 + [5, -1] + [1]  # position 5 is past the width of 2
    tiles = stage_tiles(rows, [7, 8], bits, stage_tile_capacity(len(rows), 2))
    got = [
        (t[:TILE_ROWS], t[TILE_ROWS:]) for t in torch.tensor(tiles).view(-1, TILE_WORDS).tolist()
    ]
    assert got[0] == (list(range(16)), [0, 7, 11, 0])
    assert got[1] == ([16, *[-1] * 15], [0, 7, 11, 0])
    assert got[2] == ([17, 18, 19, 22, *[-1] * 12], [1, 8, 22, 0])
    assert got[3] == ([20, 21, *[-1] * 14], [-1, -1, 0, 0])
    assert len(got) == stage_tile_capacity(len(rows), 2) == 5
    no_slot = stage_tiles([0, 1], [7, -1], bits, 3)  # position 1 names no slot: base rows
    assert no_slot[TILE_WORDS : TILE_WORDS + 2] == [1, -1]
    assert no_slot[TILE_WORDS + TILE_ROWS : TILE_WORDS + TILE_ROWS + 2] == [-1, -1]
    worst = [p for p in range(4) for _ in range(17)] + [-1]  # every group one row past a tile
    assert len(stage_tiles(worst, [0, 1, 2, 3], [0] * 4, stage_tile_capacity(69, 4))) > 0
    with pytest.raises(ValueError, match="9 stage tiles do not fit a capacity of 8"):
        stage_tiles(worst, [0, 1, 2, 3], [0] * 4, 8)
    ranks = torch.tensor([16], dtype=torch.int32)
    for rows, tiled in ((1024, True), (ROWS_KERNEL_MIN, False)):
        prompt = StaticLoRABatch(
            rows, 1, ranks, torch.ones(1), torch.device("cpu"), stage_width=4, stage_rank=16
        )
        prompt.fill([0] * 300, positions={0: 0}, slot_values=([16], [1.0]))
        stage = prompt.info().stage
        assert stage is not None and (stage.tiles is not None) == tiled
        if tiled:  # 300 rows at position 0 in 19 tiles, then the graph's padding rows
            assert stage.tiles is not None
            tiles = stage.tiles.view(-1, TILE_WORDS)
            assert tiles[:20, TILE_ROWS].tolist() == [0] * 19 + [-1]
            assert tiles[18, :TILE_ROWS].tolist() == [*range(288, 300), *[-1] * 4]


def test_lora_graphs_are_keyed_by_adapter_count_and_longest_segment() -> None:
    """One adapter launches one segment's programs; 3 adapters get 4 segments; a 40-row
    segment needs the bucket's row bound."""
    assert static_shape(segments_of([0] * 16), 16) == (1, 16)
    assert static_shape(segments_of([0, 1, 2, -1] * 4), 16) == (4, 16)
    assert static_shape(segments_of([0] * 20 + [1] * 4), 32) == (2, 32)
    assert static_shape(segments_of([0] * 40 + [-1] * 24), 64) == (1, 64)
    assert static_shape(segments_of([0, 1, 2]), 4) == (4, 4)  # never more rows than the bucket
    static = StaticLoRABatch(
        64, 2, torch.zeros(2, dtype=torch.int32), torch.zeros(2), torch.device("cpu"), 16
    )
    with pytest.raises(
        ValueError, match="a segment of 20 rows; the graph's segments hold at most 16"
    ):
        static.fill([0] * 20)


def test_backend_names_a_bad_kernel_family_or_overlap_mode() -> None:
    from loraplane.worker.lora.backend import LoRABackend

    with pytest.raises(ValueError, match="LoRA backend 'cuda' is not supported; expected 'triton'"):
        LoRABackend("cuda")
    with pytest.raises(ValueError, match="LoRA overlap 'always' is not supported; expected 'auto'"):
        LoRABackend("triton", overlap="always")  # type: ignore[arg-type]
    # On the CPU nothing overlaps, whatever the mode: the work runs at once, in order.
    aside = LoRABackend("triton", overlap="on").run_aside(torch.zeros(1), lambda: 7)
    assert aside.stream is None and aside.result() == 7


def test_graphs_only_where_a_capture_can_hold_the_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_enabled(True, cuda, "triton")  # (one rank or many: each rank its own)
    assert graphs_enabled(True, cuda, None)  # no LoRA at all
    assert not graphs_enabled(False, cuda, "triton")  # --no-cuda-graphs
    assert not graphs_enabled(True, cpu, "triton")
    # The torch reference kernels read segment bounds back to the host: never captured.
    assert not graphs_enabled(True, cuda, "torch")
    # The tests' switch: the CPU runs the static steps without capture, when asked for graphs
    monkeypatch.setenv("LORAPLANE_CPU_STATIC_DECODE", "1")
    assert graphs_enabled(True, cpu, "triton")
    assert not graphs_enabled(False, cpu, "triton")
    assert not graphs_enabled(True, cpu, "torch")


def test_a_cpu_runner_never_replays_graphs(runner: ModelRunner) -> None:
    assert runner.graphs is None


def test_a_shape_whose_capture_fails_runs_eagerly_from_then_on(
    runner: ModelRunner, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    tokens, slots = [11, 12, 13, 14], [0, 1, NO_ADAPTER, 0]
    want = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    attempts = []

    def broken_capture(bucket, shape):  # type: ignore[no-untyped-def]
        attempts.append((bucket, shape))
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken_capture)
    runner.graphs = graphs
    try:
        for _ in range(2):
            got = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the eager step, exactly
    finally:
        runner.graphs = None
    assert len(attempts) == 1 and graphs.replays == 0  # tried once, then remembered


def test_a_rank_of_a_multirank_worker_raises_when_its_capture_fails(
    runner: ModelRunner, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """An eager step on one rank alone would leave its peers in another collective: the
    failure reaches the caller (the rank fails) and nothing is remembered as eager."""
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    graphs.multi_rank = True

    def broken_capture(bucket, shape):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken_capture)
    runner.graphs = graphs
    try:
        with pytest.raises(RuntimeError, match="stream is capturing"):
            runner.forward(decode_step(runner, [11, 12, 13, 14]), [0, 1, NO_ADAPTER, 0])  # type: ignore[arg-type]
    finally:
        runner.graphs = None
    assert not graphs._failed and graphs.replays == 0


def test_dp_slots_only_under_dp_attention(runner: ModelRunner) -> None:
    """A single-rank runner's graphs refuse a DP-attention exchange, naming what they hold."""
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    batch = decode_step(runner, [11, 12, 13, 14])
    with pytest.raises(
        ValueError, match=r"dp_slots must be given exactly under DP attention \(dp 1\), got 2"
    ):
        graphs.run(batch, [0, 0, 0, 0], dp_slots=[[0, 0, 0, 0], []])  # type: ignore[arg-type]
    assert graphs.replays == 0 and not graphs._graphs


def test_an_adapter_loaded_between_repeated_steps_is_used(runner: ModelRunner, suite) -> None:  # type: ignore[no-untyped-def]
    """The metadata cache keeps slots, not weights: a new adapter copied into slot 0 between
    two steps with the same slots must change the next step like the eager path."""
    _, adapters = suite["qwen3-moe" if runner.model_config.num_experts else "llama"]
    manager = runner.lora
    assert manager is not None
    tokens, slots = [11, 12, 13, 14], [0, 0, NO_ADAPTER, 1]
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    try:
        runner.graphs = graphs
        before = runner.forward(decode_step(runner, tokens), slots).clone()  # type: ignore[arg-type]
        name, path = adapters[3]
        manager.load_slot(0, runner.read_adapter(name, path))  # same slots, new weights
        after = runner.forward(decode_step(runner, tokens), slots).clone()  # type: ignore[arg-type]
        runner.graphs = None
        want = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    finally:
        runner.graphs = None
        first_name, first_path = adapters[0]
        manager.load_slot(0, runner.read_adapter(first_name, first_path))  # restore the fixture
    torch.testing.assert_close(after, want, rtol=0, atol=2e-5)
    assert (after[:2] - before[:2]).abs().max() > 1e-3  # slot 0's rows changed
    torch.testing.assert_close(after[2:], before[2:], rtol=0, atol=2e-5)  # the others did not


def test_a_slot_change_outside_the_batch_refills_the_metadata(
    runner: ModelRunner, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Ranks and scalings are written by the host: a step with the same slots and stage after
    any slot changed (here one the batch does not use, so no stage position moves) fills the
    static metadata again instead of reusing it; an unchanged one does not."""
    manager = runner.lora
    assert manager is not None
    graphs = DecodeGraphs(runner, 8, spare_row=5, capture=False)
    fills = []
    original = StaticLoRABatch.fill

    def counting_fill(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        fills.append(args[3] if len(args) > 3 else kwargs.get("slot_values"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StaticLoRABatch, "fill", counting_fill)
    manager.stage.forget(2)  # (an earlier test's batch may have staged it)
    slots = [0, 0, NO_ADAPTER, 1]
    graphs._lora_shape(slots, 4)
    graphs._lora_shape(slots, 4)
    assert len(fills) == 1  # the same slots, nothing changed: no host work
    adapter = manager.slot_adapters[2]
    assert adapter is not None
    epoch = manager.stage.epoch
    manager.clear_slot(2)
    try:
        assert manager.stage.epoch == epoch  # slot 2 was never staged by this batch
        graphs._lora_shape(slots, 4)
        assert len(fills) == 2 and fills[1] == manager.slot_values()
        assert fills[1][0][2] == 0  # the cleared slot's rank, from the host
    finally:
        manager.load_slot(2, adapter)


def test_a_higher_rank_adapter_restages_and_every_step_keeps_its_adapters(suite) -> None:  # type: ignore[no-untyped-def]
    """Slots 0/1/2 hold ranks 4/8/32. Staging slot 0 alone lays positions out for rank 16 (the
    floor); a batch that adds slot 2 restages at rank 32 (slot 0's copy moves); each static
    step still gives the eager step's logits, before and after."""
    model_dir, adapters = suite["llama"]
    cfg = RunnerConfig(str(model_dir), lora_backend="triton", max_seqs=6, max_len=32)
    r = ModelRunner(
        cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
    )
    for slot, (name, path) in enumerate([adapters[0], adapters[1], adapters[3]]):
        r.lora.load_slot(slot, r.read_adapter(name, path))  # type: ignore[union-attr]
    stage = r.lora.stage  # type: ignore[union-attr]
    tokens = [11, 12, 13, 14]
    low, both = [0, 0, NO_ADAPTER, 0], [0, 2, 2, NO_ADAPTER]
    want = {n: r.forward(decode_step(r, tokens), s) for n, s in (("low", low), ("both", both))}  # type: ignore[arg-type]
    r.graphs = DecodeGraphs(r, 8, spare_row=5, capture=False)
    ranks = []
    for name, slots in (("low", low), ("both", both), ("low", low)):
        got = r.forward(decode_step(r, tokens), slots)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want[name], rtol=0, atol=2e-5, msg=name)
        ranks.append(stage.rank)
    assert ranks == [16, 32, 32]


@pytest.mark.parametrize("slots", [[NO_ADAPTER, 1, 0, 1], [2, 2, 2, 2]], ids=["mixed", "one"])
def test_an_eager_step_stages_and_matches_the_unstaged_step(
    runner: ModelRunner, slots: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eager step whose adapters fit the stage runs the stage's GEMM and the fused
    epilogues (no graph involved) and gives the logits of the shrink + expand kernels; a
    batch of more rows than ``eager_stage_rows`` keeps the kernels. (On CUDA eager steps
    stage by default; on the CPU only when asked, as here: tests/gpu checks the CUDA bits.)"""
    lora = runner.lora
    assert lora is not None and lora.eager_stage_rows == 0  # the CPU default
    tokens = [11, 12, 13, 14]
    want = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    seen: list[object] = []  # the decode step's staged info (the prefill has no adapter)
    original = type(lora)._staged_info

    def spy(self, batch_slots, segments):  # type: ignore[no-untyped-def]
        info = original(self, batch_slots, segments)
        if list(batch_slots) == slots:
            seen.append(info)
        return info

    monkeypatch.setattr(type(lora), "_staged_info", spy)
    monkeypatch.setattr(lora, "eager_stage_rows", len(slots))
    got = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert len(seen) == 1 and seen[0] is not None
    assert seen[0].stage is not None and seen[0].exact_base  # type: ignore[attr-defined]
    used = {s for s in slots if s != NO_ADAPTER}
    assert used <= {s for s in lora.stage.slot_at if s is not None}

    seen.clear()
    monkeypatch.setattr(lora, "eager_stage_rows", len(slots) - 1)
    again = runner.forward(decode_step(runner, tokens), slots)  # type: ignore[arg-type]
    assert seen == [None]  # more rows than eager_stage_rows: the shrink and expand kernels
    torch.testing.assert_close(again, want, rtol=0, atol=2e-5)
