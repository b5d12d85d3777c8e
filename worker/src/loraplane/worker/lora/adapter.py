"""PEFT-format adapters: read, validate against the base model, hold in host memory.

Everything here happens before an adapter takes a slot: a rejected adapter changes
nothing. Each error names the field (or tensor) and the reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraplane.worker.config import LORA_MODULES, MLP_MODULES, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  (adapter name optional)
_DENSE_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$"
)
# base_model.model.model.layers.3.mlp.experts.7.gate_proj.lora_A.weight
_EXPERT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter was rejected; `field` names what is wrong."""

    def __init__(self, adapter: str, field_name: str, reason: str) -> None:
        self.adapter = adapter
        self.field = field_name
        self.reason = reason
        super().__init__(f"adapter {adapter!r}: {field_name}: {reason}")


@dataclass(slots=True)
class AdapterWeights:
    """A validated adapter in host memory, unsharded (each rank slices its own part)."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r])
    dense: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (layer, expert, module) -> (A [r, in], B [out, r])
    experts: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    version: int = 0

    @property
    def nbytes(self) -> int:
        total = 0
        for a, b in list(self.dense.values()) + list(self.experts.values()):
            total += a.numel() * a.element_size() + b.numel() * b.element_size()
        return total


def _dense_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a dense projection of the base model."""
    h = config.hidden_size
    return {
        "q_proj": (h, config.q_size),
        "k_proj": (h, config.kv_size),
        "v_proj": (h, config.kv_size),
        "o_proj": (config.q_size, h),
        "gate_proj": (h, config.intermediate_size),
        "up_proj": (h, config.intermediate_size),
        "down_proj": (config.intermediate_size, h),
    }[module]


def _expert_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    h, i = config.hidden_size, config.moe_intermediate_size
    return (i, h) if module == "down_proj" else (h, i)


def read_adapter_config(name: str, path: Path) -> dict[str, Any]:
    if not path.exists():
        raise AdapterError(name, "lora_path", f"{path} does not exist")
    if not path.is_dir():
        raise AdapterError(name, "lora_path", f"{path} is not a directory")
    cfg_path = path / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise AdapterError(
            name, ADAPTER_CONFIG, f"missing in {path}; a PEFT adapter directory needs it"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(name, ADAPTER_CONFIG, f"is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterError(name, ADAPTER_CONFIG, "must hold a JSON object")
    return raw


def load_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    *,
    max_rank: int,
    allowed_modules: tuple[str, ...] = LORA_MODULES,
    experts_enabled: bool = True,
) -> AdapterWeights:
    """Read and fully validate a PEFT adapter for `config`; raise AdapterError if it does not fit."""
    path = Path(path)
    raw = read_adapter_config(name, path)
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, "peft_type", f"{peft_type!r} is not supported; only LORA")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(name, "r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            name,
            "r",
            f"{rank} is above max_lora_rank {max_rank}; start the worker with a larger --max-lora-rank",
        )
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(name, "lora_alpha", f"must be a finite number, got {alpha!r}")
    for unsupported, empty in (
        ("use_dora", False),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        value = raw.get(unsupported)
        if value not in (empty, None, False, {}, []):
            raise AdapterError(name, unsupported, f"{value!r} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(name, "bias", f"{raw.get('bias')!r} is not supported; only 'none'")
    targets_raw = raw.get("target_modules") or []
    if isinstance(targets_raw, str):
        targets_raw = [targets_raw]
    targets = [str(t).split(".")[-1] for t in targets_raw]
    target_params = [str(t) for t in raw.get("target_parameters") or []]
    unknown = [t for t in targets if t not in allowed_modules and t != "experts"]
    if unknown:
        raise AdapterError(
            name,
            "target_modules",
            f"{unknown} not supported by this worker; expected a subset of {list(allowed_modules)}",
        )
    if target_params:
        raise AdapterError(
            name,
            "target_parameters",
            f"{target_params} is not supported; target expert modules by name",
        )
    scaling = float(alpha) / (math.sqrt(rank) if raw.get("use_rslora") else rank)

    weights_path = path / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise AdapterError(name, ADAPTER_WEIGHTS, f"missing in {path}")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118
                tensors[key] = f.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(
            name, ADAPTER_WEIGHTS, f"cannot be read, truncated or corrupt ({exc})"
        ) from exc

    adapter = AdapterWeights(
        name=name,
        path=str(path),
        rank=rank,
        alpha=float(alpha),
        scaling=scaling,
        target_modules=tuple(targets),
    )
    halves: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterError(name, key, f"dtype {t.dtype} is not a floating-point type")
        if not torch.isfinite(t).all():
            raise AdapterError(name, key, "contains NaN or Inf values")
        if m := _EXPERT_KEY.match(key):
            layer, expert, module, ab = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            if not experts_enabled:
                raise AdapterError(name, key, "expert LoRA is disabled on this worker")
            if not (config.is_moe and layer < config.num_layers and config.is_moe_layer(layer)):
                raise AdapterError(
                    name, key, f"layer {layer} of {config.name} has no routed experts"
                )
            if expert >= config.num_experts:
                raise AdapterError(
                    name, key, f"expert {expert} >= num_experts {config.num_experts}"
                )
            d_in, d_out = _expert_shape(config, module)
            halves.setdefault(("e", layer, expert, module), {})[ab] = t
        elif m := _DENSE_KEY.match(key):
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in LORA_MODULES:
                raise AdapterError(
                    name, key, f"module {module!r} is not a LoRA target this worker supports"
                )
            if module not in allowed_modules:
                raise AdapterError(
                    name,
                    key,
                    f"module {module!r} is not enabled on this worker ({list(allowed_modules)})",
                )
            if layer >= config.num_layers:
                raise AdapterError(
                    name,
                    key,
                    f"layer {layer} does not exist; {config.name} has {config.num_layers} layers",
                )
            if module in MLP_MODULES and config.is_moe_layer(layer):
                raise AdapterError(
                    name,
                    key,
                    f"layer {layer} is a MoE layer with no dense {module}; target experts instead",
                )
            d_in, d_out = _dense_shape(config, module)
            halves.setdefault(("d", layer, module), {})[ab] = t
        else:
            raise AdapterError(name, key, "is not a LoRA weight of a supported module")
        expected = (rank, d_in) if ab == "A" else (d_out, rank)
        if tuple(t.shape) != expected:
            raise AdapterError(
                name,
                key,
                f"shape {list(t.shape)} does not fit the base model (expected {list(expected)} for r={rank})",
            )
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(name, ADAPTER_WEIGHTS, f"{where[1:]} has no lora_{missing} weight")
        a, b = pair["A"].float(), pair["B"].float()
        if where[0] == "d":
            adapter.dense[(where[1], where[2])] = (a, b)
        else:
            adapter.experts[(where[1], where[2], where[3])] = (a, b)
    if not adapter.dense and not adapter.experts:
        raise AdapterError(name, ADAPTER_WEIGHTS, "holds no LoRA weights")
    return adapter
