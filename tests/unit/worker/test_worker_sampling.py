"""Sampling parameters and the sampler."""

import pytest
import torch

from loraplane.worker.engine.sampling import SamplingError, SamplingParams, make_generator, sample

pytestmark = pytest.mark.unit


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(temperature=0), None) == 1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), None) == 1


def test_top_k_restricts_to_the_k_best() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0])
    gen = make_generator(0)
    seen = {sample(logits, SamplingParams(temperature=5.0, top_k=2), gen) for _ in range(200)}
    assert seen == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = make_generator(1)
    seen = {sample(logits, SamplingParams(top_p=0.7), gen) for _ in range(300)}
    assert seen == {0, 1}
    assert {sample(logits, SamplingParams(top_p=0.01), gen) for _ in range(50)} == {0}


def test_same_seed_same_tokens() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    b = [sample(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    assert a == b
    assert len(set(a)) > 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": -1}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_returns_full_logits_only_for_sequences_that_sample(dtype) -> None:
    from loraplane.worker.engine.executor import SeqWork, step_result

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[2, 7] = logits[2, 31] = 10.0  # a tie: the first index wins, as on the host before
    work = [SeqWork(i, 0, (1,), greedy=g) for i, g in enumerate([True, False, True, False])]
    result = step_result(logits, work)
    # every sequence's argmax (greedy ones need nothing else)
    rows = logits.float().tolist()
    assert result.argmax == [row.index(max(row)) for row in rows]
    assert result.argmax[2] == 7
    # the full rows of the two that sample, fp32 on the host, in work order
    assert result.sampled_logits.dtype == torch.float32
    assert result.sampled_logits.device.type == "cpu"
    assert torch.equal(result.sampled_logits, logits[[1, 3]].float())
    greedy_only = step_result(logits, [SeqWork(i, 0, (1,), greedy=True) for i in range(4)])
    assert greedy_only.sampled_logits.shape == (0, 50)
    assert greedy_only.argmax == result.argmax
    sampling_only = step_result(logits, [SeqWork(i, 0, (1,)) for i in range(4)])
    assert torch.equal(sampling_only.sampled_logits, logits.float())
