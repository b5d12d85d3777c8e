"""PEFT-format adapters: read, validate against the base model, hold in host memory.

Everything here happens before an adapter takes a slot: a rejected adapter changes
nothing. Each error names the field (or tensor) and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraplane.rules.peft import refused_peft_field
from loraplane.worker.config import ATTN_MODULES, LORA_MODULES, MLP_MODULES, ModelConfig

log = logging.getLogger(__name__)

# Held while the engine captures a CUDA graph (engine/graphs.py) and while the adapter thread
# page-locks a tensor: during a capture CUDA refuses cudaHostAlloc, and the host allocator's
# event queries, from any other thread (the capture would fail and its shape run eagerly from
# then on, and the adapter would stay pageable). Each tensor is locked on its own, so a
# capture waits for one tensor's pinning at most.
CUDA_CAPTURE_LOCK = threading.Lock()

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT's LoraConfig default, used when adapter_config.json has no lora_alpha
PEFT_DEFAULT_ALPHA = 8
# safetensors dtype names a LoRA weight may have; anything else (fp8, integers) is rejected
_WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  (adapter name optional)
_DENSE_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$"
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


@dataclass(frozen=True, slots=True)
class ExpertStack:
    """One module's LoRA over the routed experts of one layer that an adapter has, stacked
    as a slot takes them (``ExpertsLoRA.set_expert_slot``: one copy, not one per expert)."""

    experts: torch.Tensor  # int64 [n]: expert ids, ascending
    a: torch.Tensor  # [n, r, in]
    b: torch.Tensor  # [n, out, r]


@dataclass(slots=True)
class AdapterWeights:
    """A validated adapter in host memory in the slots' dtype, unsharded (each rank slices
    its own part)."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r])
    dense: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (layer, module) -> the experts' stacked (A, B)
    expert_stacks: dict[tuple[int, str], ExpertStack] = field(default_factory=dict)
    version: int = 0

    @property
    def nbytes(self) -> int:
        total = 0
        pairs = [*self.dense.values(), *((s.a, s.b) for s in self.expert_stacks.values())]
        for a, b in pairs:
            total += a.numel() * a.element_size() + b.numel() * b.element_size()
        return total

    def page_locked_copy(self) -> AdapterWeights:
        """The same adapter in page-locked host memory (a CUDA build only): a slot load then
        copies it to the GPU at the link's speed, asynchronously (``LoRAManager.load_slot``);
        from pageable memory each copy went through the driver's staging, synchronously, at
        3-6 GB/s. ``RuntimeError`` if the memory cannot be locked."""
        return dataclasses.replace(
            self,
            dense={k: (_pinned(a), _pinned(b)) for k, (a, b) in self.dense.items()},
            expert_stacks={
                k: ExpertStack(_pinned(s.experts), _pinned(s.a), _pinned(s.b))
                for k, s in self.expert_stacks.items()
            },
        )


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` page-locked, never during a CUDA graph capture (``CUDA_CAPTURE_LOCK``)."""
    with CUDA_CAPTURE_LOCK:
        return t.pin_memory()


def page_locked(weights: AdapterWeights, device: torch.device) -> AdapterWeights:
    """``weights.page_locked_copy()`` for a CUDA worker; the adapter as it is on any other
    device, or (with a warning) where host memory cannot be locked: its slot loads then still
    work, only slower (docs/adr/0010-adapters-page-locked.md)."""
    if device.type != "cuda":
        return weights
    try:
        return weights.page_locked_copy()
    except RuntimeError as exc:
        log.warning(
            "adapter %r stays in pageable host memory, so each of its slot loads holds the "
            "step loop longer (copies at the driver's staging speed): %s; give the worker "
            "lockable host memory (a GPU, and room under its memory limit)",
            weights.name,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return weights


def blank_adapter(name: str, rank: int, target_modules: tuple[str, ...]) -> AdapterWeights:
    """An adapter of ``rank`` whose every weight is zero: in a slot, its LoRA runs every
    kernel a real adapter of that rank runs and adds nothing (``engine.warmup``)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    # no tensors: a slot is zeroed before an adapter's weights go in (LoRAManager.load_slot)
    return AdapterWeights(name, "", rank, float(rank), 1.0, target_modules)


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
    try:
        if not path.exists():
            raise AdapterError(name, "lora_path", f"{path} does not exist")
        if not path.is_dir():
            raise AdapterError(name, "lora_path", f"{path} is not a directory")
    except OSError as exc:
        raise AdapterError(name, "lora_path", f"{path} cannot be read ({exc})") from exc
    cfg_path = path / ADAPTER_CONFIG
    try:
        if not cfg_path.is_file():
            raise AdapterError(
                name, ADAPTER_CONFIG, f"missing in {path}; a PEFT adapter directory needs it"
            )
        text = cfg_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AdapterError(
            name, ADAPTER_CONFIG, f"{cfg_path} cannot be read ({exc}); check its permissions"
        ) from exc
    except UnicodeDecodeError as exc:
        raise AdapterError(name, ADAPTER_CONFIG, f"is not UTF-8 text ({exc})") from exc
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, or an over-long number
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
    slot_dtype: torch.dtype | None = None,
) -> AdapterWeights:
    """Read and fully validate a PEFT adapter for `config`; raise AdapterError if it does not fit.

    `slot_dtype` is the dtype of the LoRA slots the weights will be copied into (None: the
    checkpoint's `torch_dtype`): a value it cannot hold is rejected rather than becoming Inf.
    """
    path = Path(path)
    slot_dtype = slot_dtype or _checkpoint_dtype(config)
    raw = read_adapter_config(name, path)
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, "peft_type", f"{peft_type!r} is not supported; only LORA")
    rank = raw.get("r")
    if not _is_positive_int(rank):
        raise AdapterError(name, "r", f"must be a positive integer, got {rank!r}")
    assert isinstance(rank, int)
    if rank > max_rank and not raw.get("rank_pattern"):
        raise AdapterError(
            name,
            "r",
            f"{rank} is above max_lora_rank {max_rank}; start the worker with a larger --max-lora-rank",
        )
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not _is_finite_number(alpha):
        raise AdapterError(name, "lora_alpha", f"must be a finite number, got {alpha!r}")
    refuse_peft_fields(raw, lambda f, reason: AdapterError(name, f, reason))
    patterns = RankPatterns.read(raw, rank, float(alpha), lambda f, r: AdapterError(name, f, r))
    targets_raw = raw.get("target_modules") or []
    if targets_raw == "all-linear":
        targets_raw = list(allowed_modules)
    if isinstance(targets_raw, str):
        targets_raw = [targets_raw]
    if not isinstance(targets_raw, list):
        raise AdapterError(
            name, "target_modules", f"must be a list of module names, got {targets_raw!r}"
        )
    targets = [str(t).split(".")[-1] for t in targets_raw]
    params_raw = raw.get("target_parameters") or []
    if not isinstance(params_raw, list):
        raise AdapterError(
            name, "target_parameters", f"must be a list of parameter names, got {params_raw!r}"
        )
    target_params = [str(t) for t in params_raw]
    embedding = [t for t in targets if t in ("embed_tokens", "lm_head")]
    if embedding:
        raise AdapterError(
            name,
            "target_modules",
            f"LoRA on {embedding} is not supported; only the attention and MLP projections "
            f"{list(allowed_modules)}",
        )
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
    scaling = patterns.scaling(rank, float(alpha))

    adapter = AdapterWeights(
        name=name,
        path=str(path),
        rank=rank,
        alpha=float(alpha),
        scaling=scaling,
        target_modules=tuple(targets),
    )
    weights_path = path / ADAPTER_WEIGHTS
    try:
        if not weights_path.is_file():
            raise AdapterError(name, ADAPTER_WEIGHTS, f"missing in {path}")
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            # The header first: every key, dtype and shape is checked before any tensor is read,
            # so a stray (or huge) tensor costs nothing.
            halves: dict[_Where, dict[str, str]] = {}  # where -> {"A": key, "B": key}
            for key in f.keys():  # noqa: SIM118
                where, ab, (d_in, d_out) = _check_key(
                    name, key, config, allowed_modules, experts_enabled
                )
                header = f.get_slice(key)
                dtype, shape = header.get_dtype(), list(header.get_shape())
                if dtype not in _WEIGHT_DTYPES:
                    raise AdapterError(
                        name,
                        key,
                        f"dtype {dtype} is not supported; LoRA weights must be one of {list(_WEIGHT_DTYPES)}",
                    )
                r_key = patterns.rank_of(_module_path(where))
                if r_key > max_rank:
                    raise AdapterError(
                        name,
                        "rank_pattern" if r_key != rank else "r",
                        f"{_describe(where)} has rank {r_key}, above max_lora_rank {max_rank}; "
                        "start the worker with a larger --max-lora-rank",
                    )
                expected = [r_key, d_in] if ab == "A" else [d_out, r_key]
                if shape != expected:
                    raise AdapterError(
                        name,
                        key,
                        f"shape {shape} does not fit the base model (expected {expected} for r={r_key})",
                    )
                pair = halves.setdefault(where, {})
                if ab in pair:
                    raise AdapterError(
                        name,
                        key,
                        f"duplicates {pair[ab]!r}: both are lora_{ab} of {_describe(where)}; keep one",
                    )
                pair[ab] = key
            for where, pair in halves.items():
                if set(pair) != {"A", "B"}:
                    missing = ({"A", "B"} - set(pair)).pop()
                    raise AdapterError(
                        name, ADAPTER_WEIGHTS, f"{_describe(where)} has no lora_{missing} weight"
                    )
            if not halves:
                raise AdapterError(name, ADAPTER_WEIGHTS, "holds no LoRA weights")
            # With rank_pattern / alpha_pattern a module's rank and scaling may differ from
            # the adapter's: its A and B are zero-padded to the adapter's largest rank (the
            # slot's extra rows then add nothing) and B carries its scaling's ratio to the
            # adapter's, so one rank and one scaling per slot stay exact.
            adapter.rank = max(patterns.rank_of(_module_path(w)) for w in halves)
            per_expert: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
            for where, pair in halves.items():
                path_of = _module_path(where)
                ratio = patterns.scaling_of(path_of) / scaling
                a = _read_weight(name, f, pair["A"], slot_dtype, pad_rows=adapter.rank)
                b = _read_weight(name, f, pair["B"], slot_dtype, pad_cols=adapter.rank, times=ratio)
                if where[0] == "d":
                    adapter.dense[(where[1], where[2])] = (a, b)
                else:
                    per_expert.setdefault((where[1], where[3]), {})[where[2]] = (a, b)
            for key, by_expert in per_expert.items():
                ids = sorted(by_expert)
                adapter.expert_stacks[key] = ExpertStack(
                    torch.tensor(ids, dtype=torch.int64),
                    torch.stack([by_expert[e][0] for e in ids]),
                    torch.stack([by_expert[e][1] for e in ids]),
                )
    except AdapterError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(
            name, ADAPTER_WEIGHTS, f"cannot be read, truncated or corrupt ({exc})"
        ) from exc
    return adapter


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_finite_number(value: object) -> bool:
    """A JSON number a float can hold (an integer of 400 digits is not)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _checkpoint_dtype(config: ModelConfig) -> torch.dtype:
    dtype = getattr(torch, config.torch_dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


# ("d", layer, module) for a dense projection, ("e", layer, expert, module) for a routed expert
_Where = tuple[Any, ...]


def _module_path(where: _Where) -> str:
    """The module's name in the base model, as PEFT matches rank_pattern keys against it."""
    if where[0] == "d":
        parent = "self_attn" if where[2] in ATTN_MODULES else "mlp"
        return f"model.layers.{where[1]}.{parent}.{where[2]}"
    return f"model.layers.{where[1]}.mlp.experts.{where[2]}.{where[3]}"


def refuse_peft_fields(raw: dict[str, Any], error: Callable[[str, str], Exception]) -> None:
    """Raise ``error(field, reason)`` for the first refused field (``loraplane.rules.peft``)."""
    refused = refused_peft_field(raw)
    if refused is not None:
        field_name, value, instead = refused
        raise error(
            field_name,
            f"{value!r} is not supported (it changes the math and this worker does not "
            f"implement it); only {instead!r} or absent",
        )


@dataclass(frozen=True, slots=True)
class RankPatterns:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: a module whose name matches a key (PEFT's
    rule: ``(.*\\.)?(key)$``, first key in order) has that rank / alpha instead of ``r`` /
    ``lora_alpha``."""

    rank: int
    alpha: float
    rslora: bool
    ranks: dict[str, int]
    alphas: dict[str, float]

    @classmethod
    def read(
        cls, raw: dict[str, Any], rank: int, alpha: float, error: Callable[[str, str], Exception]
    ) -> RankPatterns:
        patterns: list[dict[str, Any]] = []
        for field_name in ("rank_pattern", "alpha_pattern"):
            value = raw.get(field_name) or {}
            if not isinstance(value, dict):
                raise error(field_name, f"must map module names to numbers, got {value!r}")
            for key, v in value.items():
                if field_name == "rank_pattern" and not _is_positive_int(v):
                    raise error(field_name, f"{key!r}: must be a positive integer, got {v!r}")
                if field_name == "alpha_pattern" and not _is_finite_number(v):
                    raise error(field_name, f"{key!r}: must be a finite number, got {v!r}")
                try:
                    re.compile(key)
                except re.error as exc:
                    raise error(field_name, f"{key!r} is not a valid pattern ({exc})") from exc
            patterns.append(value)
        return cls(
            rank,
            alpha,
            bool(raw.get("use_rslora")),
            {k: int(v) for k, v in patterns[0].items()},
            {k: float(v) for k, v in patterns[1].items()},
        )

    @staticmethod
    def _match(pattern: dict[str, Any], module: str) -> str | None:
        return next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)

    def rank_of(self, module: str) -> int:
        key = self._match(self.ranks, module)
        return self.ranks[key] if key is not None else self.rank

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / (math.sqrt(rank) if self.rslora else rank)

    def scaling_of(self, module: str) -> float:
        key = self._match(self.alphas, module)
        alpha = self.alphas[key] if key is not None else self.alpha
        return self.scaling(self.rank_of(module), alpha)


def _describe(where: _Where) -> str:
    if where[0] == "d":
        return f"layer {where[1]} {where[2]}"
    return f"layer {where[1]} expert {where[2]} {where[3]}"


def _check_key(
    name: str,
    key: str,
    config: ModelConfig,
    allowed_modules: tuple[str, ...],
    experts_enabled: bool,
) -> tuple[_Where, str, tuple[int, int]]:
    """Where a tensor key goes in `config`, which half (A or B) it is, and the (in, out) it spans."""
    if m := _EXPERT_KEY.match(key):
        layer, expert, module, ab = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        if not experts_enabled:
            raise AdapterError(name, key, "expert LoRA is disabled on this worker")
        if not (config.is_moe and layer < config.num_layers and config.is_moe_layer(layer)):
            raise AdapterError(name, key, f"layer {layer} of {config.name} has no routed experts")
        if expert >= config.num_experts:
            raise AdapterError(name, key, f"expert {expert} >= num_experts {config.num_experts}")
        return ("e", layer, expert, module), ab, _expert_shape(config, module)
    if m := _DENSE_KEY.match(key):
        layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in LORA_MODULES:
            raise AdapterError(
                name, key, f"module {module!r} is not a LoRA target this worker supports"
            )
        home = "self_attn" if module in ATTN_MODULES else "mlp"
        if parent != home:
            raise AdapterError(
                name, key, f"{module} sits under {home}, not {parent}; no such module exists"
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
        return ("d", layer, module), ab, _dense_shape(config, module)
    raise AdapterError(name, key, "is not a LoRA weight of a supported module")


def _read_weight(
    name: str,
    f: Any,
    key: str,
    slot_dtype: torch.dtype,
    *,
    pad_rows: int = 0,
    pad_cols: int = 0,
    times: float = 1.0,
) -> torch.Tensor:
    """One validated tensor, read, checked to fit the slots and held in their dtype (what a
    slot holds either way; half the host memory and copy of fp32 for a 16-bit model);
    multiplied by ``times`` (in fp32) and zero-padded to ``pad_rows`` rows or ``pad_cols``
    columns (a module below the adapter's rank)."""
    t = f.get_tensor(key)
    if not torch.isfinite(t).all():
        raise AdapterError(name, key, "contains NaN or Inf values")
    if times != 1.0:
        t = t.float() * times
    if pad_rows > t.shape[0]:
        t = torch.cat((t, t.new_zeros(pad_rows - t.shape[0], t.shape[1])))
    if pad_cols > t.shape[1]:
        t = torch.cat((t, t.new_zeros(t.shape[0], pad_cols - t.shape[1])), dim=1)
    peak, limit = t.abs().max().item(), torch.finfo(slot_dtype).max
    if peak > limit:
        raise AdapterError(
            name,
            key,
            f"holds {peak:.6g}, above {limit:.6g}, the largest {slot_dtype} value of this "
            "worker's LoRA slots; rescale the weights (moving the factor into lora_alpha) "
            "or serve the model in a wider dtype",
        )
    return t.to(slot_dtype)
