"""The registry's tables (SQLAlchemy 2.0). Alembic migrations in ``migrations/`` create them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Pool(Base):
    __tablename__ = "pools"
    __table_args__ = (UniqueConstraint("namespace", "name", name="uq_pools_namespace_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(63))
    name: Mapped[str] = mapped_column(String(63))
    model: Mapped[str] = mapped_column(String(1024))
    tp: Mapped[int] = mapped_column(Integer, default=1)
    dp: Mapped[int] = mapped_column(Integer, default=1)
    max_loras_per_batch: Mapped[int] = mapped_column(Integer)
    max_loaded_loras: Mapped[int] = mapped_column(Integer)
    max_lora_rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    workers: Mapped[list[Worker]] = relationship(back_populates="pool")
    adapters: Mapped[list[Adapter]] = relationship(back_populates="pool")


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(253), unique=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="RESTRICT"))
    endpoint: Mapped[str] = mapped_column(String(1024))
    dp_size: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(
        String(16), default="pending"
    )  # pending | ready | unreachable
    served_model: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    observed: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, nullable=True
    )  # last /lora_state view
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    pool: Mapped[Pool] = relationship(back_populates="workers")
    placements: Mapped[list[Placement]] = relationship(
        back_populates="worker", cascade="all, delete-orphan"
    )


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("namespace", "name", name="uq_adapters_namespace_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(63))
    name: Mapped[str] = mapped_column(String(63))
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id", ondelete="RESTRICT"))
    source_uri: Mapped[str] = mapped_column(String(2048))
    source_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    path: Mapped[str] = mapped_column(String(2048))  # what workers are given as lora_path
    digest: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    base_model: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    placement_count: Mapped[int | None] = mapped_column(
        Integer, nullable=True
    )  # None = all workers
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # OnDemand: a routed request loads it where it is not loaded; Explicit: only a load does
    load_policy: Mapped[str] = mapped_column(String(16), default="OnDemand")
    version: Mapped[int] = mapped_column(Integer, default=1)
    desired: Mapped[str] = mapped_column(String(16), default="loaded")  # loaded | unloaded
    phase: Mapped[str] = mapped_column(String(16), default="Pending")
    inconsistent: Mapped[bool] = mapped_column(Boolean, default=False)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    busy_operation_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    last_used_at: Mapped[float] = mapped_column(Float, default=0.0)  # epoch seconds (LRU)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    pool: Mapped[Pool] = relationship(back_populates="adapters")
    placements: Mapped[list[Placement]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan"
    )

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class Placement(Base):
    """One adapter version on one DP group of one worker."""

    __tablename__ = "placements"
    __table_args__ = (
        UniqueConstraint(
            "adapter_id", "worker_id", "dp_group", "lora_name", name="uq_placements_target"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"))
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"), index=True)
    dp_group: Mapped[int] = mapped_column(Integer)
    lora_name: Mapped[str] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(Integer)
    # loading | loaded | unloading | failed | inconsistent | unreachable
    state: Mapped[str] = mapped_column(String(16))
    observed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    adapter: Mapped[Adapter] = relationship(back_populates="placements")
    worker: Mapped[Worker] = relationship(back_populates="placements")


class Operation(Base):
    """The journal: written before an operation touches any worker, settled after."""

    __tablename__ = "operations"
    # Idempotency keys are per namespace: one tenant's key never meets another's.
    __table_args__ = (
        UniqueConstraint("namespace", "idempotency_key", name="uq_operations_namespace_key"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(200))
    request_hash: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    namespace: Mapped[str] = mapped_column(String(63))
    adapter_name: Mapped[str | None] = mapped_column(String(63), nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    plan: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    targets: Mapped[list[str]] = mapped_column(JSON, default=list)
    per_target: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(40), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The replica running (or settling) it, and when that replica last renewed its lease.
    owner: Mapped[str | None] = mapped_column(String(253), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    namespace: Mapped[str] = mapped_column(String(63))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
