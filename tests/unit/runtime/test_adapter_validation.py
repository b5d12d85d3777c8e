"""Every way an adapter can be rejected names the field and the reason, and changes nothing:
no slot buffer, rank, scaling or resident adapter moves."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.lora.adapter import AdapterError

pytestmark = pytest.mark.unit

KEY_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def runner(suite) -> ModelRunner:
    model_dir, adapters = suite["llama"]
    r = ModelRunner(
        RunnerConfig(str(model_dir), lora_backend="torch"),
        LoRARuntimeConfig(max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=16),
    )
    assert r.lora is not None
    r.lora.load_slot(0, r.read_adapter("a8", adapters[1][1]))  # slot 0 holds a real adapter
    return r


def snapshot(r: ModelRunner) -> list[torch.Tensor]:
    assert r.lora is not None
    bufs = [r.lora.slot_ranks.clone(), r.lora.slot_scalings.clone()]
    for wrappers in r.lora.layers:
        for w in wrappers:
            bufs += [w.lora_a.clone(), w.lora_b.clone()]  # type: ignore[attr-defined]
    return bufs


def copy_adapter(suite, tmp_path: Path, name: str = "a8") -> Path:
    _, adapters = suite["llama"]
    src = dict(adapters)[name]
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensor(path: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _nan(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A][0, 0] = math.nan


def _wrong_shape(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A] = torch.ones(8, 48)


def _unknown_module(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.layers.0.self_attn.rotary_proj.lora_A.weight"] = torch.ones(8, 64)


def _int_dtype(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A] = torch.ones(8, 64, dtype=torch.int32)


def _missing_b(t: dict[str, torch.Tensor]) -> None:
    del t[KEY_A.replace("lora_A", "lora_B")]


def _layer_out_of_range(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A.replace("layers.0", "layers.9")] = t[KEY_A].clone()


CASES: list[tuple[str, Callable[[Path], None], str, str]] = [
    ("rank above max", lambda p: edit_config(p, r=32), "r", "above max_lora_rank 16"),
    (
        "unknown target",
        lambda p: edit_config(p, target_modules=["q_proj", "rotary_proj"]),
        "target_modules",
        "not supported",
    ),
    ("dora", lambda p: edit_config(p, use_dora=True), "use_dora", "not supported"),
    ("bias", lambda p: edit_config(p, bias="all"), "bias", "only 'none'"),
    ("non-finite", lambda p: edit_tensor(p, _nan), KEY_A, "NaN or Inf"),
    ("shape", lambda p: edit_tensor(p, _wrong_shape), KEY_A, "does not fit the base model"),
    (
        "unknown module tensor",
        lambda p: edit_tensor(p, _unknown_module),
        "rotary_proj",
        "not a LoRA target",
    ),
    ("integer tensor", lambda p: edit_tensor(p, _int_dtype), KEY_A, "not a floating-point type"),
    (
        "half a pair",
        lambda p: edit_tensor(p, _missing_b),
        "adapter_model.safetensors",
        "no lora_B weight",
    ),
    (
        "layer out of range",
        lambda p: edit_tensor(p, _layer_out_of_range),
        "layers.9",
        "does not exist",
    ),
    (
        "missing config",
        lambda p: (p / "adapter_config.json").unlink(),
        "adapter_config.json",
        "missing",
    ),
    (
        "config not json",
        lambda p: (p / "adapter_config.json").write_text("{r: 8"),
        "adapter_config.json",
        "not valid JSON",
    ),
    (
        "missing weights",
        lambda p: (p / "adapter_model.safetensors").unlink(),
        "adapter_model.safetensors",
        "missing",
    ),
    (
        "truncated weights",
        lambda p: (p / "adapter_model.safetensors").write_bytes(
            (p / "adapter_model.safetensors").read_bytes()[:300]
        ),
        "adapter_model.safetensors",
        "cannot be read",
    ),
    (
        "garbage weights",
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x00" * 64),
        "adapter_model.safetensors",
        "cannot be read",
    ),
]


@pytest.mark.parametrize(("case", "damage", "field", "reason"), CASES, ids=[c[0] for c in CASES])
def test_rejected_adapter_names_field_and_changes_nothing(
    runner: ModelRunner,
    suite,
    tmp_path: Path,
    case: str,
    damage: Callable[[Path], None],
    field: str,
    reason: str,
) -> None:
    path = copy_adapter(suite, tmp_path)
    damage(path)
    before = snapshot(runner)
    resident = list(runner.lora.slot_adapters)  # type: ignore[union-attr]
    with pytest.raises(AdapterError) as err:
        runner.read_adapter("broken", path)
    message = str(err.value)
    assert "'broken'" in message and field in message and reason in message, message
    after = snapshot(runner)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert runner.lora.slot_adapters == resident  # type: ignore[union-attr]


def test_missing_directory_is_named(runner: ModelRunner, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"lora_path: .* does not exist"):
        runner.read_adapter("ghost", tmp_path / "nope")


def test_modules_the_adapter_lacks_are_zeroed_on_load(
    runner: ModelRunner, suite, tmp_path: Path
) -> None:
    """An adapter with only q_proj, loaded into a slot that held a full adapter, leaves no trace
    of the old adapter's other modules."""
    path = copy_adapter(suite, tmp_path)
    edit_tensor(path, lambda t: [t.pop(k) for k in list(t) if "q_proj" not in k])
    edit_config(path, target_modules=["q_proj"])
    assert runner.lora is not None
    old = runner.lora.slot_adapters[0]
    try:
        runner.lora.load_slot(0, runner.read_adapter("q-only", path))
        o_proj = runner.lora.layers[0][1]
        assert o_proj.module_names == ("o_proj",)
        assert not o_proj.lora_a[0].any() and not o_proj.lora_b[0].any()  # type: ignore[attr-defined]
        qkv = runner.lora.layers[0][0]
        r = qkv.max_rank  # type: ignore[attr-defined]
        assert qkv.lora_a[0, :8].any() and not qkv.lora_a[0, r:].any()  # type: ignore[attr-defined]
    finally:
        assert old is not None
        runner.lora.load_slot(0, old)
