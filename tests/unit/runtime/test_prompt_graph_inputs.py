"""What a captured prompt step reads: static, padded inputs, attention work lists and LoRA
metadata (engine/prompt_graphs.py).

Capture needs a GPU (tests/gpu); here ``PromptGraphs(capture=False)`` runs the same
static-buffer steps eagerly on the CPU, the prompt attention and the LoRA kernels through
Triton's interpreter, and every step must give the logits of the ordinary eager step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.prompt_graphs import PromptGraphs, prompt_buckets
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig, prefill_batch
from loraplane.worker.lora.batch_info import NO_ADAPTER
from loraplane.worker.models.batch import ForwardBatch, SeqChunk
from loraplane.worker.models.model import Attention

pytestmark = pytest.mark.unit

SPARE = 8  # the spare page-table row: the runners below run 8 sequences at most
LONG = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


@pytest.fixture(autouse=True)
def prompt_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks through ``extend_attention`` (interpreted), as on a GPU, eager or not."""
    monkeypatch.setattr(Attention, "prompt_kernel", True)


@pytest.fixture(scope="module", params=["llama", "qwen3-moe"])
def runner(request, suite) -> Iterator[ModelRunner]:  # type: ignore[no-untyped-def]
    """A runner of 8 sequences with the decode graphs' static steps, so its KV cache has the
    spare row (``SPARE``) that graphs pad into, as a GPU runner's."""
    model_dir, adapters = suite[request.param]
    cfg = RunnerConfig(str(model_dir), lora_backend="triton", max_seqs=SPARE, max_len=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLANE_CPU_STATIC_DECODE", "1")
        r = ModelRunner(
            cfg, LoRARuntimeConfig(max_loras_per_batch=4, max_loaded_loras=4, max_lora_rank=32)
        )
    assert r.graphs is not None and r.kv.page_table.shape[0] == SPARE + 1
    r.graphs = None  # (decode steps eagerly: these tests compare prompt steps)
    for slot, (name, path) in enumerate(adapters[:3]):
        r.lora.load_slot(slot, r.read_adapter(name, path))  # type: ignore[union-attr]
    yield r


def mixed_step(r: ModelRunner, decode_ids: tuple[int, int] = (11, 12)) -> ForwardBatch:
    """Rows 0 and 1 hold a prompt each and row 3 the first two tokens of LONG (an eager
    prefill); then a step of row 0's decode, a whole new prompt in row 2, row 1's decode and
    LONG's next seven tokens past its cached prefix in row 3."""
    saved, r.prompt_graphs = r.prompt_graphs, None
    try:
        r.forward(
            prefill_batch(
                [[5, 9, 200], [44, 2], LONG[:2]], [0, 1, 3], all_logits=False, device="cpu"
            )
        )
    finally:
        r.prompt_graphs = saved
    tokens = [[decode_ids[0]], [7, 7, 7, 7, 8], [decode_ids[1]], LONG[2:9]]
    chunks = [
        SeqChunk(cache_row=0, start=3, length=1, token_offset=0),
        SeqChunk(cache_row=2, start=0, length=5, token_offset=1),
        SeqChunk(cache_row=1, start=2, length=1, token_offset=6),
        SeqChunk(cache_row=3, start=2, length=7, token_offset=7),
    ]
    return ForwardBatch.from_chunks(tokens, chunks, all_logits=False, device="cpu")


def token_slots(per_chunk: list[int]) -> list[int]:
    return [s for s, n in zip(per_chunk, (1, 5, 1, 7), strict=True) for _ in range(n)]


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "past-the-stage"])
@pytest.mark.parametrize(
    "per_chunk",
    [[NO_ADAPTER, 1, 0, 1], [2, 2, 2, 2], [NO_ADAPTER] * 4, [0, 1, 2, NO_ADAPTER]],
    ids=["interleaved", "one", "none", "three"],
)
def test_a_static_prompt_step_gives_the_eager_steps_logits(
    runner: ModelRunner, per_chunk: list[int], staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged (the stacked GEMMs and fused epilogues, as a batch whose adapters fit the stage
    runs) or past the stage (the shrink and expand kernels, as a batch of more adapters), the
    static step gives the eager step's logits (which run the kernels)."""
    assert runner.lora is not None
    if not staged:  # (as when the batch's adapters do not fit the stage)
        monkeypatch.setattr(runner.lora, "assign_stage", lambda _slots: (None, 0, 0))
    slots = token_slots(per_chunk)
    want = runner.forward(mixed_step(runner), slots).clone()
    graphs = runner.prompt_graphs = PromptGraphs(runner, 64, SPARE, capture=False)
    try:
        got = runner.forward(mixed_step(runner), slots).clone()  # 14 tokens: the 64 bucket
    finally:
        runner.prompt_graphs = None
    assert graphs.replays == 1
    assert got.shape == want.shape == (4, runner.model_config.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    adapters = {s for s in per_chunk if s != NO_ADAPTER}
    if not adapters:
        assert graphs.keys == {(64, None)}
        return
    count = 1 << (len(adapters) - 1).bit_length()
    ((bucket, shape),) = graphs.keys
    assert shape is not None and (bucket, shape[0]) == (64, count)
    if staged:  # the stage's width covers the adapters' positions, at the stage's rank
        assert shape[1] >= len(adapters) and shape[2] == runner.lora.stage.rank > 0
    else:
        assert shape[1:] == (0, 0)


def test_carried_tokens_reach_a_static_prompt_steps_decode_rows(runner: ModelRunner) -> None:
    """An overlapped step's decode rows take the previous step's sampled ids on the device
    (``carry``): the static prompt step reads them as it reads ids sent from the host."""
    slots = token_slots([NO_ADAPTER, 1, 0, 1])
    want = runner.forward(mixed_step(runner), slots).clone()
    # the previous step sampled [12, 99, 11]: its rows 2 and 0 are the decode rows' inputs
    carry = (torch.tensor([12, 99, 11]), torch.tensor([[0, 6], [2, 0]]))
    graphs = runner.prompt_graphs = PromptGraphs(runner, 64, SPARE, capture=False)
    try:
        got = runner.forward(mixed_step(runner, (0, 0)), slots, carry).clone()
    finally:
        runner.prompt_graphs = None
    assert graphs.replays == 1
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_steps_a_graph_cannot_hold_run_eagerly(runner: ModelRunner) -> None:
    """A step of as many tokens as the largest bucket, a step that wants the logits of
    other rows (prompt log-probabilities) and a pure decode step are not prompt graphs'."""
    graphs = PromptGraphs(runner, 14, SPARE, capture=False)
    batch = mixed_step(runner)  # 14 tokens: no padding row left in the bucket of 14
    assert not graphs.supports(batch)
    assert PromptGraphs(runner, 15, SPARE, capture=False).supports(batch)
    batch.logit_rows = torch.arange(14)
    assert not PromptGraphs(runner, 64, SPARE, capture=False).supports(batch)
    decode = ForwardBatch.from_chunks(
        [[1], [2]],
        [SeqChunk(0, 3, 1, 0), SeqChunk(1, 2, 1, 1)],
        all_logits=False,
        device="cpu",
    )
    assert not graphs.supports(decode)


def test_a_step_of_every_running_sequence_fits_its_bucket(runner: ModelRunner) -> None:
    """The most chunks a step can have (one per running sequence, eight here) fit the
    bucket's fixed counts (prompt tiles and logit rows), with the eager logits."""
    prompts = [[10 + i, 20 + i] for i in range(8)]
    batch = prefill_batch(prompts, list(range(8)), all_logits=False, device="cpu")
    slots = [i % 3 for i in range(8) for _ in range(2)]
    want = runner.forward(batch, slots).clone()
    graphs = runner.prompt_graphs = PromptGraphs(runner, 64, SPARE, capture=False)
    try:
        batch = prefill_batch(prompts, list(range(8)), all_logits=False, device="cpu")
        got = runner.forward(batch, slots).clone()
    finally:
        runner.prompt_graphs = None
    assert graphs.replays == 1
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_buckets_cover_every_prompt_step_up_to_the_largest() -> None:
    assert prompt_buckets(0) == []
    assert prompt_buckets(64) == [64]
    assert prompt_buckets(100) == [64, 100]
    assert prompt_buckets(1024) == [64, 128, 256, 384, 512, 640, 768, 896, 1024]
    with pytest.raises(ValueError, match=">= 0 tokens"):
        prompt_buckets(-1)


def test_the_largest_prompt_graph_is_a_runner_setting(suite) -> None:  # type: ignore[no-untyped-def]
    model_dir, _ = suite["llama"]
    with pytest.raises(ValueError, match="graph_max_tokens must be >= 0"):
        RunnerConfig(str(model_dir), graph_max_tokens=-1)
    # a CPU runner without the static steps' switch has no prompt graphs
    assert ModelRunner(RunnerConfig(str(model_dir), max_seqs=2, max_len=16)).prompt_graphs is None
