"""Initial registry: pools, workers, adapters, placements, operations, tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("model", sa.String(1024), nullable=False),
        sa.Column("tp", sa.Integer, nullable=False),
        sa.Column("dp", sa.Integer, nullable=False),
        sa.Column("max_loras_per_batch", sa.Integer, nullable=False),
        sa.Column("max_loaded_loras", sa.Integer, nullable=False),
        sa.Column("max_lora_rank", sa.Integer, nullable=False),
        sa.Column("target_modules", sa.JSON, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("namespace", "name", name="uq_pools_namespace_name"),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(253), nullable=False, unique=True),
        sa.Column("pool_id", sa.Integer, sa.ForeignKey("pools.id", ondelete="RESTRICT"), nullable=False),
        sa.Column("endpoint", sa.String(1024), nullable=False),
        sa.Column("dp_size", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("served_model", sa.String(1024), nullable=True),
        sa.Column("observed", sa.JSON, nullable=True),
        sa.Column("last_seen_at", TS, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("registered_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("pool_id", sa.Integer, sa.ForeignKey("pools.id", ondelete="RESTRICT"), nullable=False),
        sa.Column("source_uri", sa.String(2048), nullable=False),
        sa.Column("source_sha256", sa.String(64), nullable=True),
        sa.Column("path", sa.String(2048), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Float, nullable=False),
        sa.Column("target_modules", sa.JSON, nullable=False),
        sa.Column("base_model", sa.String(1024), nullable=True),
        sa.Column("pinned", sa.Boolean, nullable=False),
        sa.Column("placement_count", sa.Integer, nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("desired", sa.String(16), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("inconsistent", sa.Boolean, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("busy_operation_id", sa.String(40), nullable=True),
        sa.Column("last_used_at", sa.Float, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("namespace", "name", name="uq_adapters_namespace_name"),
    )
    op.create_table(
        "placements",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("adapter_id", sa.Integer, sa.ForeignKey("adapters.id", ondelete="CASCADE"), nullable=False),
        sa.Column("worker_id", sa.Integer, sa.ForeignKey("workers.id", ondelete="CASCADE"), nullable=False),
        sa.Column("dp_group", sa.Integer, nullable=False),
        sa.Column("lora_name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("observed_at", TS, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.UniqueConstraint("adapter_id", "worker_id", "dp_group", "lora_name", name="uq_placements_target"),
    )
    op.create_index("ix_placements_worker_id", "placements", ["worker_id"])
    op.create_table(
        "operations",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("idempotency_key", sa.String(200), nullable=False, unique=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("adapter_name", sa.String(63), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("plan", sa.JSON, nullable=False),
        sa.Column("targets", sa.JSON, nullable=False),
        sa.Column("per_target", sa.JSON, nullable=False),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("error_code", sa.String(40), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
    )
    op.create_index("ix_operations_state", "operations", ["state"])
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.JSON, nullable=False),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("tokens", "operations", "placements", "adapters", "workers", "pools"):
        op.drop_table(table)
