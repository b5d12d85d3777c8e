"""Tokens, scopes, namespaces; worker-side adapter names; settings from the environment."""

from __future__ import annotations

import pytest

from loraplane.controlplane.app import http_status
from loraplane.controlplane.auth import ALL_NAMESPACES, Principal, hash_token, new_token
from loraplane.controlplane.errors import ApiError
from loraplane.controlplane.registry import check_label, lora_name
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.unit


def test_tokens_are_random_and_stored_as_sha256() -> None:
    a, b = new_token(), new_token()
    assert a != b and a.startswith("lp_") and len(a) > 40
    assert hash_token(a) == hash_token(a)
    assert len(hash_token(a)) == 64 and a not in hash_token(a)


def test_admin_implies_read_and_route_but_not_other_namespaces() -> None:
    admin = Principal("t", frozenset({"admin"}), "team-a")
    assert admin.has("read") and admin.has("route") and admin.has("admin")
    assert admin.sees("team-a") and not admin.sees("team-b")
    assert not admin.cluster_admin


def test_route_only_token() -> None:
    router = Principal("t", frozenset({"route"}), "team-a")
    assert router.has("route") and not router.has("read") and not router.has("admin")


def test_star_namespace_sees_everything() -> None:
    root = Principal("root", frozenset({"admin"}), ALL_NAMESPACES)
    assert root.sees("anything") and root.cluster_admin


def test_worker_side_names_are_unambiguous() -> None:
    assert lora_name("default", "sql", 1) == "sql"
    assert lora_name("team-a", "sql", 1) == "team-a.sql"
    assert lora_name("default", "sql", 3) == "sql_v3"
    assert lora_name("team-a", "sql", 2) == "team-a.sql_v2"
    # a default-namespace name can never look like a namespaced one: labels have no '.'
    with pytest.raises(ApiError):
        check_label("team-a.sql", "body.name")


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", "trail-", "under_score", "x" * 64, "a.b"])
def test_labels_are_dns_1123(bad: str) -> None:
    with pytest.raises(ApiError) as info:
        check_label(bad, "body.name")
    assert http_status(info.value) == 400 and info.value.field == "body.name"
    assert "DNS-1123" in info.value.message


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_DB_URL", "postgresql+psycopg://u:p@h/db")
    monkeypatch.setenv("LORAPLANE_REDIS_URL", "redis://h:1/0")
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("LORAPLANE_SOURCES__ALLOWED_ROOTS", '["/models", "/data"]')
    monkeypatch.setenv("LORAPLANE_ROUTER__ON_DEMAND_TIMEOUT_S", "7.5")
    settings = Settings()
    assert settings.db_url == "postgresql+psycopg://u:p@h/db"
    assert settings.redis_url == "redis://h:1/0"
    assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "s3cret"
    assert [str(p) for p in settings.sources.allowed_roots] == ["/models", "/data"]
    assert settings.router.on_demand_timeout_s == 7.5


def test_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LORAPLANE_DB_URL", "LORAPLANE_REDIS_URL", "LORAPLANE_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert settings.db_url == "sqlite:///./loraplane.db"
    assert settings.redis_url is None and settings.auth is True


def test_the_token_cache_forgets_after_its_ttl_and_on_revocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token's principal is served from memory until ``ttl_s`` after its lookup; a
    revocation empties the cache, and a lookup that ran across it is not kept (it may have
    read the token before the revocation's commit)."""
    from loraplane.controlplane import auth

    now = [100.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    cache = auth.TokenCache(ttl_s=5.0)
    reader = Principal("r", frozenset({"read"}), "default")
    cache.put("h1", reader, cache.generation)
    now[0] += 4.9
    assert cache.get("h1") == reader
    now[0] += 0.2
    assert cache.get("h1") is None  # (looked up again)

    started = cache.generation  # a lookup begins...
    cache.put("h1", reader, cache.generation)
    cache.invalidate()  # ...a revocation lands...
    assert cache.get("h1") is None
    cache.put("h2", reader, started)  # ...and what it read is not kept
    assert cache.get("h2") is None
    off = auth.TokenCache(ttl_s=0.0)
    off.put("h1", reader, off.generation)
    assert off.get("h1") is None
