"""Adapters carry a load policy: OnDemand (a routed request loads the adapter where it is not
loaded, the behaviour before this column) or Explicit (only a load request does).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(
            sa.Column("load_policy", sa.String(16), nullable=False, server_default="OnDemand")
        )


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("load_policy")
