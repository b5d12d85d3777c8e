"""Every way an adapter can be rejected names the field and the reason, and changes nothing:
no slot buffer, rank, scaling or resident adapter moves."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.worker.config import LoRARuntimeConfig
from loraplane.worker.engine.runner import ModelRunner, RunnerConfig
from loraplane.worker.lora import adapter as adapter_module
from loraplane.worker.lora.adapter import AdapterError, load_adapter

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


def _fp8_dtype(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A] = t[KEY_A].to(torch.float8_e4m3fn)


def _named_twice(t: dict[str, torch.Tensor]) -> None:
    # PEFT writes either spelling; both at once would silently overwrite one with the other
    t[KEY_A.replace("lora_A.weight", "lora_A.default.weight")] = t[KEY_A].clone()


def _named_twice_without_prefix(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A.removeprefix("base_model.model.")] = t[KEY_A].clone()


def _attention_module_under_mlp(t: dict[str, torch.Tensor]) -> None:
    t[KEY_A.replace("self_attn", "mlp")] = t.pop(KEY_A)


def _mlp_module_under_attention(t: dict[str, torch.Tensor]) -> None:
    real = KEY_A.replace("self_attn.q_proj", "mlp.gate_proj")
    t[real.replace("mlp", "self_attn")] = t.pop(real)


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
    (
        "modules_to_save",
        lambda p: edit_config(p, modules_to_save=["lm_head"]),
        "modules_to_save",
        "not supported",
    ),
    (
        "fan_in_fan_out",
        lambda p: edit_config(p, fan_in_fan_out=True),
        "fan_in_fan_out",
        "only False",
    ),
    ("lora_bias", lambda p: edit_config(p, lora_bias=True), "lora_bias", "not supported"),
    (
        "layer_replication",
        lambda p: edit_config(p, layer_replication=[[0, 2]]),
        "layer_replication",
        "not supported",
    ),
    (
        "trainable tokens",
        lambda p: edit_config(p, trainable_token_indices=[5, 6]),
        "trainable_token_indices",
        "not supported",
    ),
    (
        "LoRA on embed_tokens",
        lambda p: edit_config(p, target_modules=["q_proj", "embed_tokens"]),
        "target_modules",
        "LoRA on ['embed_tokens'] is not supported",
    ),
    (
        "LoRA on lm_head",
        lambda p: edit_config(p, target_modules=["lm_head", "v_proj"]),
        "target_modules",
        "LoRA on ['lm_head'] is not supported",
    ),
    (
        "rank_pattern above max",
        lambda p: edit_config(p, rank_pattern={"q_proj": 32}),
        "rank_pattern",
        "above max_lora_rank 16",
    ),
    (
        "rank_pattern not an integer",
        lambda p: edit_config(p, rank_pattern={"q_proj": 2.5}),
        "rank_pattern",
        "must be a positive integer",
    ),
    (
        "alpha_pattern not a number",
        lambda p: edit_config(p, alpha_pattern={"q_proj": "big"}),
        "alpha_pattern",
        "must be a finite number",
    ),
    ("non-finite", lambda p: edit_tensor(p, _nan), KEY_A, "NaN or Inf"),
    ("shape", lambda p: edit_tensor(p, _wrong_shape), KEY_A, "does not fit the base model"),
    (
        "unknown module tensor",
        lambda p: edit_tensor(p, _unknown_module),
        "rotary_proj",
        "not a LoRA target",
    ),
    ("integer tensor", lambda p: edit_tensor(p, _int_dtype), KEY_A, "dtype I32 is not supported"),
    ("fp8 tensor", lambda p: edit_tensor(p, _fp8_dtype), KEY_A, "dtype F8_E4M3 is not supported"),
    ("key named twice", lambda p: edit_tensor(p, _named_twice), KEY_A, "duplicates"),
    (
        "key named twice, with and without prefix",
        lambda p: edit_tensor(p, _named_twice_without_prefix),
        KEY_A,
        "duplicates",
    ),
    (
        "attention module under mlp",
        lambda p: edit_tensor(p, _attention_module_under_mlp),
        "layers.0.mlp.q_proj.lora_A",
        "q_proj sits under self_attn, not mlp",
    ),
    (
        "mlp module under self_attn",
        lambda p: edit_tensor(p, _mlp_module_under_attention),
        "layers.0.self_attn.gate_proj.lora_A",
        "gate_proj sits under mlp, not self_attn",
    ),
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
        "config not UTF-8",
        lambda p: (p / "adapter_config.json").write_bytes(b'\xff\xfe{"r": 8}'),
        "adapter_config.json",
        "is not UTF-8 text",
    ),
    (
        "lora_alpha beyond a float",
        lambda p: edit_config(p, lora_alpha=10**400),
        "lora_alpha",
        "must be a finite number",
    ),
    (
        "config number too long to parse",
        lambda p: (p / "adapter_config.json").write_text('{"r": ' + "9" * 5000 + "}"),
        "adapter_config.json",
        "not valid JSON",
    ),
    (
        "target_modules not a list",
        lambda p: edit_config(p, target_modules=7),
        "target_modules",
        "must be a list of module names",
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


def test_config_read_error_is_named(
    runner: ModelRunner, suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError reading the config (permissions, I/O) is a rejection, not a crash. (A
    chmod 000 file would show it for other users, but CI runs as root, which reads it anyway.)"""
    path = copy_adapter(suite, tmp_path)
    real_read_text = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == "adapter_config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(AdapterError, match=r"adapter_config.json: .* cannot be read"):
        runner.read_adapter("locked", path)


def test_value_the_slot_dtype_cannot_hold_is_named(
    runner: ModelRunner, suite, tmp_path: Path
) -> None:
    """65536 is finite in the adapter's fp32 but Inf in an fp16 slot: rejected at validation."""
    path = copy_adapter(suite, tmp_path)
    key_b = KEY_A.replace("lora_A", "lora_B")
    edit_tensor(path, lambda t: t[key_b].__setitem__((0, 0), 65536.0))
    config = runner.model_config
    with pytest.raises(AdapterError) as err:
        load_adapter("wide", path, config, max_rank=16, slot_dtype=torch.float16)
    assert key_b in str(err.value) and "largest torch.float16 value" in str(err.value)
    # None: the checkpoint's dtype decides
    fp16_checkpoint = dataclasses.replace(config, torch_dtype="float16")
    with pytest.raises(AdapterError, match=r"largest torch\.float16 value"):
        load_adapter("wide", path, fp16_checkpoint, max_rank=16)
    fits = load_adapter("wide", path, config, max_rank=16, slot_dtype=torch.float32)
    assert fits.dense[(0, "q_proj")][1][0, 0] == 65536.0


def test_missing_lora_alpha_scales_like_peft(runner: ModelRunner, suite, tmp_path: Path) -> None:
    """Without lora_alpha PEFT's LoraConfig uses 8 (not r): the scaling must agree with PEFT's."""
    pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    from loraplane.worker.check.reference import load_peft

    path = copy_adapter(suite, tmp_path, "a4")  # r = 4, so alpha = r would give a different scaling
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    ours = runner.read_adapter("no-alpha", path)
    model_dir, _ = suite["llama"]
    peft_model = load_peft(model_dir, path, "float32", "cpu")
    theirs = {m.scaling["default"] for m in peft_model.modules() if isinstance(m, LoraLayer)}
    assert theirs == {ours.scaling} == {8 / 4}


class _SpyOpen:
    """safe_open that records which tensors are read."""

    read: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._file = _REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self) -> _SpyOpen:
        self._file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def get_slice(self, key: str) -> Any:
        return self._file.get_slice(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        self.read.append(key)
        return self._file.get_tensor(key)


_REAL_SAFE_OPEN = adapter_module.safe_open
STRAY = "base_model.model.lm_head.lora_A.weight"


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda t: t.__setitem__(STRAY, torch.zeros(8, 4096)), STRAY),
        (_wrong_shape, KEY_A),
        (_fp8_dtype, KEY_A),
        (_named_twice, KEY_A),
        (_missing_b, "adapter_model.safetensors"),
    ],
    ids=["unknown key", "shape", "dtype", "named twice", "half a pair"],
)
def test_header_is_checked_before_any_tensor_is_read(
    runner: ModelRunner,
    suite,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: Callable[[dict[str, torch.Tensor]], None],
    field: str,
) -> None:
    path = copy_adapter(suite, tmp_path)
    edit_tensor(path, damage)
    monkeypatch.setattr(adapter_module, "safe_open", _SpyOpen)
    monkeypatch.setattr(_SpyOpen, "read", [])
    with pytest.raises(AdapterError) as err:
        runner.read_adapter("stray", path)
    assert field in str(err.value)
    assert _SpyOpen.read == []
    runner.read_adapter("good", copy_adapter(suite, tmp_path / "good"))
    assert len(_SpyOpen.read) > 1  # the spy does see reads


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
