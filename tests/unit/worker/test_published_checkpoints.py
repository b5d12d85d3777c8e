"""Issue 38: checkpoints that transformers writes with the config values of published ones
(Llama-3.1-8B, Llama-3.2-1B, Qwen2.5-7B with YaRN, Qwen3-8B, Mistral-7B-v0.3, Qwen3-30B-A3B)
and adapters that PEFT writes (all-linear, rslora, rank_pattern / alpha_pattern,
layers_to_transform) match HF + PEFT in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.published_checkpoints import FAMILIES, write_family, write_peft_adapter

from loraplane.worker.check.parity import check_parity
from loraplane.worker.config import ModelConfig
from loraplane.worker.models.layers import rope_inv_freq

pytestmark = pytest.mark.unit

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def families(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[tuple[str, Path]]]]:
    built = {}
    for name in FAMILIES:
        root = tmp_path_factory.mktemp(name)
        model = write_family(name, root / "model")
        # On transformers 5's Qwen3-MoE, PEFT's all-linear also targets the fused expert
        # parameters and the router (target_parameters, refused): attention only there.
        targets = ATTENTION if "a3b" in name else "all-linear"
        adapters = [
            (
                "rslora",
                write_peft_adapter(model, root / "rslora", use_rslora=True, target_modules=targets),
            ),
            (
                "pattern",
                write_peft_adapter(
                    model,
                    root / "pattern",
                    seed=2,
                    target_modules=targets,
                    r=8,
                    lora_alpha=8,
                    rank_pattern={"q_proj": 4, "layers.1.self_attn.o_proj": 12},
                    alpha_pattern={"v_proj": 32},
                ),
            ),
        ]
        adapters.append(
            (
                "layer1",
                write_peft_adapter(
                    model,
                    root / "layer1",
                    seed=3,
                    target_modules=[*ATTENTION, "down_proj"] if "a3b" not in name else ATTENTION,
                    layers_to_transform=[1],
                ),
            )
        )
        built[name] = (model, adapters)
    return built


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_hf_and_peft_fp32(families, name: str) -> None:  # type: ignore[no-untyped-def]
    model, adapters = families[name]
    assert (model / "model.safetensors.index.json").is_file()
    assert len(list(model.glob("*.safetensors"))) > 1
    report = check_parity(model, adapters, prompts=6, max_new_tokens=4, backend="torch")
    assert report.max_abs_logprob_diff <= 1e-4, report
    assert report.greedy_identical_count == report.prompts, report
    assert report.lora_effect > 0.01, report


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rope_inverse_frequencies_are_transformers_own(families, name: str) -> None:  # type: ignore[no-untyped-def]
    """The scaled inverse frequencies and YaRN's attention factor, exactly as transformers
    computes them from the same config.json (llama3 scaling barely moves the logprobs of a
    short prompt, so parity alone would not see it)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, _ = families[name]
    ours = ModelConfig.from_dir(model)
    hf = AutoConfig.from_pretrained(str(model))
    hf.standardize_rope_params()
    kind = hf.rope_parameters["rope_type"]
    assert ours.rope_scaling.rope_type == kind
    if kind == "default":
        expected = 1.0 / (
            hf.rope_parameters["rope_theta"]
            ** (torch.arange(0, ours.head_dim, 2, dtype=torch.int64).float() / ours.head_dim)
        )
        factor = 1.0
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert ours.rope_scaling.attention_factor == pytest.approx(factor, rel=1e-12)
