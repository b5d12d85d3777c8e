"""Idempotency keys are per namespace: unique on (namespace, idempotency_key) instead of on
the key alone, so that one tenant's key never refuses or names another tenant's operation.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

PER_NAMESPACE = "uq_operations_namespace_key"
# 0001 declared the key's constraint inline, without a name: PostgreSQL named it, SQLite
# did not (its batch mode finds it through this naming convention).
SQLITE_NAMES = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _key_constraint(columns: list[str]) -> str | None:
    """The name PostgreSQL gave the unique constraint over exactly ``columns`` (its default
    name when writing SQL offline, with no database to ask)."""
    if op.get_context().as_sql:
        return "operations_idempotency_key_key" if columns == ["idempotency_key"] else PER_NAMESPACE
    for constraint in sa.inspect(op.get_bind()).get_unique_constraints("operations"):
        if constraint["column_names"] == columns:
            return constraint["name"]
    return None


def _swap(drop: list[str], add: list[str], add_name: str) -> None:
    if op.get_context().dialect.name == "sqlite":
        with op.batch_alter_table("operations", naming_convention=SQLITE_NAMES) as batch:
            batch.drop_constraint(
                PER_NAMESPACE if len(drop) > 1 else "uq_operations_idempotency_key",
                type_="unique",
            )
            batch.create_unique_constraint(add_name, add)
        return
    name = _key_constraint(drop)
    if name is None:
        raise RuntimeError(f"operations has no unique constraint over {drop} to replace")
    op.drop_constraint(name, "operations", type_="unique")
    op.create_unique_constraint(add_name, "operations", add)


def upgrade() -> None:
    _swap(["idempotency_key"], ["namespace", "idempotency_key"], PER_NAMESPACE)


def downgrade() -> None:
    # Fails (the database refuses the constraint) where two namespaces used the same key.
    _swap(["namespace", "idempotency_key"], ["idempotency_key"], "uq_operations_idempotency_key")
