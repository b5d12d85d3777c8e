"""Adapter sources (local roots, pvc, hf URL resolution) and the preflight of an adapter."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.controlplane.app import http_status
from loraplane.controlplane.errors import ApiError
from loraplane.controlplane.settings import SourcesSettings
from loraplane.controlplane.sources import PoolLimits, SourceResolver, preflight

pytestmark = pytest.mark.unit
POOL = PoolLimits(
    model="/models/tiny-llama",
    max_lora_rank=16,
    target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
)


def check(
    directory: Path, sha256: str | None = None, pool: PoolLimits = POOL, max_bytes: int = 1 << 30
) -> object:
    return preflight(directory, sha256, pool, max_bytes)


def rejected(directory: Path, **kwargs: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        check(directory, **kwargs)  # type: ignore[arg-type]
    assert http_status(info.value) == 400
    return info.value


def test_a_good_adapter_passes_and_reports_its_facts(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter(rank=8, alpha=16, modules=("q_proj", "v_proj"))
    digest = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
    facts = check(directory, sha256=digest.upper())
    assert facts.rank == 8 and facts.alpha == 16.0  # type: ignore[attr-defined]
    assert facts.target_modules == ("q_proj", "v_proj")  # type: ignore[attr-defined]
    assert facts.digest == digest  # type: ignore[attr-defined]
    assert facts.path == str(directory)  # type: ignore[attr-defined]


def test_rank_above_pool_max(make_adapter: Callable[..., Path]) -> None:
    error = rejected(make_adapter(rank=32))
    assert error.code == "preflight_failed"
    assert "r=32 is above the pool's max_lora_rank=16" in error.message


def test_unsupported_target_modules(make_adapter: Callable[..., Path]) -> None:
    error = rejected(make_adapter(modules=("q_proj", "gate_proj")))
    assert "['gate_proj'] are not supported by the pool" in error.message
    error = rejected(make_adapter(modules=("q_proj", "lm_head")))
    assert "target_modules: LoRA on ['lm_head'] is not supported" in error.message


def test_base_model_mismatch(make_adapter: Callable[..., Path]) -> None:
    error = rejected(make_adapter(base="meta-llama/Llama-3-8B"))
    assert "trained on base model 'meta-llama/Llama-3-8B'" in error.message


def test_base_model_matching_by_final_path_component(make_adapter: Callable[..., Path]) -> None:
    check(make_adapter(base="org/tiny-llama"))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_weights(make_adapter: Callable[..., Path], dtype: str, poison: str) -> None:
    error = rejected(make_adapter(dtype=dtype, poison=poison))
    assert "NaN or infinite" in error.message


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_adapters_pass(make_adapter: Callable[..., Path], dtype: str) -> None:
    check(make_adapter(dtype=dtype))


def test_digest_mismatch_names_both_digests(make_adapter: Callable[..., Path]) -> None:
    error = rejected(make_adapter(), sha256="0" * 64)
    assert error.code == "digest_mismatch"
    assert error.field == "body.source.sha256"
    assert "expected " + "0" * 64 in error.message


def test_missing_config(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter()
    (directory / "adapter_config.json").unlink()
    assert "adapter_config.json is missing" in rejected(directory).message


def test_config_not_json(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter()
    (directory / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in rejected(directory).message


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"peft_type": "IA3"}, "only LORA"),
        ({"r": "8"}, "r must be a positive integer"),
        ({"r": 0}, "r must be a positive integer"),
        ({"target_modules": []}, "target_modules must be a non-empty list"),
        ({"lora_alpha": "x"}, "lora_alpha must be a number"),
    ],
)
def test_bad_config_fields(
    make_adapter: Callable[..., Path], extra: dict[str, object], needle: str
) -> None:
    assert needle in rejected(make_adapter(config_extra=extra)).message


def test_tensor_rank_must_match_config(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter(rank=8)
    other = make_adapter("other", rank=4)
    (directory / "adapter_model.safetensors").write_bytes(
        (other / "adapter_model.safetensors").read_bytes()
    )
    assert "lora_A must be [r=8, in]" in rejected(directory).message


def test_truncated_weights(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter()
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])
    assert "lies outside the file" in rejected(directory).message


def test_oversized_weights(make_adapter: Callable[..., Path]) -> None:
    error = rejected(make_adapter(), max_bytes=100)
    assert error.code == "adapter_too_large"


def resolver(tmp_path: Path, **kwargs: object) -> SourceResolver:
    return SourceResolver(SourcesSettings(cache_dir=tmp_path / "cache", **kwargs))  # type: ignore[arg-type]


def test_file_source_under_an_allowed_root(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    directory = make_adapter()
    assert (
        resolver(tmp_path, allowed_roots=[tmp_path]).fetch(f"file://{directory}")
        == directory.resolve()
    )


def test_file_source_outside_the_allowed_roots(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    directory = make_adapter()
    root = tmp_path / "models"
    root.mkdir()
    with pytest.raises(ApiError) as info:
        resolver(tmp_path, allowed_roots=[root]).fetch(f"file://{directory}")
    assert info.value.code == "source_not_allowed"
    assert info.value.field == "body.source.uri"
    assert "outside the allowed roots" in info.value.message


def test_symlink_escaping_the_root_is_refused(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    directory = make_adapter()
    root = tmp_path / "models"
    root.mkdir()
    (root / "sneaky").symlink_to(directory)
    with pytest.raises(ApiError, match="outside the allowed roots"):
        resolver(tmp_path, allowed_roots=[root]).fetch(f"file://{root}/sneaky")


def test_dot_dot_escaping_the_root_is_refused(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    make_adapter()
    root = tmp_path / "models"
    root.mkdir()
    with pytest.raises(ApiError, match="outside the allowed roots"):
        resolver(tmp_path, allowed_roots=[root]).fetch(f"file://{root}/../adapter")


def test_no_allowed_roots_configured_refuses_file_sources(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    with pytest.raises(ApiError, match="none configured"):
        resolver(tmp_path).fetch(f"file://{make_adapter()}")


def test_pvc_source_maps_under_the_claim(tmp_path: Path, make_adapter: Callable[..., Path]) -> None:
    target = make_adapter("pvcs/claim-a/adapters/x")
    found = resolver(tmp_path, pvc_root=tmp_path / "pvcs").fetch("pvc://claim-a/adapters/x")
    assert found == target.resolve()
    with pytest.raises(ApiError, match="outside the claim"):
        resolver(tmp_path, pvc_root=tmp_path / "pvcs").fetch("pvc://claim-a/../claim-b/x")


def test_hf_uri_resolution(tmp_path: Path) -> None:
    r = resolver(tmp_path, hf_endpoint="http://mirror.local/")
    assert (
        r.hf_url("hf://org/repo", "adapter_config.json")
        == "http://mirror.local/org/repo/resolve/main/adapter_config.json"
    )
    assert r.hf_url("hf://org/repo@v1.0", "x") == "http://mirror.local/org/repo/resolve/v1.0/x"
    with pytest.raises(ApiError, match=r"hf://<org>/<repo>\[@revision\]"):
        r.hf_url("hf://just-a-name", "x")


def test_unsupported_scheme(tmp_path: Path) -> None:
    with pytest.raises(ApiError, match="unsupported scheme 'ftp'"):
        resolver(tmp_path).fetch("ftp://x/y")


def model_dir(tmp_path: Path, hidden: int) -> str:
    directory = tmp_path / "tiny-llama"
    directory.mkdir(parents=True)
    config = {
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_shapes_that_do_not_fit_a_readable_base_model_are_refused(
    tmp_path: Path, make_adapter: Callable[..., Path]
) -> None:
    """Where the control plane can read the pool's model config, an adapter for another model
    is refused before any worker is touched (or any adapter evicted to make room for it)."""
    adapter = make_adapter(hidden=32)
    fits = PoolLimits(model_dir(tmp_path / "a", hidden=32), 16, POOL.target_modules)
    assert check(adapter, pool=fits).rank == 8  # type: ignore[attr-defined]
    other = PoolLimits(model_dir(tmp_path / "b", hidden=48), 16, POOL.target_modules)
    error = rejected(adapter, pool=other)
    assert error.code == "preflight_failed"
    assert "self_attn.q_proj.lora_A.weight' has shape [8, 32]" in error.message
    assert "q_proj of the pool's model has in=48" in error.message


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"use_dora": True}, "use_dora is True: not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is ['lm_head']: not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out is True: not supported"),
        ({"bias": "lora_only"}, "bias is 'lora_only': not supported"),
        ({"lora_bias": True}, "lora_bias is True: not supported"),
        ({"rank_pattern": {"q_proj": 32}}, "rank_pattern {'q_proj': 32} is above the pool's"),
        ({"rank_pattern": {"q_proj": "4"}}, "rank_pattern must map module names to positive"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "LoRA on ['embed_tokens'] is not"),
    ],
)
def test_peft_fields_that_change_the_math_are_refused_by_name(
    make_adapter: Callable[..., Path], extra: dict[str, object], needle: str
) -> None:
    assert needle in rejected(make_adapter(config_extra=extra)).message


def test_rank_pattern_and_full_module_paths_pass(make_adapter: Callable[..., Path]) -> None:
    """PEFT's all-linear writes full module paths; a rank_pattern gives a module its own rank
    (the tensors' shapes must then follow it)."""
    directory = make_adapter(rank=4, modules=("q_proj",))
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(
        r=8,
        rank_pattern={"q_proj": 4},
        target_modules=["model.layers.0.self_attn.q_proj"],
        layers_to_transform=[0],
    )
    (directory / "adapter_config.json").write_text(json.dumps(config))
    facts = check(directory)
    assert facts.target_modules == ("q_proj",)  # type: ignore[attr-defined]
    config["rank_pattern"] = {"v_proj": 4}  # q_proj's tensors are now r=4 against r=8
    (directory / "adapter_config.json").write_text(json.dumps(config))
    assert "lora_A must be [r=8, in]" in rejected(directory).message


def test_config_nested_too_deeply_is_refused(make_adapter: Callable[..., Path]) -> None:
    directory = make_adapter()
    (directory / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    error = rejected(directory)
    assert error.code == "preflight_failed" and error.field == "body.source.uri"
    assert "adapter_config.json is nested too deeply" in error.message


@pytest.mark.parametrize("uri", ["file:///tmp/a\x00b", "file:///tmp/a\nb", "s3://b/\x00"])
def test_control_characters_in_a_uri_are_refused(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ApiError) as info:
        resolver(tmp_path, allowed_roots=[tmp_path]).fetch(uri)
    assert http_status(info.value) == 400 and info.value.field == "body.source.uri"
    assert "control character" in info.value.message


def test_an_error_quotes_only_a_prefix_of_a_long_uri(tmp_path: Path) -> None:
    for uri in ("ftp://" + "x" * 100_000, "file:///" + "y" * 100_000):
        with pytest.raises(ApiError) as info:
            resolver(tmp_path, allowed_roots=[tmp_path]).fetch(uri)
        assert http_status(info.value) == 400 and len(info.value.message) < 400
        assert "(100006 characters)" in info.value.message or "100008" in info.value.message
