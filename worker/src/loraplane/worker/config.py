"""Model and runtime configuration, validated on construction.

`ModelConfig` is read from an HF `config.json` (the one place that reads it, in both the
transformers 4 layout, top-level `rope_theta`/`rope_scaling`, and the transformers 5 one,
`rope_parameters`); `LoRARuntimeConfig` holds the LoRA memory-pool settings a worker is
started with. Both are frozen: a config that exists is a config that is valid. A config field
that changes the math and that the model does not implement is refused by name
(docs/checkpoints.md lists what is honoured and what is refused).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loraplane.rules import pins
from loraplane.rules.pins import max_pinned

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]

_ARCH_BY_HF_NAME: dict[str, Arch] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # Llama's layers; a sliding window is refused
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the reason."""


RopeType = Literal["default", "linear", "llama3", "yarn"]
ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the rotary inverse frequencies are derived from ``theta`` (transformers'
    ``ROPE_INIT_FUNCTIONS`` of the same name; computed in ``models.layers.rope_inv_freq``).

    ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``. ``yarn``: ``factor``, ``beta_fast``, ``beta_slow``,
    ``original_max_position_embeddings``, ``truncate`` and the cos/sin ``attention_factor``
    (``mscale``). ``linear``: ``factor``."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config.rope_scaling.rope_type {self.rope_type!r} is not supported; "
                f"expected one of {list(ROPE_TYPES)}"
            )
        if not self.factor > 0:
            raise ConfigError(f"config.rope_scaling.factor must be positive, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "config.rope_scaling.original_max_position_embeddings must be positive for "
                f"{self.rope_type!r}, got {self.original_max_position_embeddings}"
            )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                "config.rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: Arch
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    name: str = "model"

    def __post_init__(self) -> None:
        for fname in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            if getattr(self, fname) <= 0:
                raise ConfigError(f"config.{fname} must be positive, got {getattr(self, fname)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.is_moe and (
            self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts
        ):
            raise ConfigError(
                f"config.num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3_moe"

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "model") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((_ARCH_BY_HF_NAME[a] for a in archs if a in _ARCH_BY_HF_NAME), None)
        if arch is None:
            raise ConfigError(
                f"config.architectures {archs!r} is not supported; "
                f"expected one of {sorted(_ARCH_BY_HF_NAME)}"
            )
        _refuse_unsupported(raw, arch)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            max_pos = int(raw.get("max_position_embeddings", 4096))
            theta, scaling = _read_rope(raw, max_pos)
            return cls(
                arch=arch,
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw.get("intermediate_size", 0)),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2",  # Qwen2's q/k/v bias (others are refused)
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(int(x) for x in raw.get("mlp_only_layers", []) or []),
                torch_dtype=_read_dtype(raw),
                name=name,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing the field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config.json holds a value of the wrong type ({exc})") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, name=Path(model_dir).resolve().name)


# Dtypes a checkpoint may be stored in (the model runs in it unless --dtype says otherwise).
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def _read_dtype(raw: dict[str, Any]) -> str:
    key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"
    value = str(raw.get(key) or "float32")
    if value not in CHECKPOINT_DTYPES:
        raise ConfigError(
            f"config.{key} {value!r} is not supported; expected one of {list(CHECKPOINT_DTYPES)}"
        )
    return value


def _refuse_unsupported(raw: dict[str, Any], arch: Arch) -> None:
    """Raise for a field that changes the math and that the model does not implement."""
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ConfigError(
            f"config.quantization_config ({method!r}) is not supported; serve the unquantized "
            "checkpoint (float32, bfloat16 or float16 weights)"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.hidden_act {act!r} is not supported; expected 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(
                f"config.{key} is true: biases on the {key.split('_')[0]} projections are not "
                "supported (only Qwen2's built-in q/k/v bias is)"
            )
    layer_types = raw.get("layer_types") or []
    sliding_layers = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding_layers:
        raise ConfigError(
            f"config.layer_types: layers {sliding_layers} use {layer_types[sliding_layers[0]]!r}; "
            "only full attention is supported"
        )
    # Mistral applies sliding_window (4096 when absent) to every layer; Qwen2/3 only with
    # use_sliding_window; Llama never reads it.
    mistral = "MistralForCausalLM" in (raw.get("architectures") or [])
    window = raw.get("sliding_window", 4096 if mistral else None)
    in_use = mistral or (arch != "llama" and raw.get("use_sliding_window"))
    if in_use and window is not None:
        raise ConfigError(
            f"config.sliding_window {window} is in use; sliding-window attention is not "
            "supported (only full attention)"
        )
    params = raw.get("rope_parameters")
    for source in (raw, params if isinstance(params, dict) else {}):
        factor = source.get("partial_rotary_factor")
        if factor is not None and float(factor) != 1.0:
            raise ConfigError(
                f"config.partial_rotary_factor {factor} is not supported; only 1.0 (full rotary)"
            )


def _read_rope(raw: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling]:
    """(theta, scaling) from top-level ``rope_theta``/``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5)."""
    params = raw.get("rope_parameters")
    field_name = "rope_parameters"
    if params is None:
        params, field_name = dict(raw.get("rope_scaling") or {}), "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError(f"config.{field_name} must be an object, got {params!r}")
    if params and all(isinstance(v, dict | type(None)) for v in params.values()):
        # per layer type: {"full_attention": {...}, ...}
        other = sorted(k for k in params if k != "full_attention")
        if other:
            raise ConfigError(
                f"config.{field_name} has parameters for {other}; only full attention is supported"
            )
        params = params.get("full_attention") or {}
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.{field_name}.rope_type {rope_type!r} is not supported; "
            f"expected one of {list(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_pos / original
    if factor is None:
        raise ConfigError(f"config.{field_name}.factor is required for {rope_type!r}")
    factor = float(factor)
    attention_factor = 1.0
    if rope_type == "yarn":
        if params.get("attention_factor") is not None:
            attention_factor = float(params["attention_factor"])
        elif params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, float(params["mscale"])) / _yarn_mscale(
                factor, float(params["mscale_all_dim"])
            )
        else:
            attention_factor = _yarn_mscale(factor)
    return theta, RopeScaling(
        rope_type=rope_type,  # type: ignore[arg-type]
        factor=factor,
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=attention_factor,
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor (its paper's Eq. 21): ``0.1 mscale ln(scale) + 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class LoRARuntimeConfig:
    """LoRA memory settings of one worker.

    max_loras_per_batch (K): GPU slots per LoRA'd module; a batch holds at most K adapters.
    max_loaded_loras (M): adapters kept ready in host memory.
    max_lora_rank (R): every slot buffer is sized for this rank.
    stage_slots (P): stage positions of rank R under each attention/MLP weight
        (lora/stage.py): a batch of at most P adapters (a decode graph's, or on CUDA an eager
        one of up to 256 rows) gets its shrink from one GEMM and its expand fused into the
        next kernel; adapters of a lower stage rank r get P * R / r positions, at most K.
        0 turns stacking off. None (the default): on a dense model enough for every slot's
        adapter at rank 16 (K * 16 / R), at least 4 and at most 8; 16 on one with routed
        experts, whose expert layers do not stack (``lora.stage.default_positions``).
    """

    max_loras_per_batch: int = 4
    max_loaded_loras: int = 8
    max_lora_rank: int = 64
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    experts: bool = True  # routed-expert LoRA slots on MoE models
    pinned: tuple[str, ...] = field(default=())
    stage_slots: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ConfigError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ConfigError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be >= "
                f"max_loras_per_batch ({self.max_loras_per_batch})"
            )
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.stage_slots is not None and self.stage_slots < 0:
            raise ConfigError(
                f"stage_slots must be >= 0 (0 turns stacked shrinks off), got {self.stage_slots}"
            )
        if len(self.pinned) > max_pinned(self.max_loras_per_batch):
            raise ConfigError(
                f"{len(self.pinned)} pinned adapters but {pins.RULE} = "
                f"{max_pinned(self.max_loras_per_batch)} may be pinned, so one slot stays free for "
                "unpinned traffic; pin fewer or raise --max-loras-per-batch"
            )
        unknown = set(self.target_modules) - set(LORA_MODULES)
        if unknown:
            raise ConfigError(
                f"target_modules {sorted(unknown)} are not supported; expected a subset of {list(LORA_MODULES)}"
            )


# The projections a LoRA may target, as PEFT names them.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES
