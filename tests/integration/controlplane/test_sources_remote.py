"""Remote adapter sources against real local servers: S3 (moto's server mode, a separate
process), HTTP (python's http.server, a separate process) and hf:// through an HTTP mirror;
per-adapter credentials against an HTTP server that checks a bearer token and a moto server
that checks AWS signatures against its IAM users."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cp_kit import ADMIN, free_port, snapshot, wait_for
from fastapi.testclient import TestClient

from loraplane.controlplane.app import create_app
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.integration


def serve(command: list[str], url: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def up() -> bool:
        try:
            httpx.get(url, timeout=0.5)
            return True
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=30, what=f"{command[0]} to listen on {url}")
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    port = free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    process = serve([exe, "-H", "127.0.0.1", "-p", str(port)], f"http://127.0.0.1:{port}/")
    yield f"http://127.0.0.1:{port}"
    stop(process)


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "www"
    root.mkdir()
    port = free_port()
    process = serve(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        f"http://127.0.0.1:{port}/",
        cwd=root,
    )
    yield root, f"http://127.0.0.1:{port}"
    stop(process)


@pytest.fixture
def remote_client(
    settings: Settings, moto_url: str, http_root: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    settings.sources.s3_endpoint_url = moto_url
    settings.sources.hf_endpoint = http_root[1] + "/hf"
    with TestClient(create_app(settings)) as client:
        client.put(
            "/v1/pools/default/tiny",
            json={
                "model": "/models/tiny-llama",
                "tp": 1,
                "dp": 1,
                "max_loras_per_batch": 2,
                "max_loaded_loras": 4,
                "max_lora_rank": 16,
            },
            headers=ADMIN,
        )
        yield client


def digest(directory: Path) -> str:
    return hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()


def register(client: TestClient, name: str, uri: str, sha256: str | None = None) -> Any:
    return client.post(
        "/v1/adapters",
        json={"name": name, "pool": "tiny", "source": {"uri": uri, "sha256": sha256}},
        headers=ADMIN,
    )


def test_s3_source_is_fetched_checked_and_cached(
    remote_client: TestClient, moto_url: str, make_adapter: Callable[..., Path], settings: Settings
) -> None:
    import boto3

    directory = make_adapter("s3src", rank=4)
    s3 = boto3.client("s3", endpoint_url=moto_url)
    s3.create_bucket(Bucket="adapters")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(directory / name), "adapters", f"team/sql/{name}")
    response = register(remote_client, "sql", "s3://adapters/team/sql", digest(directory))
    assert response.status_code == 201, response.text
    adapter = response.json()["adapter"]
    assert adapter["digest"] == digest(directory) and adapter["rank"] == 4
    cached = settings.sources.cache_dir / digest(directory)
    assert (cached / "adapter_model.safetensors").read_bytes() == (
        directory / "adapter_model.safetensors"
    ).read_bytes()
    missing = register(remote_client, "gone", "s3://adapters/team/missing")
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "source_not_found"
    assert "s3://adapters/team/missing/adapter_config.json" in missing.json()["error"]["message"]


def test_http_source_and_digest_mismatch(
    remote_client: TestClient,
    http_root: tuple[Path, str],
    make_adapter: Callable[..., Path],
    db_url: str,
    settings: Settings,
) -> None:
    root, base = http_root
    directory = make_adapter("httpsrc")
    shutil.copytree(directory, root / "sql")
    before = snapshot(db_url)
    wrong = register(remote_client, "sql", f"{base}/sql", "0" * 64)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "digest_mismatch"
    assert snapshot(db_url) == before
    response = register(remote_client, "sql", f"{base}/sql/", digest(directory))
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["source"]["uri"] == f"{base}/sql/"
    not_there = register(remote_client, "nope", f"{base}/nope")
    assert (
        not_there.status_code == 400 and "answered HTTP 404" in not_there.json()["error"]["message"]
    )


def test_http_source_over_the_size_limit(
    remote_client: TestClient,
    http_root: tuple[Path, str],
    make_adapter: Callable[..., Path],
    settings: Settings,
) -> None:
    root, base = http_root
    shutil.copytree(make_adapter("big"), root / "big")
    settings.sources.max_adapter_bytes = 64
    response = register(remote_client, "big", f"{base}/big")
    assert response.status_code == 400 and response.json()["error"]["code"] == "adapter_too_large"


def test_hf_source_through_a_mirror(
    remote_client: TestClient, http_root: tuple[Path, str], make_adapter: Callable[..., Path]
) -> None:
    root, _ = http_root
    directory = make_adapter("hfsrc")
    shutil.copytree(directory, root / "hf" / "org" / "sql-lora" / "resolve" / "v2")
    response = register(remote_client, "sql", "hf://org/sql-lora@v2")
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["digest"] == digest(directory)
    missing_rev = register(remote_client, "other", "hf://org/sql-lora")
    assert (
        missing_rev.status_code == 400
        and "/org/sql-lora/resolve/main/" in missing_rev.json()["error"]["message"]
    )


# A static file server (a separate process) that answers only `Authorization: Bearer <token>`:
# 401 without the header, 403 with another token. argv: port, token; serves its cwd.
BEARER_SERVER = """
import http.server, sys
port, token = int(sys.argv[1]), sys.argv[2]
class Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        given = self.headers.get("Authorization")
        if given is None:
            self.send_error(401)
        elif given != "Bearer " + token:
            self.send_error(403)
        else:
            super().do_GET()
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
PRIVATE_TOKEN = "hf_per-adapter-7c1e0b"


@pytest.fixture
def bearer_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "private-www"
    root.mkdir()
    port = free_port()
    process = serve(
        [sys.executable, "-c", BEARER_SERVER, str(port), PRIVATE_TOKEN],
        f"http://127.0.0.1:{port}/",
        cwd=root,
    )
    yield root, f"http://127.0.0.1:{port}"
    stop(process)


def register_with(client: TestClient, name: str, uri: str, credentials: Any = None) -> Any:
    source = {"uri": uri, **({"credentials": credentials} if credentials is not None else {})}
    return client.post(
        "/v1/adapters", json={"name": name, "pool": "tiny", "source": source}, headers=ADMIN
    )


def test_http_source_behind_a_bearer_token_uses_the_adapter_token(
    remote_client: TestClient,
    bearer_root: tuple[Path, str],
    make_adapter: Callable[..., Path],
    db_url: str,
) -> None:
    root, base = bearer_root
    directory = make_adapter("private")
    shutil.copytree(directory, root / "sql")
    before = snapshot(db_url)
    refused = register_with(remote_client, "sql", f"{base}/sql")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "source_not_found"
    assert "answered HTTP 401" in refused.json()["error"]["message"]
    wrong = register_with(remote_client, "sql", f"{base}/sql", {"token": "someone-elses"})
    assert wrong.status_code == 400 and "answered HTTP 403" in wrong.json()["error"]["message"]
    assert snapshot(db_url) == before

    response = register_with(remote_client, "sql", f"{base}/sql", {"token": PRIVATE_TOKEN})
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["digest"] == digest(directory)
    rows = repr(snapshot(db_url))
    assert f"{base}/sql" in rows and PRIVATE_TOKEN not in rows and "someone-elses" not in rows


@pytest.fixture
def moto_with_auth(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """A moto server of its own holding `s3://private/team/sql/` readable by one IAM user,
    with authentication on: requests must be signed with that user's key (moto checks the
    key id and the signature). Yields the URL and the user's keys."""
    import boto3

    port = free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    url = f"http://127.0.0.1:{port}"
    process = serve([exe, "-H", "127.0.0.1", "-p", str(port)], url + "/")
    try:
        setup = {"endpoint_url": url, "region_name": "us-east-1"}
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="adapter-reader")
        iam.put_user_policy(
            UserName="adapter-reader",
            PolicyName="read-adapters",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="adapter-reader")["AccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket="private")
        yield (
            url,
            {
                "aws_access_key_id": key["AccessKeyId"],
                "aws_secret_access_key": key["SecretAccessKey"],
            },
        )
    finally:
        stop(process)


def test_s3_source_uses_the_adapter_keys(
    remote_client: TestClient,
    moto_with_auth: tuple[str, dict[str, str]],
    make_adapter: Callable[..., Path],
    settings: Settings,
    db_url: str,
) -> None:
    import boto3

    url, keys = moto_with_auth
    directory = make_adapter("s3private", rank=4)
    s3 = boto3.client("s3", endpoint_url=url)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(directory / name), "private", f"team/sql/{name}")
    # From now on every request must be signed by a key moto's IAM knows.
    assert httpx.post(f"{url}/moto-api/reset-auth", content=b"0").status_code == 200
    settings.sources.s3_endpoint_url = url

    # The control plane's own keys (AWS_* = "testing") are not moto's IAM user's.
    refused = register_with(remote_client, "sql", "s3://private/team/sql")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "source_not_found"
    wrong = register_with(
        remote_client, "sql", "s3://private/team/sql", {**keys, "aws_secret_access_key": "nope"}
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "source_not_found"

    response = register_with(remote_client, "sql", "s3://private/team/sql", keys)
    assert response.status_code == 201, response.text
    assert response.json()["adapter"]["digest"] == digest(directory)
    rows = repr(snapshot(db_url))
    assert keys["aws_secret_access_key"] not in rows and keys["aws_access_key_id"] not in rows
