"""The registry's migrations on both databases: a registry written by the previous release
upgrades with its rows kept, the schema at head is what the models declare, and the last
migration goes back down."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from loraplane.controlplane.db import alembic_config, make_engine, upgrade
from loraplane.controlplane.models import Base

INSERT_OP = sa.text(
    "INSERT INTO operations (id, idempotency_key, request_hash, kind, namespace, state, plan,"
    " targets, per_target, created_at, updated_at) VALUES (:id, :key, 'h', 'register', :ns,"
    " 'succeeded', '{}', '[]', '[]', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
)


def migrate(engine: sa.Engine, revision: str, down: bool = False) -> None:
    config = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)


def insert_op(engine: sa.Engine, op_id: str, namespace: str, key: str) -> None:
    with engine.begin() as conn:
        conn.execute(INSERT_OP, {"id": op_id, "ns": namespace, "key": key})


def refused(engine: sa.Engine, op_id: str, namespace: str, key: str) -> bool:
    """Whether the database refuses a new operation with this namespace and key."""
    try:
        insert_op(engine, op_id, namespace, key)
    except sa.exc.IntegrityError:
        return True
    return False


def operations(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, namespace, idempotency_key FROM operations"))
        return sorted(map(tuple, rows))


def test_the_schema_at_head_is_what_the_models_declare(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        with engine.connect() as conn:
            drift = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert drift == [], drift
    finally:
        engine.dispose()


def test_idempotency_keys_become_per_namespace_with_the_rows_kept(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(engine, "0003")
        insert_op(engine, "op_a", "team-a", "nightly-1")
        assert refused(engine, "op_b", "team-b", "nightly-1"), "before 0004: one key, one row"
        upgrade(engine)
        assert operations(engine) == [("op_a", "team-a", "nightly-1")]
        insert_op(engine, "op_b", "team-b", "nightly-1")
        assert refused(engine, "op_c", "team-b", "nightly-1"), "still one per namespace"
        # down again, once no two namespaces share a key
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM operations WHERE id = 'op_b'"))
        migrate(engine, "0003", down=True)
        assert operations(engine) == [("op_a", "team-a", "nightly-1")]
    finally:
        engine.dispose()
