"""Operations carry their owner and a lease: a replica settles only operations whose owner
stopped renewing them (or its own, left by an earlier process or an unexpected error).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER a table in place for every change; add_column is fine
    # either way, the batch keeps both backends on one code path.
    with op.batch_alter_table("operations") as batch:
        batch.add_column(sa.Column("owner", sa.String(253), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    # Operations an older replica is running (during the rolling update onto this version) are
    # not renewed by it: they count as alive for one lease from their last update, not as
    # abandoned at once.
    op.execute(
        "UPDATE operations SET heartbeat_at = updated_at WHERE state IN ('pending', 'running')"
    )


def downgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("heartbeat_at")
        batch.drop_column("owner")
