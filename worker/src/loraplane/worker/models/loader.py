"""Load an HF-format checkpoint directory (config.json + *.safetensors) into `CausalLM`."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane.worker.config import ConfigError, ModelConfig
from loraplane.worker.models.layers import ColumnParallelLinear, RowParallelLinear
from loraplane.worker.models.model import MLP, CausalLM, SparseMoE
from loraplane.worker.parallel.state import ParallelState

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"dtype {name!r} is not supported; expected one of {sorted(DTYPES)}"
        ) from None


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    ps: ParallelState | None = None,
) -> CausalLM:
    """Build the model for this rank and fill it with its shard of every weight."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model directory {model_dir} has no *.safetensors files")
    dtype = dtype or resolve_dtype(config.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(config, ps)
    model.to_empty(device=device)
    model.to(dtype)
    # Buffers computed at construction (rotary inv_freq) were lost on the meta device.
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            hd = module.inv_freq.numel() * 2
            module.inv_freq = 1.0 / (
                config.rope_theta
                ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
            )
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                _load_tensor(model, config, key, f.get_tensor(key))
                seen.add(key)
    if config.tie_word_embeddings or "lm_head.weight" not in seen:
        model.lm_head.load(model.embed_tokens.weight.data)
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in seen]
    if missing:
        raise ConfigError(f"checkpoint {model_dir} lacks {missing}")
    model.eval()
    return model


def _load_tensor(model: CausalLM, config: ModelConfig, key: str, t: torch.Tensor) -> None:
    if key == "model.embed_tokens.weight":
        model.embed_tokens.weight.data.copy_(t)
        return
    if key == "model.norm.weight":
        model.norm.weight.data.copy_(t)
        return
    if key == "lm_head.weight":
        model.lm_head.load(t)
        return
    m = _LAYER.match(key)
    if not m:
        raise ConfigError(f"checkpoint tensor {key!r} is not part of a {config.arch} model")
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    attn = layer.self_attn
    parts = rest.split(".")
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        getattr(layer, parts[0]).weight.data.copy_(t)
    elif parts[0] == "self_attn" and parts[1] in _QKV:
        qkv: ColumnParallelLinear = attn.qkv_proj
        if parts[2] == "weight":
            qkv.load(t, _QKV[parts[1]])
        else:
            lo, hi = qkv.local_offsets[_QKV[parts[1]]], qkv.local_offsets[_QKV[parts[1]] + 1]
            assert qkv.bias is not None, f"{key}: model built without attention bias"
            qkv.bias.data[lo:hi].copy_(qkv.shard_rows(t, _QKV[parts[1]]))
    elif rest == "self_attn.o_proj.weight":
        o: RowParallelLinear = attn.o_proj
        o.load(t)
    elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        getattr(attn, parts[1]).weight.data.copy_(t)
    elif isinstance(layer.mlp, MLP) and parts[0] == "mlp" and parts[1] in _GATE_UP:
        layer.mlp.gate_up_proj.load(t, _GATE_UP[parts[1]])
    elif isinstance(layer.mlp, MLP) and rest == "mlp.down_proj.weight":
        layer.mlp.down_proj.load(t)
    elif isinstance(layer.mlp, SparseMoE) and rest == "mlp.gate.weight":
        layer.mlp.gate.weight.data.copy_(t)
    elif isinstance(layer.mlp, SparseMoE) and (em := _EXPERT.match(rest)):
        layer.mlp.experts.load(int(em.group(1)), em.group(2), t)
    else:
        raise ConfigError(f"checkpoint tensor {key!r} is not part of a {config.arch} model")
