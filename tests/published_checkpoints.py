"""Checkpoints and adapters written by transformers and PEFT themselves, at tiny sizes, with the
config values of published checkpoints (docs/checkpoints.md): what `save_pretrained` writes
(transformers 5's `rope_parameters`, shards and their index, `generation_config.json`), and,
where a published config.json reads otherwise, that file's layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# name -> (transformers config class, model class, config values, config.json edits)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "llama-3.1-8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_parameters": LLAMA3_ROPE},
        {},
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "head_dim": 16,
            "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0},
        },
        {},
    ),
    # Qwen2.5's model card adds YaRN to config.json in the transformers 4 layout
    # (top-level rope_theta, rope_scaling with "type"): written so here.
    "qwen2.5-7b-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "use_sliding_window": False,
            "sliding_window": 131072,
            "max_window_layers": 28,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
        {
            "rope_parameters": None,
            "rope_theta": 1000000.0,
            "rope_scaling": {
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "type": "yarn",
            },
        },
    ),
    "qwen3-8b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "head_dim": 16,
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        {},
    ),
    "mistral-7b-v0.3": (
        "MistralConfig",
        "MistralForCausalLM",
        {
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 32768,
            "sliding_window": None,
            "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        {},
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "head_dim": 32,  # != hidden / heads, as the published 128 vs 2048 / 32
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        {},
    ),
}


def write_family(
    name: str, out: Path, *, seed: int = 0, edits: dict[str, Any] | None = None
) -> Path:
    """Random-init the family's tiny model with transformers and `save_pretrained` it in
    shards (with `model.safetensors.index.json`); then apply the config.json edits (a key
    set to None is removed)."""
    import transformers

    config_cls, model_cls, values, family_edits = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **values)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # larger weights than the 0.02 init, so that every term shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, max_shard_size="100KB")
    edit_config(out, {**family_edits, **(edits or {})})
    return out


def edit_config(model_dir: Path, edits: dict[str, Any]) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))


def write_peft_adapter(model_dir: Path, out: Path, *, seed: int = 1, **lora: Any) -> Path:
    """An adapter PEFT itself writes for the model in ``model_dir`` (random A and B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    options: dict[str, Any] = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": "all-linear",
        "init_lora_weights": False,
    }
    options.update(lora)
    model = get_peft_model(base, LoraConfig(**options))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out
