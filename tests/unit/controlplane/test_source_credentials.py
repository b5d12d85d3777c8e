"""Per-adapter source credentials (`source.credentials`): validated per scheme, used for the
fetch and for nothing else. The app runs for real on SQLite; the source is an HTTP server in a
thread that answers only requests carrying its bearer token."""

from __future__ import annotations

import hashlib
import http.server
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import SecretStr

from loraplane.controlplane.api.adapters import AdapterCreate
from loraplane.controlplane.app import create_app, http_status
from loraplane.controlplane.errors import ApiError
from loraplane.controlplane.operations import request_hash
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.sources import SourceCredentials, check_credentials

pytestmark = pytest.mark.unit

ADMIN_TOKEN = "unit-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOKEN = "per-adapter-bearer-9f2c41"  # what the source accepts
POOL = {
    "model": "/models/tiny-llama",
    "tp": 1,
    "dp": 1,
    "max_loras_per_batch": 2,
    "max_loaded_loras": 4,
    "max_lora_rank": 16,
}


class BearerFiles(http.server.SimpleHTTPRequestHandler):
    """Static files, 401 unless `Authorization: Bearer <TOKEN>` (403 for another token)."""

    def do_GET(self) -> None:
        given = self.headers.get("Authorization")
        if given is None:
            self.send_error(401)
        elif given != f"Bearer {TOKEN}":
            self.send_error(403)
        else:
            super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def www(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "www"
    root.mkdir()

    def handler(*args: Any, **kwargs: Any) -> BearerFiles:
        return BearerFiles(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def settings(tmp_path: Path, www: tuple[Path, str]) -> Settings:
    settings = Settings(
        db_url=f"sqlite:///{tmp_path / 'cp.db'}", admin_token=ADMIN_TOKEN, redis_url=None
    )
    settings.sources.cache_dir = tmp_path / "cache"
    settings.sources.hf_endpoint = www[1] + "/hf"
    settings.reconciler.interval_s = 0.2
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        answer = test_client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        yield test_client


@pytest.fixture
def served(www: tuple[Path, str], make_adapter: Callable[..., Path]) -> str:
    """The URL of an adapter behind the bearer token."""
    root, base = www
    shutil.copytree(make_adapter("private", base="/models/tiny-llama"), root / "private")
    return f"{base}/private"


def register(client: TestClient, name: str, source: dict[str, Any], key: str | None = None) -> Any:
    headers = {**ADMIN, **({"Idempotency-Key": key} if key else {})}
    return client.post(
        "/v1/adapters", json={"name": name, "pool": "tiny", "source": source}, headers=headers
    )


def every_row(settings: Settings) -> str:
    """Every row of every table, as text."""
    engine = sa.create_engine(settings.db_url)
    try:
        with engine.connect() as conn:
            tables = sa.inspect(conn).get_table_names()
            return "\n".join(
                repr(row) for t in tables for row in conn.execute(sa.text(f'SELECT * FROM "{t}"'))
            )
    finally:
        engine.dispose()


def test_an_http_source_is_fetched_with_its_token_and_the_token_is_kept_nowhere(
    client: TestClient, served: str, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    without = register(client, "sql", {"uri": served})
    assert without.status_code == 400, without.text
    assert "answered HTTP 401" in without.json()["error"]["message"]
    assert "none were given" in without.json()["error"]["message"]
    wrong = register(client, "sql", {"uri": served, "credentials": {"token": "not-it"}})
    assert wrong.status_code == 400 and "answered HTTP 403" in wrong.json()["error"]["message"]
    assert "refused" in wrong.json()["error"]["message"]

    answer = register(client, "sql", {"uri": served, "credentials": {"token": TOKEN}}, key="k1")
    assert answer.status_code == 201, answer.text
    assert answer.json()["adapter"]["source"] == {"uri": served, "sha256": None}
    assert TOKEN not in answer.text

    rows = every_row(settings)
    assert served in rows  # the adapter row is there...
    assert TOKEN not in rows and "not-it" not in rows  # ...its credentials are not
    assert TOKEN not in caplog.text and "not-it" not in caplog.text
    listed = client.get("/v1/adapters", headers=ADMIN)
    assert listed.status_code == 200 and TOKEN not in listed.text


def test_a_new_version_is_fetched_with_its_own_token(
    client: TestClient,
    served: str,
    www: tuple[Path, str],
    make_adapter: Callable[..., Path],
    settings: Settings,
) -> None:
    first = register(client, "sql", {"uri": served, "credentials": {"token": TOKEN}})
    assert first.status_code == 201, first.text
    root, base = www
    shutil.copytree(make_adapter("v2", rank=4, base="/models/tiny-llama"), root / "v2")
    url = "/v1/adapters/default/sql/version"
    refused = client.post(url, json={"source": {"uri": f"{base}/v2"}}, headers=ADMIN)
    assert refused.status_code == 400 and "HTTP 401" in refused.json()["error"]["message"]
    answer = client.post(
        url, json={"source": {"uri": f"{base}/v2", "credentials": {"token": TOKEN}}}, headers=ADMIN
    )
    assert answer.status_code == 200, answer.text
    adapter = client.get("/v1/adapters/default/sql", headers=ADMIN).json()
    assert adapter["version"] == 2 and adapter["rank"] == 4
    assert TOKEN not in every_row(settings)


def test_a_replay_with_rotated_credentials_answers_the_same_operation(
    client: TestClient, served: str
) -> None:
    source = {"uri": served, "credentials": {"token": TOKEN}}
    first = register(client, "sql", source, key="same-key")
    assert first.status_code == 201, first.text
    rotated = register(client, "sql", {**source, "credentials": {"token": "rotated"}}, "same-key")
    assert rotated.status_code == 201, rotated.text
    assert rotated.json()["operation"]["id"] == first.json()["operation"]["id"]
    # Without credentials it is the same request as well; another URI is not.
    plain = register(client, "sql", {"uri": served}, key="same-key")
    assert plain.json()["operation"]["id"] == first.json()["operation"]["id"]
    other = register(client, "sql", {"uri": served + "/"}, key="same-key")
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_mismatch"


def test_the_request_hash_leaves_credentials_out() -> None:
    with_credentials = AdapterCreate.model_validate(
        {"name": "a", "pool": "p", "source": {"uri": "hf://o/r", "credentials": {"token": "t"}}}
    )
    plain = AdapterCreate.model_validate({"name": "a", "pool": "p", "source": {"uri": "hf://o/r"}})
    from loraplane.controlplane.api.adapters import UNHASHED

    dumped = with_credentials.model_dump(mode="json", exclude=UNHASHED)
    assert dumped == plain.model_dump(mode="json", exclude=UNHASHED)
    assert "credentials" not in dumped["source"]
    # The same hash as before the field existed: journalled operations still replay.
    assert request_hash("register", dumped) == request_hash(
        "register", {**plain.model_dump(mode="json"), "source": {"uri": "hf://o/r", "sha256": None}}
    )


def test_an_hf_source_prefers_the_adapter_token_to_the_global_one(
    client: TestClient,
    www: tuple[Path, str],
    make_adapter: Callable[..., Path],
    settings: Settings,
) -> None:
    root, _ = www
    directory = make_adapter("hf", base="/models/tiny-llama")
    shutil.copytree(directory, root / "hf" / "org" / "private" / "resolve" / "main")
    settings.sources.hf_token = SecretStr("global-token-the-mirror-refuses")
    refused = register(client, "a", {"uri": "hf://org/private"})
    assert refused.status_code == 400 and "HTTP 403" in refused.json()["error"]["message"]
    answer = register(client, "a", {"uri": "hf://org/private", "credentials": {"token": TOKEN}})
    assert answer.status_code == 201, answer.text
    weights = (directory / "adapter_model.safetensors").read_bytes()
    assert answer.json()["adapter"]["digest"] == hashlib.sha256(weights).hexdigest()


@pytest.mark.parametrize(
    ("source", "status", "field"),
    [
        # An unknown key: the schema's 422, naming it.
        ({"uri": "s3://b/p", "credentials": {"password": "x"}}, 422, "password"),
        ({"uri": "s3://b/p", "credentials": {"token": ""}}, 422, "token"),
        ({"uri": "s3://b/p", "credentials": {"token": 7}}, 422, "token"),
        # A key the scheme does not use: 400, naming it.
        ({"uri": "s3://b/p", "credentials": {"token": "x"}}, 400, "token"),
        (
            {"uri": "https://h/p", "credentials": {"aws_access_key_id": "a"}},
            400,
            "aws_access_key_id",
        ),
        ({"uri": "file:///adapters/a", "credentials": {"token": "x"}}, 400, "token"),
        ({"uri": "pvc://claim/a", "credentials": {"token": "x"}}, 400, "token"),
        # Half an AWS key pair.
        (
            {"uri": "s3://b/p", "credentials": {"aws_access_key_id": "a"}},
            400,
            "aws_secret_access_key",
        ),
        (
            {"uri": "s3://b/p", "credentials": {"aws_secret_access_key": "s"}},
            400,
            "aws_access_key_id",
        ),
    ],
)
def test_credentials_that_do_not_fit_are_refused_naming_the_key(
    client: TestClient, settings: Settings, source: dict[str, Any], status: int, field: str
) -> None:
    before = every_row(settings)
    answer = register(client, "a", source)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["field"] == f"body.source.credentials.{field}"
    assert f"body.source.credentials.{field}" in error["message"]
    assert every_row(settings) == before
    version = client.post("/v1/adapters/default/a/version", json={"source": source}, headers=ADMIN)
    assert version.status_code == status and version.json()["error"]["field"] == error["field"]


def test_a_refused_credential_value_is_not_echoed(client: TestClient) -> None:
    long_secret = "s" * 9000
    answer = register(client, "a", {"uri": "https://h/p", "credentials": {"token": long_secret}})
    assert answer.status_code == 422 and long_secret not in answer.text
    assert answer.json()["error"]["field"] == "body.source.credentials.token"


def test_credentials_never_show_in_a_repr() -> None:
    body = AdapterCreate.model_validate(
        {
            "name": "a",
            "pool": "p",
            "source": {
                "uri": "s3://b/p",
                "credentials": {"aws_access_key_id": "AKIAXYZ", "aws_secret_access_key": "SEKRIT"},
            },
        }
    )
    assert body.source.credentials is not None
    fetch = body.source.fetch_credentials()
    for text in (repr(body), str(body), repr(fetch), repr(body.model_dump())):
        assert "AKIAXYZ" not in text and "SEKRIT" not in text
    assert fetch is not None and fetch.value("aws_secret_access_key") == "SEKRIT"
    assert fetch.given() == ["aws_access_key_id", "aws_secret_access_key"]


def test_check_credentials_accepts_what_each_scheme_uses() -> None:
    pair = SourceCredentials(
        aws_access_key_id=SecretStr("a"),
        aws_secret_access_key=SecretStr("s"),
        aws_session_token=SecretStr("t"),
    )
    check_credentials("s3://bucket/prefix", pair)
    for uri in ("https://h/p", "http://h/p", "hf://org/repo"):
        check_credentials(uri, SourceCredentials(token=SecretStr("t")))
    check_credentials("file:///a", None)
    check_credentials("file:///a", SourceCredentials())
    with pytest.raises(ApiError) as info:
        check_credentials("hf://org/repo", pair)
    assert http_status(info.value) == 400 and info.value.code == "invalid_value"
    assert info.value.field == "body.source.credentials.aws_access_key_id"
    assert "it takes token" in info.value.message
