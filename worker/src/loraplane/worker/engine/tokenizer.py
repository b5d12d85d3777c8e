"""Text in and out: `tokenizer.json` via the `tokenizers` library, chat template via jinja2."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"model directory {model_dir} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        template = self.config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"  # where transformers >= 4.50 saves it
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next(
                (t.get("template") for t in template if t.get("name") == "default"), None
            )
        self.chat_template: jinja2.Template | None = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.chat_template = env.from_string(template)
        self.eos_token_ids = self._eos_ids(model_dir)

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            p = model_dir / name
            if p.is_file():
                value = json.loads(p.read_text()).get("eos_token_id")
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, list):
                    ids.update(int(v) for v in value)
        if self.eos_token is not None:
            tid = self.tokenizer.token_to_id(self.eos_token)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.chat_template is None:
            raise TokenizerError(
                "messages: this model's tokenizer_config.json has no chat_template"
            )
        try:
            text = self.chat_template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"messages: the chat template failed to render ({exc})") from exc
        return self.encode(text, add_special_tokens=False)


def _raise(message: str) -> None:
    raise TokenizerError(f"messages: {message}")
