"""Model and runtime configuration, validated on construction.

`ModelConfig` is read from an HF `config.json`; `LoRARuntimeConfig` holds the LoRA
memory-pool settings a worker is started with. Both are frozen: a config that exists
is a config that is valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]

_ARCH_BY_HF_NAME: dict[str, Arch] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the reason."""


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
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            return cls(
                arch=arch,
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw.get("intermediate_size", 0)),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                num_experts=int(raw.get("num_experts", 0)),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(int(x) for x in raw.get("mlp_only_layers", []) or []),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                name=name,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing the field {exc.args[0]!r}") from exc

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


@dataclass(frozen=True, slots=True)
class LoRARuntimeConfig:
    """LoRA memory settings of one worker.

    max_loras_per_batch (K): GPU slots per LoRA'd module; a batch holds at most K adapters.
    max_loaded_loras (M): adapters kept ready in host memory.
    max_lora_rank (R): every slot buffer is sized for this rank.
    stage_slots (P): stage positions under each attention/MLP weight (lora/stage.py): a
        batch of at most P adapters (a decode graph's, or on CUDA an eager one of up to 256
        rows) gets its shrink from one GEMM and its expand fused into the next kernel. 0 turns
        stacking off; at most K are used. None (the default): 4 on a dense model, 16 on one
        with routed experts, whose expert layers do not stack (``lora.stage.default_positions``).
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
        if len(self.pinned) > self.max_loras_per_batch - 1:
            raise ConfigError(
                f"{len(self.pinned)} pinned adapters but at most max_loras_per_batch - 1 = "
                f"{self.max_loras_per_batch - 1} may be pinned, so one slot stays free for "
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
