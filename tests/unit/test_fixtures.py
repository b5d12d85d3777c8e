"""Fixture checkpoints and adapters are real: transformers and PEFT load them and compute
what docs/fixtures.md says they compute."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_save

from loraplane.worker.fixtures import (
    ARCHES,
    SPECIAL_TOKENS,
    ModelSpec,
    default_targets,
    make_adapter,
    make_model,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.unit

TOKEN_IDS = torch.tensor([[1, 17, 99, 250, 3, 480, 7, 64, 300, 12, 5, 200]])


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch, seed=3) for arch in ARCHES}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base_logprobs(models: dict[str, Path]) -> dict[str, torch.Tensor]:
    return {arch: _logprobs(_load(model_dir)) for arch, model_dir in models.items()}


def _load(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKEN_IDS).logits.float().log_softmax(-1)  # [1, seq, vocab]


@pytest.mark.parametrize("arch", ARCHES)
def test_checkpoint_loads_with_transformers_and_keeps_our_weights(
    models: dict[str, Path], arch: str
):
    model_dir = models[arch]
    config = json.loads((model_dir / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == config["architectures"][0]
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]

    # transformers must hold exactly the values we wrote (not a re-initialisation)
    written = load_file(model_dir / "model.safetensors")
    layer = model.model.layers[1]
    assert torch.equal(
        layer.self_attn.k_proj.weight, written["model.layers.1.self_attn.k_proj.weight"]
    )
    if arch == "qwen2":
        assert torch.equal(
            layer.self_attn.q_proj.bias, written["model.layers.1.self_attn.q_proj.bias"]
        )
    if arch == "qwen3-moe":
        gate_up = torch.cat(
            [
                written["model.layers.1.mlp.experts.5.gate_proj.weight"],
                written["model.layers.1.mlp.experts.5.up_proj.weight"],
            ]
        )
        assert torch.equal(layer.mlp.experts.gate_up_proj[5], gate_up)
        assert torch.equal(
            layer.mlp.experts.down_proj[5], written["model.layers.1.mlp.experts.5.down_proj.weight"]
        )

    logprobs = _logprobs(model.eval())
    assert torch.isfinite(logprobs).all()
    # not flat: the most likely token is clearly more likely than uniform
    assert logprobs.max(-1).values.exp().mean() > 5.0 / config["vocab_size"]


def test_tokenizer_round_trips_and_applies_chat_template(models: dict[str, Path]):
    from tokenizers import Tokenizer

    model_dir = models["qwen3"]
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Hello, world! The quick brown fox — ünïcode 漢字 and\ttabs\nnewlines."
    encoding = raw.encode(text)
    assert encoding.ids[0] == SPECIAL_TOKENS.index("<|bos|>")
    assert raw.decode(encoding.ids, skip_special_tokens=True) == text
    assert max(encoding.ids) < json.loads((model_dir / "config.json").read_text())["vocab_size"]

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer(text)["input_ids"] == encoding.ids
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == text

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == raw.encode(prompt, add_special_tokens=False).ids
    assert ids.count(SPECIAL_TOKENS.index("<|bos|>")) == 1
    assert ids.count(SPECIAL_TOKENS.index("<|im_start|>")) == 3


def _merged_reference(model_dir: Path, adapter_dir: Path):
    """The base model with the adapter merged in by the math of docs/fixtures.md, computed
    here independently of PEFT."""
    model = _load(model_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, lora_a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            parts = path.split(".")
            if "experts" in parts and parts[-2].isdigit():
                # per-expert: ...mlp.experts.{e}.{gate,up,down}_proj
                experts_path, expert, proj = path.rsplit(".", 2)
                delta = scaling * lora_b @ lora_a  # [out, in]
                e = int(expert)
                if proj == "down_proj":
                    params[f"{experts_path}.down_proj"][e] += delta
                else:
                    gate_up = params[f"{experts_path}.gate_up_proj"]
                    inter = gate_up.shape[1] // 2
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    gate_up[e, rows] += delta
            elif parts[-1] == "experts" or parts[-2:] == ["experts", "base_layer"]:
                # fused: experts stacked in the rank dimension; with both parameters targeted
                # gate_up_proj is the inner wrapper (base_layer), down_proj the outer
                experts_path = path.removesuffix(".base_layer")
                targets = config["target_parameters"]
                if parts[-1] == "base_layer":
                    name = "gate_up_proj"
                elif len(targets) == 2:
                    name = "down_proj"
                else:
                    name = targets[0].rsplit(".", 1)[-1]
                param = params[f"{experts_path}.{name}"]
                num_experts = param.shape[0]
                a = lora_a.reshape(num_experts, rank, -1)  # [E, r, in]
                b = lora_b.reshape(lora_b.shape[0], rank, num_experts).permute(
                    2, 0, 1
                )  # [E, out, r]
                param += scaling * torch.bmm(b, a)  # [E, out, in]
            else:
                params[f"{path}.weight"] += scaling * lora_b @ lora_a
    return model


def _load_peft(model_dir: Path, adapter_dir: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(_load(model_dir), adapter_dir)
    messages = [str(w.message).lower() for w in caught]
    assert not [m for m in messages if "missing" in m or "unexpected" in m], messages
    return model.eval()


@pytest.mark.parametrize("arch", ARCHES)
def test_adapter_loads_with_peft_and_applies_documented_math(
    models: dict[str, Path], base_logprobs: dict[str, torch.Tensor], arch: str, tmp_path: Path
):
    adapter_dir = make_adapter(
        models[arch], tmp_path / "a", rank=8, alpha=16, targets=default_targets(arch)
    )
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(models[arch].resolve())
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    assert tensors[key].abs().min() > 0  # B is not zero-initialised

    base = base_logprobs[arch]
    with_lora = _logprobs(_load_peft(models[arch], adapter_dir))
    merged = _logprobs(_merged_reference(models[arch], adapter_dir))
    delta = (with_lora - base).abs().mean().item()
    assert 0.03 < delta < 0.6, f"mean |Δlogprob| = {delta}"
    torch.testing.assert_close(with_lora, merged, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("expert_format", "targets", "use_rslora"),
    [
        ("per-expert", ["q_proj", "v_proj"], False),
        ("per-expert", ["o_proj", "down_proj"], False),
        ("fused", ["q_proj"], False),
        ("fused", ["gate_proj", "up_proj"], True),
        ("fused", ["down_proj"], False),
    ],
)
def test_expert_adapter_loads_with_peft_on_qwen3_moe(
    models: dict[str, Path],
    base_logprobs: dict[str, torch.Tensor],
    tmp_path: Path,
    expert_format: str,
    targets: list[str],
    use_rslora: bool,
):
    model_dir = models["qwen3-moe"]
    adapter_dir = make_adapter(
        model_dir,
        tmp_path / "a",
        rank=4,
        alpha=12,
        targets=targets,
        experts=True,
        expert_format=expert_format,  # type: ignore[arg-type]
        use_rslora=use_rslora,
        seed=1,
    )
    keys = set(load_file(adapter_dir / "adapter_model.safetensors"))
    if expert_format == "per-expert":
        assert "base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_A.weight" in keys
    config = json.loads((adapter_dir / "adapter_config.json").read_text())

    base = base_logprobs["qwen3-moe"]
    peft_model = _load_peft(model_dir, adapter_dir)
    with_lora = _logprobs(peft_model)
    merged = _logprobs(_merged_reference(model_dir, adapter_dir))
    assert (with_lora - base).abs().mean() > 0.01
    torch.testing.assert_close(with_lora, merged, atol=1e-5, rtol=0)
    # the experts really are LoRA'd (not only attention): PEFT wrapped the 3D parameters
    wrapped = {type(m).__name__ for m in peft_model.modules()}
    assert "ParamWrapper" in wrapped
    if expert_format == "fused":
        assert config["target_parameters"]


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_same_seed_writes_identical_files_and_another_seed_differs(
    models: dict[str, Path], tmp_path: Path
):
    args = {"rank": 4, "alpha": 8, "targets": ["q_proj", "k_proj"], "experts": True}
    first = make_model(tmp_path / "m1", "qwen3-moe", seed=3)
    assert _file_bytes(first) == _file_bytes(models["qwen3-moe"])
    a1 = make_adapter(first, tmp_path / "a1", seed=5, **args)
    a2 = make_adapter(first, tmp_path / "a2", seed=5, **args)
    assert _file_bytes(a1) == _file_bytes(a2)
    a3 = make_adapter(first, tmp_path / "a3", seed=6, **args)
    assert (
        _file_bytes(a3)["adapter_model.safetensors"] != _file_bytes(a1)["adapter_model.safetensors"]
    )
    other = make_model(tmp_path / "m2", "qwen3-moe", seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_bfloat16_checkpoint_is_the_float32_one_rounded(models: dict[str, Path], tmp_path: Path):
    model_dir = make_model(tmp_path / "bf16", "qwen3", seed=3, dtype="bfloat16")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        dtypes = {handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    bf16 = load_file(model_dir / "model.safetensors")
    fp32 = load_file(models["qwen3"] / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    adapter = make_adapter(
        model_dir, tmp_path / "a", rank=2, alpha=4, targets=["q_proj"], dtype="bfloat16"
    )
    assert {t.dtype for t in load_file(adapter / "adapter_model.safetensors").values()} == {
        torch.bfloat16
    }


def test_streaming_writer_matches_the_safetensors_library(models: dict[str, Path]):
    path = models["qwen2"] / "model.safetensors"
    assert path.read_bytes() == safetensors_save(load_file(path), metadata={"format": "pt"})


def test_one_billion_parameter_shape_is_accepted():
    spec = ModelSpec(
        arch="llama",
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
    )
    assert spec.num_parameters() >= 1_000_000_000


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("llama", {"targets": ["qkv_proj"]}, "unknown module"),
        ("llama", {"targets": ["q_proj"], "experts": True}, "no routed experts"),
        ("qwen3-moe", {"targets": ["down_proj"]}, "pass experts=True"),
        ("qwen3-moe", {"targets": ["gate_proj"], "experts": True}, "together"),
        ("qwen3-moe", {"targets": ["q_proj"], "experts": True, "use_rslora": True}, "use_rslora"),
        ("qwen3", {"targets": ["q_proj"], "rank": 0}, "rank=0"),
    ],
)
def test_make_adapter_rejects_bad_requests_naming_the_field(
    models: dict[str, Path], tmp_path: Path, arch: str, kwargs: dict, message: str
):
    call = {"rank": 4, "alpha": 8.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_adapter(models[arch], tmp_path / "a", **call)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "mistral"}, "arch='mistral'"),
        ({"arch": "llama", "num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3"),
        ({"arch": "llama", "vocab_size": 100}, "vocab_size=100"),
        ({"arch": "llama", "dtype": "float16"}, "dtype='float16'"),
        (
            {"arch": "qwen3-moe", "num_experts": 2, "num_experts_per_tok": 4},
            "num_experts_per_tok=4",
        ),
    ],
)
def test_make_model_rejects_bad_shapes_naming_the_field(tmp_path: Path, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "m", **kwargs)
