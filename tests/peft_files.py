"""PEFT adapter directories written without torch (same as the unit tier's helpers)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file from (dtype, shape, raw bytes) entries."""
    header: dict[str, Any] = {}
    offset = 0
    blobs = []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def write_adapter(
    directory: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    base: str | None = "/models/tiny-llama",
    hidden: int = 32,
    dtype: str = "F32",
    poison: str | None = None,
    config_extra: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
    }
    if base is not None:
        config["base_model_name_or_path"] = base
    config.update(config_extra or {})
    (directory / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for module in modules:
        for part, shape in (("lora_A", [rank, hidden]), ("lora_B", [hidden, rank])):
            values = rng.standard_normal(shape).astype(np.float32)
            if poison is not None:
                values.flat[0] = np.nan if poison == "nan" else np.inf
            if dtype == "F32":
                raw = values.tobytes()
            elif dtype == "F16":
                raw = values.astype(np.float16).tobytes()
            else:  # BF16: the high half of float32
                raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            tensors[f"base_model.model.model.layers.0.self_attn.{module}.{part}.weight"] = (
                dtype,
                shape,
                raw,
            )
    write_safetensors(directory / "adapter_model.safetensors", tensors)
    return directory
