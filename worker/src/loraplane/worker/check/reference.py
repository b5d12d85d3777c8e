"""Independent references: HF transformers + PEFT, and adapters merged into the base weights.

Nothing here imports our model code: the reference reads the same files from disk.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraplane.worker.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_DEFAULT_ALPHA


def _hf_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_hf(model_dir: str | Path, dtype: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=_hf_dtype(dtype), attn_implementation="eager"
    )
    return model.to(device).eval()


def load_peft(
    model_dir: str | Path, adapter_dir: str | Path, dtype: str, device: str
) -> torch.nn.Module:
    from peft import PeftModel

    base = load_hf(model_dir, dtype, device)
    return PeftModel.from_pretrained(base, str(adapter_dir)).to(device).eval()


def write_merged_checkpoint(
    model_dir: str | Path, adapter_dir: str | Path, out: str | Path
) -> Path:
    """A copy of the checkpoint with W <- W + scaling * B @ A for every LoRA pair (fp32 math)."""
    model_dir, adapter_dir, out = Path(model_dir), Path(adapter_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    from peft.utils.other import get_pattern_key

    def scaling(module: str) -> float:
        """The module's scaling with rank_pattern / alpha_pattern matched by PEFT's own rule."""
        ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
        r = int(ranks.get(get_pattern_key(ranks.keys(), module), cfg["r"]))
        alpha = float(
            alphas.get(
                get_pattern_key(alphas.keys(), module), cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
            )
        )
        return alpha / (r**0.5 if cfg.get("use_rslora") else r)

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            base_key, _, ab = key.rpartition(".lora_")
            base_key = base_key.removeprefix("base_model.model.") + ".weight"
            pairs.setdefault(base_key, {})[ab.split(".")[0]] = f.get_tensor(key).float()
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                if key in pairs:
                    ab = pairs.pop(key)
                    s = scaling(key.removesuffix(".weight"))
                    t = (t.float() + s * (ab["B"] @ ab["A"])).to(t.dtype)
                tensors[key] = t.contiguous()
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    if pairs:
        raise ValueError(f"adapter weights for {sorted(pairs)} match no tensor of {model_dir}")
    for extra in model_dir.iterdir():
        if extra.suffix != ".safetensors" and extra.is_file():
            shutil.copy(extra, out / extra.name)
    return out


_CACHE: dict[tuple[object, ...], torch.Tensor] = {}


def cached_logprobs(
    kind: str,
    model_dir: Path | str,
    adapter: Path | str | None,
    dtype: str,
    device: str,
    seqs: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """Reference logprobs of `seqs`, computed once per process for the same inputs.

    The references do not depend on our backend, so checks that run our runtime several
    ways (triton and torch, one rank and many) pay for each reference model once.
    """
    keys = [(kind, str(model_dir), str(adapter), dtype, device, tuple(s)) for s in seqs]
    missing = [s for s, k in zip(seqs, keys, strict=True) if k not in _CACHE]
    if missing:
        if kind == "base":
            model = load_hf(model_dir, dtype, device)
        elif kind == "peft":
            assert adapter is not None
            model = load_peft(model_dir, adapter, dtype, device)
        else:
            import tempfile

            assert adapter is not None
            with tempfile.TemporaryDirectory(prefix="loraplane-merged-") as tmp:
                model = load_hf(write_merged_checkpoint(model_dir, adapter, tmp), dtype, device)
        for s in missing:
            _CACHE[(kind, str(model_dir), str(adapter), dtype, device, tuple(s))] = (
                sequence_logprobs(model, s, device).cpu()
            )
        del model
    return [_CACHE[k] for k in keys]


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, ids: Sequence[int], device: str) -> torch.Tensor:
    """log-softmax over the vocabulary at every position of `ids`: [len(ids), vocab] (fp32)."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logits = model(input_ids=x).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
