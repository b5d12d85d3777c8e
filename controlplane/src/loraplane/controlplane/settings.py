"""Settings from the environment (prefix ``LORAPLANE_``) and the ``serve`` command line.

Top-level: ``LORAPLANE_DB_URL``, ``LORAPLANE_REDIS_URL``, ``LORAPLANE_ADMIN_TOKEN``,
``LORAPLANE_AUTH`` (true/false), ``LORAPLANE_HOST``, ``LORAPLANE_PORT``,
``LORAPLANE_MAX_REQUEST_BYTES``.
Groups use ``__``: ``LORAPLANE_SOURCES__ALLOWED_ROOTS='["/models"]'``,
``LORAPLANE_ROUTER__ON_DEMAND_TIMEOUT_S=30``, ``LORAPLANE_RECONCILER__INTERVAL_S=5``,
``LORAPLANE_OPERATIONS__LEASE_S=30``, ``LORAPLANE_WORKERS__ADMIN_TOKEN``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class SourcesSettings(BaseModel):
    allowed_roots: list[Path] = Field(
        default_factory=list,
        description="file:// sources must resolve under one of these directories",
    )
    pvc_root: Path = Field(
        default=Path("/mnt/pvc"),
        description="pvc://<claim>/<path> maps to <pvc_root>/<claim>/<path>",
    )
    cache_dir: Path = Field(
        default=Path.home() / ".cache" / "loraplane" / "adapters",
        description="remote sources are copied here (content-addressed); workers must see the same path",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, moto); None = AWS"
    )
    hf_endpoint: str = Field(
        default="https://huggingface.co", description="base URL hf:// resolves against"
    )
    hf_token: SecretStr | None = None
    max_adapter_bytes: int = Field(
        default=2 * 1024**3, ge=1, description="largest adapter_model.safetensors accepted"
    )
    http_timeout_s: float = Field(default=60.0, gt=0)


class RouterSettings(BaseModel):
    on_demand_timeout_s: float = Field(
        default=30.0, gt=0, description="longest a request waits for an on-demand load"
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="timeout of a proxied inference request"
    )
    route_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="longest the router serves a route from memory without an event or a "
        "write emptying it (a change no event announced); 0: read the database per request",
    )
    usage_flush_s: float = Field(
        default=1.0, gt=0, description="period of the batched write of adapters' last use (LRU)"
    )


class ReconcilerSettings(BaseModel):
    enabled: bool = True
    interval_s: float = Field(
        default=5.0, gt=0, description="period of the full comparison with every worker"
    )


class WorkerClientSettings(BaseModel):
    load_timeout_s: float = Field(
        default=120.0, gt=0, description="timeout of one load/unload call"
    )
    probe_timeout_s: float = Field(
        default=3.0, gt=0, description="timeout of /health, /v1/models, /lora_state"
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="bearer token sent with every call to a worker (the workers' "
        "--admin-token-file / LORAPLANE_WORKER_ADMIN_TOKEN); None: none sent",
    )


class OperationSettings(BaseModel):
    lease_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "a running operation's owner renews its lease every lease_s/3; another replica "
            "settles (finishes or rolls back) an operation whose lease has run out"
        ),
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LORAPLANE_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = 8080
    db_url: str = "sqlite:///./loraplane.db"
    redis_url: str | None = None
    admin_token: SecretStr | None = None
    auth: bool = True
    token_cache_s: float = Field(
        default=5.0,
        ge=0,
        description=(
            "longest a bearer token is accepted from memory after its lookup: a revocation "
            "on this replica, or announced by another's event, takes effect at once; without "
            "Redis, another replica's takes up to this long. 0: look up every request"
        ),
    )
    max_request_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="a larger request body is refused (413)"
    )
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        le=3600,
        description=(
            "seconds an idle client connection stays open: above the idle timeout of what "
            "keeps connections to it (load balancers and ingresses, often 60 s), so they "
            "close first and never send a request on a connection this server is closing"
        ),
    )
    replica_id: str | None = Field(
        default=None,
        description=(
            "name of this replica: owner of the operations it runs (default: the host name, "
            "which a restarted container keeps) and origin of its events (default host:pid)"
        ),
    )

    sources: SourcesSettings = Field(default_factory=lambda: SourcesSettings())
    router: RouterSettings = Field(default_factory=lambda: RouterSettings())
    reconciler: ReconcilerSettings = Field(default_factory=lambda: ReconcilerSettings())
    workers: WorkerClientSettings = Field(default_factory=lambda: WorkerClientSettings())
    operations: OperationSettings = Field(default_factory=lambda: OperationSettings())
