"""Adapter sources and the preflight that runs before any worker is touched.

An adapter is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``
(PEFT format). ``file://`` and ``pvc://`` are read in place (the path must lie under an
allowed root); ``s3://``, ``http(s)://`` and ``hf://`` are copied into the content-addressed
cache ``<cache_dir>/<sha256 of the weights>/``, which workers must be able to read (a shared
volume in Kubernetes). ``sha256`` is the digest of ``adapter_model.safetensors``.

Remote sources are fetched with the control plane's own credentials (``AWS_*`` for S3,
``hf_token`` for hf://) unless the request carries per-adapter ``SourceCredentials``; those
are used for that one fetch only, never stored and never logged (their values are
``SecretStr``). A cached copy is never handed out without a fetch: every remote source is
downloaded again with the request's credentials before its digest names the cache entry.

Blocking I/O: call from a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import httpx
import numpy as np
from pydantic import SecretStr

from loraplane.controlplane.errors import InvalidSource, excerpt
from loraplane.controlplane.settings import SourcesSettings
from loraplane.rules.peft import refused_peft_field

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1024 * 1024
# PEFT's LoraConfig default when adapter_config.json has no lora_alpha (the worker uses it too).
PEFT_DEFAULT_ALPHA = 8
DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
)
FIELD = "body.source.uri"
MAX_URI_CHARS = 2048  # (the API's and the CRD's limit too: api/adapters.py, crds/)
CREDENTIALS_FIELD = "body.source.credentials"


def source_error(message: str, code: str = "invalid_source", field: str = FIELD) -> InvalidSource:
    return InvalidSource(f"{field}: {message}", code=code, field=field)


@dataclass(frozen=True, slots=True)
class PoolLimits:
    model: str
    max_lora_rank: int
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES


@dataclass(frozen=True, slots=True)
class AdapterFacts:
    path: str  # what workers load
    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None


@dataclass(frozen=True, slots=True)
class SourceCredentials:
    """Per-adapter credentials for one fetch (the request's ``source.credentials``).

    ``aws_*`` for ``s3://`` (access key id and secret together, session token optional);
    ``token``, sent as ``Authorization: Bearer``, for ``http(s)://`` and ``hf://``."""

    aws_access_key_id: SecretStr | None = None
    aws_secret_access_key: SecretStr | None = None
    aws_session_token: SecretStr | None = None
    token: SecretStr | None = None

    def given(self) -> list[str]:
        """Names of the keys that hold a value."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def value(self, name: str) -> str | None:
        secret: SecretStr | None = getattr(self, name)
        return None if secret is None else secret.get_secret_value()


# The credential keys each scheme uses (file:// and pvc:// take none).
CREDENTIAL_KEYS: dict[str, tuple[str, ...]] = {
    "s3": ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"),
    "http": ("token",),
    "https": ("token",),
    "hf": ("token",),
}


def check_credentials(uri: str, credentials: SourceCredentials | None) -> None:
    """400 naming the key when ``credentials`` do not fit the scheme of ``uri``."""
    given = credentials.given() if credentials is not None else []
    if not given:
        return
    scheme = urlparse(uri).scheme.lower()
    usable = CREDENTIAL_KEYS.get(scheme, ())
    for name in given:
        if name not in usable:
            accepted = f"it takes {', '.join(usable)}" if usable else "it takes none"
            raise source_error(
                f"{scheme}:// sources do not use {name}; {accepted}",
                code="invalid_value",
                field=f"{CREDENTIALS_FIELD}.{name}",
            )
    pair = ("aws_access_key_id", "aws_secret_access_key")
    missing = [name for name in pair if name not in given]
    if scheme == "s3" and missing:
        raise source_error(
            "aws_access_key_id and aws_secret_access_key go together "
            "(aws_session_token is optional)",
            code="invalid_value",
            field=f"{CREDENTIALS_FIELD}.{missing[0]}",
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class SourceResolver:
    def __init__(self, settings: SourcesSettings) -> None:
        self.settings = settings

    # -- resolution -------------------------------------------------------------------------
    def fetch(self, uri: str, credentials: SourceCredentials | None = None) -> Path:
        """Return a local directory holding the adapter's two files; remote sources are
        fetched with ``credentials`` when given, else with the control plane's own."""
        if len(uri) > MAX_URI_CHARS:
            raise source_error(f"{excerpt(uri)} is longer than {MAX_URI_CHARS} characters")
        bad = next((c for c in uri if ord(c) < 0x20 or ord(c) == 0x7F), None)
        if bad is not None:
            raise source_error(
                f"{excerpt(uri)} holds the control character {bad!r}; a URI has none"
            )
        check_credentials(uri, credentials)
        credentials = credentials or SourceCredentials()
        parsed = urlparse(uri)
        scheme = parsed.scheme.lower()
        if scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise source_error(
                    f"file:// URI must be absolute (file:///path), got host {parsed.netloc!r}"
                )
            return self._local(Path(parsed.path), self.settings.allowed_roots, "allowed roots")
        if scheme == "pvc":
            if not parsed.netloc:
                raise source_error("pvc:// URI needs a claim name: pvc://<claim>/<path>")
            root = self.settings.pvc_root / parsed.netloc
            return self._local(root / parsed.path.lstrip("/"), [root], f"claim {parsed.netloc!r}")
        if scheme == "s3":
            if not parsed.netloc:
                raise source_error("s3:// URI needs a bucket: s3://<bucket>/<prefix>")
            client = self._s3_client(credentials)
            return self._download(
                uri,
                lambda name, dest: self._s3_get(client, parsed.netloc, parsed.path, name, dest),
            )
        if scheme in ("http", "https"):
            base = uri.rstrip("/")
            token = credentials.value("token")
            return self._download(
                uri, lambda name, dest: self._http_get(f"{base}/{name}", dest, token)
            )
        if scheme == "hf":
            token = credentials.value("token")
            if token is None and self.settings.hf_token is not None:
                token = self.settings.hf_token.get_secret_value()
            return self._download(
                uri, lambda name, dest: self._http_get(self.hf_url(uri, name), dest, token)
            )
        raise source_error(
            f"unsupported scheme {excerpt(parsed.scheme)} in {excerpt(uri)}; use file://, pvc://, s3://, http(s):// or hf://"
        )

    def _local(self, path: Path, roots: Iterable[Path], what: str) -> Path:
        if not path.is_absolute():
            raise source_error(f"path {excerpt(str(path))} must be absolute")
        try:
            real = Path(os.path.realpath(path))
        except (OSError, ValueError) as exc:  # (a name too long for the file system)
            raise source_error(
                f"path {excerpt(str(path))} cannot be resolved ({exc.__class__.__name__}: "
                f"{getattr(exc, 'strerror', None) or exc})",
                code="source_not_found",
            ) from None
        allowed = [Path(os.path.realpath(root)) for root in roots]
        if not any(real == root or root in real.parents for root in allowed):
            shown = (
                ", ".join(str(r) for r in allowed)
                or "none configured (LORAPLANE_SOURCES__ALLOWED_ROOTS)"
            )
            raise source_error(
                f"path {excerpt(str(path))} is outside the {what} [{shown}]",
                code="source_not_allowed",
            )
        try:
            is_dir = real.is_dir()
        except OSError as exc:  # (ENAMETOOLONG, a loop, no permission on a parent)
            raise source_error(
                f"{excerpt(str(path))} cannot be read ({exc.strerror or exc.__class__.__name__})",
                code="source_not_found",
            ) from None
        if not is_dir:
            raise source_error(f"{excerpt(str(path))} is not a directory", code="source_not_found")
        return real

    def hf_url(self, uri: str, name: str) -> str:
        parsed = urlparse(uri)
        repo_rev = (parsed.netloc + parsed.path).strip("/")
        repo, _, revision = repo_rev.partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise source_error(f"hf:// URI must be hf://<org>/<repo>[@revision], got {uri!r}")
        revision = revision or "main"
        return f"{self.settings.hf_endpoint.rstrip('/')}/{repo}/resolve/{quote(revision, safe='')}/{name}"

    def _download(self, uri: str, get: Any) -> Path:
        cache = self.settings.cache_dir
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
        try:
            get(CONFIG_FILE, staging / CONFIG_FILE)
            get(WEIGHTS_FILE, staging / WEIGHTS_FILE)
            digest = sha256_file(staging / WEIGHTS_FILE)
            final = cache / digest
            if final.is_dir():
                return final
            staging.rename(final)
            staging = final
            return final
        finally:
            if staging.name.startswith(".staging-"):
                shutil.rmtree(staging, ignore_errors=True)

    def _limit(self, size: int | None, name: str) -> None:
        limit = MAX_CONFIG_BYTES if name == CONFIG_FILE else self.settings.max_adapter_bytes
        if size is not None and size > limit:
            raise source_error(
                f"{name} is {size} bytes, more than the limit of {limit}", code="adapter_too_large"
            )

    def _http_get(self, url: str, dest: Path, token: str | None) -> None:
        """GET ``url`` into ``dest``; ``token`` as a bearer token (httpx drops it on a
        redirect to another origin)."""
        name = dest.name
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        try:
            with httpx.stream(
                "GET",
                url,
                headers=headers,
                timeout=self.settings.http_timeout_s,
                follow_redirects=True,
            ) as response:
                if response.status_code in (401, 403):
                    given = "the credentials given were refused" if token else "none were given"
                    raise source_error(
                        f"GET {url} answered HTTP {response.status_code}: the source needs "
                        f"credentials and {given}",
                        code="source_not_found",
                    )
                if response.status_code != 200:
                    raise source_error(
                        f"GET {url} answered HTTP {response.status_code}", code="source_not_found"
                    )
                length = response.headers.get("content-length")
                self._limit(int(length) if length and length.isdigit() else None, name)
                written = 0
                with dest.open("wb") as handle:
                    for chunk in response.iter_bytes():
                        written += len(chunk)
                        self._limit(written, name)
                        handle.write(chunk)
        except httpx.HTTPError as exc:
            raise source_error(
                f"GET {url} failed: {type(exc).__name__}: {exc}", code="source_unreachable"
            ) from exc

    def _s3_client(self, credentials: SourceCredentials) -> Any:
        """An S3 client with the per-adapter keys when given, else boto3's default chain
        (``AWS_*`` variables, config files, instance roles)."""
        import boto3

        keys = {
            name: value
            for name in CREDENTIAL_KEYS["s3"]
            if (value := credentials.value(name)) is not None
        }
        return boto3.client("s3", endpoint_url=self.settings.s3_endpoint_url, **keys)

    def _s3_get(self, client: Any, bucket: str, prefix: str, name: str, dest: Path) -> None:
        import botocore.exceptions

        key = f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            self._limit(int(head.get("ContentLength", 0)), name)
            client.download_file(bucket, key, str(dest))
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise source_error(
                f"s3://{bucket}/{key}: {code or exc}", code="source_not_found"
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise source_error(f"s3://{bucket}/{key}: {exc}", code="source_unreachable") from exc

    # -- preflight ---------------------------------------------------------------------------
    def resolve(
        self,
        uri: str,
        sha256: str | None,
        pool: PoolLimits,
        credentials: SourceCredentials | None = None,
    ) -> AdapterFacts:
        directory = self.fetch(uri, credentials)
        return preflight(directory, sha256, pool, self.settings.max_adapter_bytes)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise source_error(f"{CONFIG_FILE} is missing in {directory}", code="preflight_failed")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise source_error(
            f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes", code="preflight_failed"
        )
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise source_error(
            f"{CONFIG_FILE} is not valid JSON: {exc}", code="preflight_failed"
        ) from exc
    except RecursionError as exc:
        raise source_error(f"{CONFIG_FILE} is nested too deeply", code="preflight_failed") from exc
    if not isinstance(config, dict):
        raise source_error(f"{CONFIG_FILE} must hold a JSON object", code="preflight_failed")
    return config


def same_model(adapter_base: str, pool_model: str) -> bool:
    a, b = adapter_base.rstrip("/"), pool_model.rstrip("/")
    return a == b or a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1]


_DTYPES: dict[str, tuple[Any, int]] = {
    "F32": (np.float32, 4),
    "F16": (np.uint16, 2),
    "BF16": (np.uint16, 2),
    "F64": (np.float64, 8),
}


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """(in, out) of every LoRA target of a base model, from its ``config.json``."""

    num_layers: int
    dense: dict[str, tuple[int, int]]
    experts: dict[str, tuple[int, int]]

    @classmethod
    def read(cls, model: str) -> ModelShapes | None:
        """None when the control plane cannot read the model's config (a path only workers
        see, a hub id): the workers check shapes then, before any eviction the load planned."""
        try:
            cfg = json.loads((Path(model) / "config.json").read_text())
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            kv = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            inter, layers = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
            expert_inter = int(cfg.get("moe_intermediate_size") or inter)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        q, kv_out = heads * head_dim, kv * head_dim
        dense = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        experts = {
            "gate_proj": (hidden, expert_inter),
            "up_proj": (hidden, expert_inter),
            "down_proj": (expert_inter, hidden),
        }
        return cls(layers, dense, experts)

    def check(self, name: str, shape: list[Any]) -> None:
        """Raise naming ``name`` if it is a LoRA weight that does not fit this model."""
        m = _LORA_KEY.search(name)
        if m is None or len(shape) != 2:
            return
        layer, experts, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= self.num_layers:
            raise source_error(
                f"tensor {name!r}: layer {layer} does not exist, the pool's model has "
                f"{self.num_layers} layers",
                code="preflight_failed",
            )
        dims = (self.experts if experts else self.dense).get(module)
        if dims is None:
            return
        got, want, which = (shape[1], dims[0], "in") if half == "A" else (shape[0], dims[1], "out")
        if got != want:
            raise source_error(
                f"tensor {name!r} has shape {shape}: {module} of the pool's model has "
                f"{which}={want}; was the adapter trained on another base model?",
                code="preflight_failed",
            )


_LORA_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)(\.experts\.\d+)?\.(\w+_proj)\.lora_([AB])\b"
)


def check_safetensors(
    path: Path,
    rank: int | Callable[[str], int],
    max_bytes: int,
    shapes: ModelShapes | None = None,
) -> None:
    """Header parses, LoRA A/B tensors have rank ``rank`` (or ``rank(tensor name)``: an
    adapter with a ``rank_pattern``) and fit ``shapes`` when the model's config is readable,
    every value is finite (no torch)."""
    rank_of = rank if callable(rank) else (lambda _name, r=rank: r)
    size = path.stat().st_size
    if size > max_bytes:
        raise source_error(
            f"{WEIGHTS_FILE} is {size} bytes, more than the limit of {max_bytes}",
            code="adapter_too_large",
        )
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise source_error(f"{WEIGHTS_FILE} is truncated (no header)", code="preflight_failed")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 * 1024 * 1024):
            raise source_error(
                f"{WEIGHTS_FILE} header length {header_len} is impossible", code="preflight_failed"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise source_error(
                f"{WEIGHTS_FILE} header is not JSON: {type(exc).__name__}: {str(exc)[:200]}",
                code="preflight_failed",
            ) from exc
        if not isinstance(header, dict):
            raise source_error(
                f"{WEIGHTS_FILE} header must be a JSON object", code="preflight_failed"
            )
        data_start = 8 + header_len
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        if not tensors:
            raise source_error(f"{WEIGHTS_FILE} holds no tensors", code="preflight_failed")
        for name, info in tensors.items():
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
                raise source_error(
                    f"tensor {name!r} has a malformed header entry", code="preflight_failed"
                )
            begin, end = offsets
            if not (0 <= begin <= end <= size - data_start):
                raise source_error(
                    f"tensor {name!r} lies outside the file", code="preflight_failed"
                )
            r = rank_of(name)
            if "lora_A" in name and (len(shape) < 2 or shape[0] != r):
                raise source_error(
                    f"tensor {name!r} has shape {shape}; lora_A must be [r={r}, in]",
                    code="preflight_failed",
                )
            if "lora_B" in name and (len(shape) < 2 or shape[-1] != r):
                raise source_error(
                    f"tensor {name!r} has shape {shape}; lora_B must be [out, r={r}]",
                    code="preflight_failed",
                )
            if shapes is not None:
                shapes.check(name, shape)
            if dtype not in _DTYPES:
                continue
            np_type, width = _DTYPES[dtype]
            count = int(np.prod(shape)) if shape else 1
            if count * width != end - begin:
                raise source_error(
                    f"tensor {name!r}: {dtype}{shape} does not match its byte range",
                    code="preflight_failed",
                )
            handle.seek(data_start + begin)
            values = np.frombuffer(handle.read(end - begin), dtype=np_type)
            if dtype == "F16":
                bad = bool(np.any((values & 0x7C00) == 0x7C00))
            elif dtype == "BF16":
                bad = bool(np.any((values & 0x7F80) == 0x7F80))
            else:
                bad = not bool(np.all(np.isfinite(values)))
            if bad:
                raise source_error(
                    f"tensor {name!r} holds NaN or infinite values", code="preflight_failed"
                )


def _refuse_peft_fields(config: dict[str, Any]) -> None:
    """The fields the workers refuse too (``loraplane.rules.peft``), refused before any loads."""
    refused = refused_peft_field(config)
    if refused is not None:
        name, value, instead = refused
        raise source_error(
            f"adapter_config.json {name} is {value!r}: not supported (it changes "
            f"the math and the workers do not implement it); only {instead!r} or absent",
            code="preflight_failed",
        )


def _rank_pattern(config: dict[str, Any], rank: int, max_rank: int) -> Callable[[str], int]:
    """Each LoRA tensor's rank: ``rank_pattern``'s where a key matches the module (PEFT's
    rule, ``(.*\\.)?(key)$``, first key in order), else ``r``."""
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pattern.values()
    ):
        raise source_error(
            f"adapter_config.json rank_pattern must map module names to positive integers, "
            f"got {pattern!r}",
            code="preflight_failed",
        )
    for key in pattern:
        try:
            re.compile(key)
        except re.error as exc:
            raise source_error(
                f"adapter_config.json rank_pattern key {key!r} is not a valid pattern ({exc})",
                code="preflight_failed",
            ) from exc
    above = {k: v for k, v in pattern.items() if v > max_rank}
    if above:
        raise source_error(
            f"adapter_config.json rank_pattern {above} is above the pool's max_lora_rank={max_rank}",
            code="preflight_failed",
        )

    def rank_of(tensor: str) -> int:
        module = re.sub(
            r"\.lora_[AB](\.\w+)?\.weight$", "", tensor.removeprefix("base_model.model.")
        )
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)
        return int(pattern[key]) if key is not None else rank

    return rank_of


def preflight(
    directory: Path, sha256: str | None, pool: PoolLimits, max_bytes: int
) -> AdapterFacts:
    config = _read_config(directory)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise source_error(
            f"adapter_config.json peft_type is {peft_type!r}; only LORA is supported",
            code="preflight_failed",
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise source_error(
            f"adapter_config.json r must be a positive integer, got {rank!r}",
            code="preflight_failed",
        )
    if rank > pool.max_lora_rank:
        raise source_error(
            f"adapter rank r={rank} is above the pool's max_lora_rank={pool.max_lora_rank}",
            code="preflight_failed",
        )
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise source_error(
            f"adapter_config.json lora_alpha must be a number, got {alpha!r}",
            code="preflight_failed",
        )
    _refuse_peft_fields(config)
    rank_of = _rank_pattern(config, rank, pool.max_lora_rank)
    modules = config.get("target_modules")
    if modules == "all-linear":
        modules = list(pool.target_modules)
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise source_error(
            f"adapter_config.json target_modules must be a non-empty list of names, got {modules!r}",
            code="preflight_failed",
        )
    # PEFT writes full module paths for "all-linear" (model.layers.0.self_attn.q_proj)
    modules = list(dict.fromkeys(m.split(".")[-1] for m in modules))
    embedding = [m for m in modules if m in ("embed_tokens", "lm_head")]
    if embedding:
        raise source_error(
            f"adapter_config.json target_modules: LoRA on {embedding} is not supported; only "
            f"the attention and MLP projections {list(pool.target_modules)}",
            code="preflight_failed",
        )
    unsupported = sorted(set(modules) - set(pool.target_modules))
    if unsupported:
        raise source_error(
            f"target_modules {unsupported} are not supported by the pool (supported: {list(pool.target_modules)})",
            code="preflight_failed",
        )
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise source_error(
            f"base_model_name_or_path must be a string, got {base!r}", code="preflight_failed"
        )
    if base and not same_model(base, pool.model):
        raise source_error(
            f"adapter was trained on base model {base!r}, but the pool serves {pool.model!r}",
            code="preflight_failed",
        )
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise source_error(f"{WEIGHTS_FILE} is missing in {directory}", code="preflight_failed")
    check_safetensors(weights, rank_of, max_bytes, ModelShapes.read(pool.model))
    digest = sha256_file(weights)
    if sha256 is not None and sha256.lower() != digest:
        raise InvalidSource(
            f"body.source.sha256: expected {sha256.lower()} but {WEIGHTS_FILE} has sha256 {digest}",
            code="digest_mismatch",
            field="body.source.sha256",
        )
    return AdapterFacts(str(directory), digest, rank, float(alpha), tuple(modules), base or None)


def pool_limits(model: str, max_lora_rank: int, target_modules: Sequence[str] | None) -> PoolLimits:
    return PoolLimits(
        model, max_lora_rank, tuple(target_modules) if target_modules else DEFAULT_TARGET_MODULES
    )
