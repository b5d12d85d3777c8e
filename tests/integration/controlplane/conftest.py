"""Integration fixtures: the control plane against the real PostgreSQL and Redis that
``scripts/services.sh start`` runs, and against SQLite; the same tests run on both.

``LORAPLANE_TEST_PG_URL`` and ``LORAPLANE_TEST_REDIS_URL`` must be set (``make test`` and
``scripts/test.sh`` set them); a missing URL is an error, not a skip.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from loraplane.controlplane.app import create_app
from loraplane.controlplane.settings import Settings

sys.path.insert(0, str(Path(__file__).parent))
from cp_kit import ADMIN, ADMIN_TOKEN, POOL, START_HINT, required_env
from tests.peft_files import write_adapter
from tests.procs import redis_of_this_process


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    return required_env("LORAPLANE_TEST_PG_URL")


@pytest.fixture(scope="session")
def redis_url() -> str:
    return redis_of_this_process(required_env("LORAPLANE_TEST_REDIS_URL"))


@pytest.fixture(scope="session")
def pg_database(pg_server_url: str) -> Iterator[str]:
    """A database of our own on the shared server, dropped at the end of the session."""
    url = sa.engine.make_url(pg_server_url)
    name = f"lp_cp_test_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        pytest.fail(
            f"cannot reach PostgreSQL at {url.render_as_string()}: {exc.orig}; {START_HINT}",
            pytrace=False,
        )
    yield url.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (migrations run when the app starts)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/controlplane.db"
    url: str = request.getfixturevalue("pg_database")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()
    return url


@pytest.fixture
def adapters_root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    root.mkdir()
    return root


@pytest.fixture
def make_adapter(adapters_root: Path) -> Callable[..., Path]:
    def make(name: str = "adapter", **kwargs: Any) -> Path:
        kwargs.setdefault("base", "/models/tiny-llama")
        return write_adapter(adapters_root / name, **kwargs)

    return make


@pytest.fixture
def settings(db_url: str, tmp_path: Path, adapters_root: Path) -> Settings:
    settings = Settings(db_url=db_url, admin_token=ADMIN_TOKEN, redis_url=None)
    settings.sources.allowed_roots = [adapters_root]
    settings.sources.cache_dir = tmp_path / "cache"
    settings.reconciler.interval_s = 0.2
    settings.router.on_demand_timeout_s = 5
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture
def pool(client: TestClient) -> dict[str, Any]:
    response = client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body
