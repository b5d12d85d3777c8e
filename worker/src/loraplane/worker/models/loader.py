"""Load an HF-format checkpoint directory (config.json + *.safetensors, or shards and their
``model.safetensors.index.json``) into `CausalLM`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane.worker.config import ConfigError, ModelConfig
from loraplane.worker.models.layers import ColumnParallelLinear, RotaryEmbedding, RowParallelLinear
from loraplane.worker.models.model import MLP, CausalLM, SparseMoE
from loraplane.worker.parallel.state import ParallelState

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}

INDEX = "model.safetensors.index.json"

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
    files, expected = checkpoint_files(model_dir)
    dtype = dtype or resolve_dtype(config.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(config, ps)
    model.to_empty(device=device)
    model.to(dtype)
    reset_rotary(model, device)
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                _load_tensor(model, config, key, f.get_tensor(key))
                seen.add(key)
    if expected - seen:
        raise ConfigError(
            f"{INDEX} of {model_dir} names tensors no shard holds: {sorted(expected - seen)[:5]}"
        )
    if config.tie_word_embeddings or "lm_head.weight" not in seen:
        model.lm_head.load(model.embed_tokens.weight.data)
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in seen]
    if missing:
        raise ConfigError(f"checkpoint {model_dir} lacks {missing}")
    model.eval()
    return model


def reset_rotary(model: torch.nn.Module, device: torch.device | str) -> None:
    """Recompute the rotary ``inv_freq`` buffers that building on the meta device lost."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_inv_freq(device)


def checkpoint_files(model_dir: Path) -> tuple[list[Path], set[str]]:
    """The safetensors files of a checkpoint and the tensor names its index promises: the
    shards ``model.safetensors.index.json`` names (other ``*.safetensors`` files beside them,
    such as Mistral's ``consolidated.safetensors``, are not read), else every
    ``*.safetensors`` file (and no promise)."""
    index = model_dir / INDEX
    if not index.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"model directory {model_dir} has no *.safetensors files")
        return files, set()
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{index} is not a safetensors index ({exc})") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: weight_map must map tensor names to shard files")
    names = sorted(set(map(str, weight_map.values())))
    absent = [n for n in names if not (model_dir / n).is_file()]
    if absent:
        raise ConfigError(f"{index}: weight_map names shards that are not in {model_dir}: {absent}")
    return [model_dir / n for n in names], set(weight_map)


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
            if qkv.bias is None:
                raise ConfigError(f"checkpoint tensor {key!r}: {config.arch} has no q/k/v bias")
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
