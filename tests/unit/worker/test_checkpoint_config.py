"""Issue 38: config.json is read in both rope layouts, and every field that changes the math
and that the model does not implement is refused with one message naming it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from loraplane.worker.config import ConfigError, ModelConfig

pytestmark = pytest.mark.unit

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 131072,
}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_rope_theta_and_scaling_read_in_both_layouts() -> None:
    v4 = ModelConfig.from_dict(
        {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "rope_type": "llama3"}}
    )
    v5 = ModelConfig.from_dict(
        {**LLAMA, "rope_parameters": {**LLAMA3, "rope_type": "llama3", "rope_theta": 500000.0}}
    )
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_scaling == v5.rope_scaling
    assert v4.rope_scaling.rope_type == "llama3" and v4.rope_scaling.factor == 8.0


def test_yarn_attention_factor_and_the_old_type_key() -> None:
    config = ModelConfig.from_dict(
        {
            **QWEN2,
            "rope_theta": 1e6,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        }
    )
    assert config.rope_scaling.rope_type == "yarn"
    assert config.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_transformers5_names_and_explicit_head_dim() -> None:
    config = ModelConfig.from_dict(
        {
            **LLAMA,
            "architectures": ["Qwen3MoeForCausalLM"],
            "head_dim": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "dtype": "bfloat16",
        }
    )
    assert (config.head_dim, config.num_experts, config.torch_dtype) == (32, 8, "bfloat16")
    assert config.qk_norm


def test_mistral_without_a_window_is_llama() -> None:
    config = ModelConfig.from_dict(
        {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    )
    assert config.arch == "llama"


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("quantized", {**LLAMA, "quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ("gelu", {**LLAMA, "hidden_act": "gelu"}, "config.hidden_act 'gelu'"),
    ("llama attention bias", {**LLAMA, "attention_bias": True}, "config.attention_bias"),
    ("mlp bias", {**LLAMA, "mlp_bias": True}, "config.mlp_bias"),
    (
        "qwen3 attention bias",
        {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
        "config.attention_bias",
    ),
    (
        "sliding layers",
        {**QWEN2, "layer_types": ["full_attention", "sliding_attention"]},
        "config.layer_types: layers [1]",
    ),
    (
        "qwen sliding window in use",
        {**QWEN2, "use_sliding_window": True, "sliding_window": 4096},
        "config.sliding_window 4096 is in use",
    ),
    (
        "mistral window",
        {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
        "config.sliding_window 4096",
    ),
    (
        "mistral default window",
        {**LLAMA, "architectures": ["MistralForCausalLM"]},
        "config.sliding_window 4096",
    ),
    ("partial rotary", {**LLAMA, "partial_rotary_factor": 0.5}, "config.partial_rotary_factor"),
    (
        "partial rotary in rope_parameters",
        {**LLAMA, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
        "config.partial_rotary_factor",
    ),
    (
        "dynamic rope",
        {**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "config.rope_scaling.rope_type 'dynamic'",
    ),
    (
        "longrope",
        {**LLAMA, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        "config.rope_parameters.rope_type 'longrope'",
    ),
    (
        "rope per layer type",
        {
            **LLAMA,
            "rope_parameters": {
                "full_attention": {"rope_type": "default"},
                "sliding_attention": {"rope_type": "default"},
            },
        },
        "config.rope_parameters has parameters for ['sliding_attention']",
    ),
    (
        "linear without factor",
        {**LLAMA, "rope_scaling": {"rope_type": "linear"}},
        "config.rope_scaling.factor is required",
    ),
    ("fp8 dtype", {**LLAMA, "torch_dtype": "float8_e4m3fn"}, "config.torch_dtype 'float8_e4m3fn'"),
    ("int dtype", {**LLAMA, "dtype": "int8"}, "config.dtype 'int8'"),
]


@pytest.mark.parametrize(("case", "raw", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_field_that_changes_the_math_is_refused_by_name(
    case: str, raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_sharded_checkpoint_reads_only_the_shards_its_index_names(tmp_path: Path) -> None:
    """Beside the shards, a stray file (Mistral's consolidated.safetensors) is not read; an
    index naming a shard that is not there is refused by name."""
    from safetensors.torch import save_file

    from loraplane.worker.models.loader import checkpoint_files

    save_file({"x": __import__("torch").zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / shard).write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    files, names = checkpoint_files(tmp_path)
    assert [f.name for f in files] == sorted(set(index["weight_map"].values()))
    assert names == {"a", "b"}
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match=re.escape("model-00002-of-00002.safetensors")):
        checkpoint_files(tmp_path)


def test_eos_list_and_chat_template_beside_the_tokenizer(tmp_path: Path) -> None:
    """generation_config.json's eos list, and the chat template where transformers saves it
    (chat_template.jinja) when tokenizer_config.json has none."""
    from loraplane.worker.engine.tokenizer import TextTokenizer
    from loraplane.worker.fixtures.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, vocab_size=512, model_max_length=256)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    tok = TextTokenizer(tmp_path)
    assert {7, 9} <= tok.eos_token_ids
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids).replace(" ", "") == "<user>hi"


def test_worker_and_control_plane_refuse_the_same_peft_fields() -> None:
    """One table (loraplane.rules.peft) for both: a field the preflight refuses, every worker
    refuses; a value that means "not used" passes both."""
    from loraplane.controlplane import sources
    from loraplane.controlplane.errors import InvalidSource
    from loraplane.rules.peft import REFUSED_PEFT_FIELDS
    from loraplane.worker.lora.adapter import refuse_peft_fields

    def worker_error(field: str, reason: str) -> Exception:
        return ValueError(f"{field}: {reason}")

    for field, unused in REFUSED_PEFT_FIELDS.items():
        with pytest.raises(InvalidSource, match=f"{field} is 'in use': not supported"):
            sources._refuse_peft_fields({field: "in use"})
        with pytest.raises(ValueError, match=f"{field}: 'in use' is not supported"):
            refuse_peft_fields({field: "in use"}, worker_error)
        for value in unused:
            sources._refuse_peft_fields({field: value})
            refuse_peft_fields({field: value}, worker_error)
