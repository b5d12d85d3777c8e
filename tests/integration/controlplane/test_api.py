"""The control plane's HTTP API on SQLite and PostgreSQL, without workers: pools, workers,
adapters, operations, tokens; every bad input is a 4xx naming the field, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cp_kit import ADMIN, POOL, HungWorker, join_hung_worker, metric_value, snapshot, wait_for
from fastapi.testclient import TestClient

from loraplane.controlplane.app import ControlPlaneApp, create_app
from loraplane.controlplane.settings import Settings

pytestmark = pytest.mark.integration


def register(
    client: TestClient,
    directory: Path,
    name: str = "sql",
    headers: dict[str, str] = ADMIN,
    **fields: Any,
) -> Any:
    body = {"name": name, "pool": "tiny", "source": {"uri": f"file://{directory}"}, **fields}
    return client.post("/v1/adapters", json=body, headers=headers)


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"database": "ok", "redis": "disabled"}


def test_pool_create_update_read_delete(client: TestClient) -> None:
    created = client.post(
        "/v1/pools", json={"namespace": "default", "name": "p", **POOL}, headers=ADMIN
    )
    assert created.status_code == 201, created.text
    assert created.json()["max_loras_per_batch"] == 3
    again = client.post(
        "/v1/pools", json={"namespace": "default", "name": "p", **POOL}, headers=ADMIN
    )
    assert again.status_code == 409 and "already exists" in again.json()["error"]["message"]
    updated = client.put("/v1/pools/default/p", json={**POOL, "max_lora_rank": 64}, headers=ADMIN)
    assert updated.json()["max_lora_rank"] == 64
    detail = client.get("/v1/pools/default/p", headers=ADMIN).json()
    assert detail["workers"] == [] and detail["adapters"] == 0
    assert client.delete("/v1/pools/default/p", headers=ADMIN).status_code == 204
    assert client.get("/v1/pools/default/p", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    ("change", "status", "field", "needle"),
    [
        ({"tp": 3, "dp": 2}, 400, "body.dp", "tp=3 must be a multiple of dp=2"),
        ({"max_loaded_loras": 2}, 400, "body.max_loaded_loras", "below max_loras_per_batch=3"),
        ({"max_lora_rank": 0}, 422, "body.max_lora_rank", "greater than or equal to 1"),
        ({"tp": "two"}, 422, "body.tp", "valid integer"),
        ({"surprise": 1}, 422, "body.surprise", "not a field of this endpoint"),
    ],
)
def test_bad_pool_specs_change_nothing(
    client: TestClient, db_url: str, change: dict[str, Any], status: int, field: str, needle: str
) -> None:
    before = snapshot(db_url)
    response = client.put("/v1/pools/default/p", json={**POOL, **change}, headers=ADMIN)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and needle in error["message"]
    assert snapshot(db_url) == before


def test_worker_registration_and_unreachable_marking(
    client: TestClient, pool: dict[str, Any]
) -> None:
    body = {"name": "tiny-0", "pool": "tiny", "endpoint": "http://127.0.0.1:9", "dp_size": 2}
    first = client.post("/v1/workers", json=body, headers=ADMIN)
    assert first.status_code == 201, first.text
    assert first.json()["dp_groups"] == [
        {"dp_group": g, "adapters": [], "slots_used": 0, "slots_total": 3}
        | {"kv_pages_used": 0, "kv_pages_total": 0}  # (not seen from the worker yet)
        for g in (0, 1)
    ]
    second = client.post(
        "/v1/workers", json={**body, "endpoint": "http://127.0.0.1:10/"}, headers=ADMIN
    )
    assert second.status_code == 200 and second.json()["endpoint"] == "http://127.0.0.1:10"
    worker = wait_for(
        lambda: (
            (w := client.get("/v1/workers/tiny-0", headers=ADMIN).json())["state"] == "unreachable"
            and w
        ),
        what="the reconciler to mark the worker unreachable",
    )
    assert "tiny-0" in worker["last_error"]
    listed = client.get("/v1/workers", params={"state": "unreachable"}, headers=ADMIN).json()[
        "items"
    ]
    assert [w["name"] for w in listed] == ["tiny-0"]


def test_a_worker_row_with_an_unusable_endpoint_fails_no_other_worker(
    client: TestClient, pool: dict[str, Any], db_url: str
) -> None:
    """A row the API would refuse now (an endpoint with a line break, as an older release
    stored) is marked unreachable with the reason, and the passes go on for the others."""
    import sqlalchemy as sa

    for name in ("tiny-0", "tiny-1"):
        body = {"name": name, "pool": "tiny", "endpoint": "http://127.0.0.1:9", "dp_size": 2}
        assert client.post("/v1/workers", json=body, headers=ADMIN).status_code == 201
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE workers SET endpoint = :e WHERE name = 'tiny-0'"),
            {"e": "http://127.0.0.1:9\n"},
        )
    engine.dispose()
    # A pass that ran before the UPDATE marks tiny-0 unreachable for the refused connection;
    # wait for the pass that read the stored line break and names it.
    reasons = {"tiny-0": "InvalidURL", "tiny-1": "ConnectError"}
    for name, reason in reasons.items():
        worker = wait_for(
            lambda name=name, reason=reason: (
                (w := client.get(f"/v1/workers/{name}", headers=ADMIN).json())["state"]
                == "unreachable"
                and reason in (w["last_error"] or "")
                and w
            ),
            what=f"the reconciler to mark {name} unreachable for {reason}",
        )
        assert name in worker["last_error"]
    passes = metric_value(
        client.get("/metrics").text, "loraplane_reconcile_passes_total", outcome="ok"
    )
    wait_for(
        lambda: (
            metric_value(
                client.get("/metrics").text, "loraplane_reconcile_passes_total", outcome="ok"
            )
            > passes
        ),
        what="another reconcile pass that succeeds",
    )


@pytest.mark.parametrize(
    ("change", "status", "field", "needle"),
    [
        ({"pool": "nope"}, 404, "body.pool", "pool 'default/nope' not found"),
        ({"dp_size": 4}, 400, "body.dp_size", "does not match pool tiny's dp=2"),
        ({"endpoint": "tcp://x:1"}, 400, "body.endpoint", "not an http(s)://host[:port] URL"),
        ({"name": "Bad_Name"}, 400, "body.name", "DNS-1123"),
        ({"name": "tiny-0\n"}, 400, "body.name", "DNS-1123"),
        ({"namespace": "default\n"}, 400, "body.namespace", "DNS-1123"),
        ({"dp_size": 0}, 422, "body.dp_size", "greater than or equal to 1"),
        ({"endpoint": "http://127.0.0.1:9\n"}, 400, "body.endpoint", "control"),
        ({"endpoint": "http://u:pw@127.0.0.1:9"}, 400, "body.endpoint", "credentials"),
        ({"endpoint": "http://127.0.0.1:99999"}, 400, "body.endpoint", "1..65535"),
        ({"endpoint": "http://127.0.0.1:9/?x=1"}, 400, "body.endpoint", "query"),
    ],
)
def test_bad_worker_registrations_change_nothing(
    client: TestClient,
    pool: dict[str, Any],
    db_url: str,
    change: dict[str, Any],
    status: int,
    field: str,
    needle: str,
) -> None:
    before = snapshot(db_url)
    body = {
        "name": "tiny-0",
        "pool": "tiny",
        "endpoint": "http://127.0.0.1:9",
        "dp_size": 2,
        **change,
    }
    response = client.post("/v1/workers", json=body, headers=ADMIN)
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field
    assert needle in response.json()["error"]["message"]
    assert snapshot(db_url) == before


def test_register_adapter_without_ready_workers_is_pending(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    directory = make_adapter(rank=8, modules=("q_proj", "v_proj"))
    response = register(client, directory)
    assert response.status_code == 201, response.text
    adapter, op = response.json()["adapter"], response.json()["operation"]
    assert adapter["phase"] == "Pending" and adapter["routable"] is False
    assert adapter["rank"] == 8 and adapter["target_modules"] == ["q_proj", "v_proj"]
    assert adapter["lora_name"] == "sql" and adapter["placements"] == []
    assert op["kind"] == "register" and op["state"] == "succeeded" and op["targets"] == []
    assert client.get("/v1/operations/" + op["id"], headers=ADMIN).json()["state"] == "succeeded"
    listed = client.get("/v1/adapters", headers=ADMIN).json()["items"]
    assert [a["name"] for a in listed] == ["sql"]
    dup = register(client, directory)
    assert dup.status_code == 409 and dup.json()["error"]["field"] == "body.name"


def test_parallel_registrations_of_one_new_name_create_it_once(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    directory = make_adapter()
    with ThreadPoolExecutor(10) as threads:
        answers = list(threads.map(lambda _: register(client, directory, "race"), range(10)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] + [409] * 9, [r.text for r in answers]
    for r in answers:
        if r.status_code == 409:
            assert r.json()["error"]["field"] == "body.name", r.text
    listed = client.get("/v1/adapters", headers=ADMIN).json()["items"]
    assert [a["name"] for a in listed] == ["race"]


def test_idempotency_key_replays_and_refuses_a_different_body(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path], db_url: str
) -> None:
    directory = make_adapter()
    key = {"Idempotency-Key": "create-sql-1", **ADMIN}
    first = register(client, directory, headers=key)
    second = register(client, directory, headers=key)
    assert first.status_code == second.status_code == 201
    assert first.json()["operation"]["id"] == second.json()["operation"]["id"]
    assert first.json()["operation"]["idempotency_key"] == "create-sql-1"
    before = snapshot(db_url)
    other = register(client, directory, name="other", headers=key)
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_mismatch"
    assert other.json()["error"]["field"] == "header.Idempotency-Key"
    assert snapshot(db_url) == before
    assert len(client.get("/v1/operations", headers=ADMIN).json()["items"]) == 1


def test_parallel_requests_with_one_key_answer_one_operation(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path], db_url: str
) -> None:
    """A client that retries before its first answer came (after a timeout, or through two
    replicas behind a load balancer) gets the one operation back every time, not a conflict
    with itself."""
    directory = make_adapter()
    key = {"Idempotency-Key": "create-race", **ADMIN}
    with ThreadPoolExecutor(8) as threads:
        answers = list(threads.map(lambda _: register(client, directory, "race", key), range(8)))
    # the request that ran it answers 201 once it is done; a replay while it runs, 202
    codes = [r.status_code for r in answers]
    assert set(codes) <= {201, 202} and 201 in codes, [r.text for r in answers]
    assert len({r.json()["operation"]["id"] for r in answers}) == 1
    assert len(client.get("/v1/operations", headers=ADMIN).json()["items"]) == 1
    assert [a["name"] for a in client.get("/v1/adapters", headers=ADMIN).json()["items"]] == [
        "race"
    ]


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("DELETE", "/v1/adapters/default/race", None),
        ("PATCH", "/v1/adapters/default/race", {"pinned": True}),
    ],
    ids=["delete", "pin"],
)
def test_parallel_changes_with_one_key_answer_one_operation(
    client: TestClient,
    pool: dict[str, Any],
    make_adapter: Callable[..., Path],
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    """The retries that lose to the first find the adapter gone or the pin already set: they
    answer the first's operation, not 404 or a change with no operation."""
    assert register(client, make_adapter(), "race").status_code == 201
    key = {"Idempotency-Key": f"{method}-race", **ADMIN}
    with ThreadPoolExecutor(8) as threads:
        answers = list(
            threads.map(lambda _: client.request(method, path, json=body, headers=key), range(8))
        )
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 202} and 200 in codes, [r.text for r in answers]
    ids = {r.json()["operation"]["id"] for r in answers}
    assert len(ids) == 1 and None not in ids, [r.text for r in answers]


@pytest.mark.parametrize("rank, status", [(4, 409), (32, 201)], ids=["lowered", "raised"])
def test_a_pool_limit_changed_while_the_source_is_checked(
    client: TestClient,
    pool: dict[str, Any],
    make_adapter: Callable[..., Path],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    rank: int,
    status: int,
) -> None:
    """A PUT that lowers max_lora_rank while a registration fetches and checks its source
    (the PUT cannot see that adapter yet) makes the registration fail with pool_changed,
    not record a rank-8 adapter in a pool of rank 4; a change the adapter still fits lets
    it through."""
    import sqlalchemy as sa

    from loraplane.controlplane import application

    checked = application._preflight

    async def check_then_change(*args: Any) -> Any:
        facts = await checked(*args)
        engine = sa.create_engine(db_url)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE pools SET max_lora_rank = :r"), {"r": rank})
        engine.dispose()
        return facts

    monkeypatch.setattr(application, "_preflight", check_then_change)
    before = snapshot(db_url)
    answer = register(client, make_adapter())
    assert answer.status_code == status, answer.text
    if status == 201:
        return
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == ("pool_changed", "body.pool")
    assert "max_lora_rank=4" in error["message"]
    after = snapshot(db_url)
    assert after["adapters"] == before["adapters"] == []
    assert after["operations"] == before["operations"] == []


def test_a_pool_limit_is_not_lowered_under_an_operation_in_progress(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path], db_url: str
) -> None:
    """A new version in flight records its rank only once loaded: a lower rank waits for
    the pool's operations to finish; the same spec does not."""
    import sqlalchemy as sa

    assert register(client, make_adapter()).status_code == 201
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE adapters SET busy_operation_id = 'op_inflight'"))
    engine.dispose()
    lower = client.put("/v1/pools/default/tiny", json={**POOL, "max_lora_rank": 12}, headers=ADMIN)
    assert lower.status_code == 409, lower.text
    assert lower.json()["error"]["code"] == "operation_in_progress"
    assert "default/sql (op_inflight)" in lower.json()["error"]["message"]
    same = client.put("/v1/pools/default/tiny", json=POOL, headers=ADMIN)
    assert same.status_code == 200, same.text


def test_idempotency_keys_are_per_namespace(
    client: TestClient, make_adapter: Callable[..., Path]
) -> None:
    """Two tenants that pick the same key each get their own operation: neither is refused
    nor shown the other's operation id."""
    ops = {}
    for namespace in ("team-a", "team-b"):
        client.put(f"/v1/pools/{namespace}/tiny", json=POOL, headers=ADMIN)
        admin = {"Idempotency-Key": "nightly-1", **make_token(client, ["admin"], namespace)}
        body = {
            "namespace": namespace,
            "name": "sql",
            "pool": "tiny",
            "source": {"uri": f"file://{make_adapter(namespace)}"},
        }
        first = client.post("/v1/adapters", json=body, headers=admin)
        assert first.status_code == 201, first.text
        again = client.post("/v1/adapters", json=body, headers=admin)
        assert again.status_code == 201, again.text
        assert again.json()["operation"]["id"] == first.json()["operation"]["id"]
        ops[namespace] = first.json()["operation"]["id"]
    assert ops["team-a"] != ops["team-b"]
    listed = client.get("/v1/adapters", headers=ADMIN).json()["items"]
    assert sorted((a["namespace"], a["name"]) for a in listed) == [
        ("team-a", "sql"),
        ("team-b", "sql"),
    ]


def test_calls_that_take_no_body_refuse_one_with_fields(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path], db_url: str
) -> None:
    """An unload sent as if it took a placement would unload every copy: refused by name,
    nothing changed; an empty object is no body."""
    assert register(client, make_adapter()).status_code == 201
    before = snapshot(db_url)
    for method, path in (
        ("POST", "/v1/adapters/default/sql/unload"),
        ("DELETE", "/v1/adapters/default/sql"),
        ("DELETE", "/v1/pools/default/tiny"),
        ("DELETE", "/v1/workers/w0"),
        ("DELETE", "/v1/tokens/tok_0"),
    ):
        refused = client.request(method, path, json={"placement": {"count": 1}}, headers=ADMIN)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == "body.placement", refused.text
    assert snapshot(db_url) == before
    unloaded = client.post("/v1/adapters/default/sql/unload", json={}, headers=ADMIN)
    assert unloaded.status_code == 200 and unloaded.json()["operation"]["kind"] == "unload"


def bad_adapter_cases() -> list[Any]:
    return [
        pytest.param(
            lambda d, mk: {"pool": "nope"},
            404,
            "not_found",
            "body.pool",
            "pool 'default/nope' not found",
            id="unknown-pool",
        ),
        pytest.param(
            lambda d, mk: {"name": "Has Space"},
            400,
            "invalid_value",
            "body.name",
            "DNS-1123",
            id="bad-name",
        ),
        pytest.param(
            lambda d, mk: {"source": None},
            422,
            "validation_error",
            "body.source",
            "",
            id="no-source",
        ),
        pytest.param(
            lambda d, mk: {"placement": {"count": 0}},
            422,
            "validation_error",
            "body.placement",
            "",
            id="zero-count",
        ),
        pytest.param(
            lambda d, mk: {"extra": True},
            422,
            "validation_error",
            "body.extra",
            "not a field of this endpoint",
            id="unknown-field",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{mk('r64', rank=64)}"}},
            400,
            "preflight_failed",
            "body.source.uri",
            "max_lora_rank=16",
            id="rank-too-high",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{mk('mlp', modules=('gate_proj',))}"}},
            400,
            "preflight_failed",
            "body.source.uri",
            "['gate_proj'] are not supported",
            id="bad-modules",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{mk('nan', poison='nan')}"}},
            400,
            "preflight_failed",
            "body.source.uri",
            "NaN",
            id="nan",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{mk('other', base='org/other-model')}"}},
            400,
            "preflight_failed",
            "body.source.uri",
            "trained on base model",
            id="base-mismatch",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{d}", "sha256": "ab" * 32}},
            400,
            "digest_mismatch",
            "body.source.sha256",
            "expected " + "ab" * 32,
            id="digest",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": "file:///etc"}},
            400,
            "source_not_allowed",
            "body.source.uri",
            "outside the allowed roots",
            id="outside-roots",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": "gopher://x/y"}},
            400,
            "invalid_source",
            "body.source.uri",
            "unsupported scheme",
            id="bad-scheme",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": "file:///" + "u" * 2041}},  # 2049 characters
            422,
            "validation_error",
            "body.source.uri",
            "at most 2048 characters",
            id="uri-too-long",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": f"file://{d}/" + "n" * 1500}},  # (ENAMETOOLONG)
            400,
            "source_not_found",
            "body.source.uri",
            "cannot be read",
            id="name-too-long",
        ),
        pytest.param(
            lambda d, mk: {"name": "x" * 5000},
            400,
            "invalid_value",
            "body.name",
            "(5000 characters)",
            id="long-name-quoted-short",
        ),
        pytest.param(
            lambda d, mk: {
                "source": {"uri": "http://127.0.0.1:9/a", "credentials": {"token": "s3cr\u00e9t"}}
            },
            422,
            "validation_error",
            "body.source.credentials.token",
            "printable ASCII",
            id="token-not-a-header",
        ),
        pytest.param(
            lambda d, mk: {"source": {"uri": "x", "sha256": "nothex"}},
            422,
            "validation_error",
            "body.source.sha256",
            "",
            id="sha-format",
        ),
    ]


@pytest.mark.parametrize(("change", "status", "code", "field", "needle"), bad_adapter_cases())
def test_bad_adapter_registrations_change_nothing(
    client: TestClient,
    pool: dict[str, Any],
    make_adapter: Callable[..., Path],
    db_url: str,
    change: Callable[..., dict[str, Any]],
    status: int,
    code: str,
    field: str,
    needle: str,
) -> None:
    good = make_adapter("good")
    body = {"name": "sql", "pool": "tiny", "source": {"uri": f"file://{good}"}}
    body.update(change(good, make_adapter))
    before = snapshot(db_url)
    response = client.post("/v1/adapters", json=body, headers=ADMIN)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["field"] == field and needle in error["message"], error
    assert len(response.content) < 2000 and "s3cr" not in response.text  # (no secret, no echo)
    assert snapshot(db_url) == before


def test_names_bodies_and_paths_are_refused_whole(client: TestClient, db_url: str) -> None:
    """A name with a trailing newline is no DNS label; a body that is not JSON is refused as
    the body; a long path name is quoted short."""
    before = snapshot(db_url)
    for path in ("/v1/pools/default/px%0A", "/v1/pools/default%0A/px"):
        response = client.put(path, json=POOL, headers=ADMIN)
        assert response.status_code == 400, response.text
    bad = client.post(
        "/v1/pools", content='{"name": "p",', headers={**ADMIN, "content-type": "application/json"}
    )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "body", bad.text
    assert "not valid JSON at character" in bad.json()["error"]["message"]
    plain = client.post("/v1/pools", content="{}", headers={**ADMIN, "content-type": "text/plain"})
    assert "Content-Type: application/json" in plain.json()["error"]["message"], plain.text
    response = client.get(f"/v1/pools/default/{'q' * 5000}", headers=ADMIN)
    assert response.status_code in (400, 404) and len(response.content) < 1000, response.text
    # a lone surrogate (valid JSON, no Unicode text) is refused by its field, not a 500
    lone = '"\\ud800"'
    for path, body, field in (
        ("/v1/workers", f'{{"name": "w", "pool": {lone}, "endpoint": "http://h:1", "dp_size": 1}}',
         "body.pool"),
        ("/v1/adapters", f'{{"name": "a", "pool": {lone}, "source": {{"uri": "file:///x"}}}}',
         "body.pool"),
        ("/v1/pools", f'{{"name": "p", "model": {lone}}}', "body.model"),
    ):  # fmt: skip
        r = client.post(path, content=body, headers={**ADMIN, "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
        message = r.json()["error"]["message"]
        assert "lone surrogate" in message or "unicode string" in message, message
    r = client.post(
        "/v1/completions",
        content=f'{{"model": {lone}, "prompt": "hi"}}',
        headers={**ADMIN, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "body.model", r.text
    assert snapshot(db_url) == before


def test_pinning_on_a_pool_with_one_slot_is_refused(
    client: TestClient, make_adapter: Callable[..., Path], db_url: str
) -> None:
    client.put("/v1/pools/default/tiny", json={**POOL, "max_loras_per_batch": 1}, headers=ADMIN)
    before = snapshot(db_url)
    response = register(client, make_adapter(), pinned=True)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "too_many_pinned"
    assert "max_loras_per_batch=1" in response.json()["error"]["message"]
    assert snapshot(db_url) == before


def test_load_with_no_ready_worker_is_a_clear_conflict(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path], db_url: str
) -> None:
    register(client, make_adapter(), load=False)
    client.post(
        "/v1/workers",
        json={"name": "w0", "pool": "tiny", "endpoint": "http://127.0.0.1:9", "dp_size": 2},
        headers=ADMIN,
    )
    wait_for(lambda: client.get("/v1/workers/w0", headers=ADMIN).json()["state"] == "unreachable")
    before = snapshot(db_url)
    response = client.post("/v1/adapters/default/sql/load", headers=ADMIN)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_capacity"
    assert "w0: not ready" in response.json()["error"]["message"]
    after = snapshot(db_url)
    assert {t: rows for t, rows in after.items() if t != "workers"} == {
        t: rows for t, rows in before.items() if t != "workers"
    }


def test_unload_of_an_adapter_loaded_nowhere_succeeds(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter())
    response = client.post("/v1/adapters/default/sql/unload", headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json()["adapter"]["phase"] == "Unloaded"
    deleted = client.delete("/v1/adapters/default/sql", headers=ADMIN)
    assert deleted.status_code == 200 and deleted.json()["operation"]["kind"] == "delete"
    assert client.get("/v1/adapters/default/sql", headers=ADMIN).status_code == 404


def test_new_version_of_an_adapter_loaded_nowhere(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter("v1", rank=4))
    response = client.post(
        "/v1/adapters/default/sql/version",
        json={"source": {"uri": f"file://{make_adapter('v2', rank=8)}"}},
        headers=ADMIN,
    )
    assert response.status_code == 200, response.text
    adapter = response.json()["adapter"]
    assert adapter["version"] == 2 and adapter["rank"] == 8 and adapter["lora_name"] == "sql_v2"


def test_patch_priority_and_pin_an_adapter_loaded_nowhere(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter())
    response = client.patch("/v1/adapters/default/sql", json={"priority": 5}, headers=ADMIN)
    assert response.status_code == 200 and response.json()["operation"] is None
    assert response.json()["adapter"]["priority"] == 5
    pinned = client.patch("/v1/adapters/default/sql", json={"pinned": True}, headers=ADMIN)
    assert pinned.status_code == 200, pinned.text
    assert (
        pinned.json()["adapter"]["pinned"] is True and pinned.json()["operation"]["kind"] == "pin"
    )


def make_token(client: TestClient, scopes: list[str], namespace: str) -> dict[str, str]:
    response = client.post(
        "/v1/tokens",
        json={"name": f"{namespace}-{'-'.join(scopes)}", "scopes": scopes, "namespace": namespace},
        headers=ADMIN,
    )
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['token']}"}


def test_a_namespaced_reader_lists_its_latest_operations_past_other_tenants(
    client: TestClient, make_adapter: Callable[..., Path]
) -> None:
    """The list's limit counts the caller's own operations: a tenant whose operations are
    older than the last `limit` of the whole registry still sees them."""
    for namespace, names in (("team-a", ["a0"]), ("team-b", ["b0", "b1", "b2"])):
        client.put(f"/v1/pools/{namespace}/tiny", json=POOL, headers=ADMIN)
        for name in names:
            body = {
                "namespace": namespace,
                "name": name,
                "pool": "tiny",
                "source": {"uri": f"file://{make_adapter(f'{namespace}-{name}')}"},
            }
            assert client.post("/v1/adapters", json=body, headers=ADMIN).status_code == 201
    reader_a = make_token(client, ["read"], "team-a")
    listed = client.get("/v1/operations", params={"limit": 2}, headers=reader_a).json()["items"]
    assert [(op["namespace"], op["adapter"]) for op in listed] == [("team-a", "a0")]
    everyone = client.get("/v1/operations", params={"limit": 2}, headers=ADMIN).json()["items"]
    assert [op["namespace"] for op in everyone] == ["team-b", "team-b"]


def test_scopes_and_namespaces(
    client: TestClient, make_adapter: Callable[..., Path], db_url: str
) -> None:
    for namespace in ("team-a", "team-b"):
        client.put(f"/v1/pools/{namespace}/tiny", json=POOL, headers=ADMIN)
        response = client.post(
            "/v1/adapters",
            json={
                "namespace": namespace,
                "name": "sql",
                "pool": "tiny",
                "source": {"uri": f"file://{make_adapter(namespace)}"},
            },
            headers=ADMIN,
        )
        assert response.status_code == 201, response.text
    reader_a = make_token(client, ["read"], "team-a")
    router_a = make_token(client, ["route"], "team-a")
    admin_a = make_token(client, ["admin"], "team-a")
    listed = client.get("/v1/adapters", headers=reader_a).json()["items"]
    assert [(a["namespace"], a["name"]) for a in listed] == [("team-a", "sql")]
    assert client.get("/v1/adapters", headers=ADMIN).json()["items"].__len__() == 2
    before = snapshot(db_url)
    foreign = client.get("/v1/adapters/team-b/sql", headers=reader_a)
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "forbidden_namespace"
    assert "may not access namespace 'team-b'" in foreign.json()["error"]["message"]
    scope = client.get("/v1/adapters", headers=router_a)
    assert scope.status_code == 403 and "needs 'read'" in scope.json()["error"]["message"]
    write = client.post("/v1/adapters/team-a/sql/unload", headers=reader_a)
    assert write.status_code == 403 and write.json()["error"]["code"] == "forbidden_scope"
    cross = client.post(
        "/v1/adapters",
        json={
            "namespace": "team-b",
            "name": "x",
            "pool": "tiny",
            "source": {"uri": "file:///nope"},
        },
        headers=admin_a,
    )
    assert cross.status_code == 403 and cross.json()["error"]["field"] == "body.namespace"
    pools = client.put("/v1/pools/team-a/other", json=POOL, headers=admin_a)
    assert pools.status_code == 403 and "namespace '*'" in pools.json()["error"]["message"]
    routed = client.post(
        "/v1/completions",
        json={"model": "tiny:sql", "prompt": "x"},
        headers={**router_a, "X-Loraplane-Namespace": "team-b"},
    )
    assert routed.status_code == 403
    unknown = client.get("/v1/adapters", headers={"Authorization": "Bearer lp_not-a-token"})
    assert (
        unknown.status_code == 401
        and unknown.json()["error"]["message"] == "header.Authorization: unknown token"
    )
    assert snapshot(db_url) == before


def test_token_listing_hides_secrets_and_revocation(client: TestClient) -> None:
    token = make_token(client, ["read"], "default")
    items = client.get("/v1/tokens", headers=ADMIN).json()["items"]
    assert len(items) == 1 and "token" not in items[0] and "token_hash" not in items[0]
    assert client.get("/v1/pools", headers=token).status_code == 200
    assert client.delete(f"/v1/tokens/{items[0]['id']}", headers=ADMIN).status_code == 204
    assert client.get("/v1/pools", headers=token).status_code == 401


@pytest.mark.parametrize("cache_s", [5.0, 0.0])
def test_a_known_token_is_not_looked_up_per_request(settings: Settings, cache_s: float) -> None:
    """A bearer token is looked up once and then accepted from memory (``token_cache_s``), so
    a request does not wait for the database to learn who sent it; with 0, once per request.
    A revocation is refused at once either way."""
    import sqlalchemy as sa

    settings.token_cache_s = cache_s
    with TestClient(create_app(settings)) as client:
        token = make_token(client, ["read"], "default")
        lookups: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if "FROM tokens" in statement:
                lookups.append(statement)

        engine = client.app.state.services.db.engine  # type: ignore[attr-defined]
        sa.event.listen(engine, "after_cursor_execute", count)
        for _ in range(5):
            assert client.get("/v1/pools", headers=token).status_code == 200
        assert len(lookups) == (1 if cache_s else 5), lookups
        token_id = client.get("/v1/tokens", headers=ADMIN).json()["items"][0]["id"]
        assert client.delete(f"/v1/tokens/{token_id}", headers=ADMIN).status_code == 204
        refused = client.get("/v1/pools", headers=token)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["field"] == "header.Authorization"


def test_router_errors_are_clear(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter())
    no_model = client.post("/v1/completions", json={"prompt": "x"}, headers=ADMIN)
    assert no_model.status_code == 400 and no_model.json()["error"]["field"] == "body.model"
    # a lora_path would win over the adapter the router picks, on the worker
    path = client.post(
        "/v1/completions",
        json={"model": "tiny:sql", "lora_path": "other", "prompt": "x"},
        headers=ADMIN,
    )
    assert path.status_code == 400 and path.json()["error"]["field"] == "body.lora_path"
    unknown = client.post(
        "/v1/completions", json={"model": "tiny:nope", "prompt": "x"}, headers=ADMIN
    )
    assert (
        unknown.status_code == 404
        and "adapter 'nope' not found" in unknown.json()["error"]["message"]
    )
    wrong_pool = client.post(
        "/v1/chat/completions", json={"model": "other:sql", "messages": []}, headers=ADMIN
    )
    assert (
        wrong_pool.status_code == 404
        and "belongs to pool 'tiny'" in wrong_pool.json()["error"]["message"]
    )
    no_worker = client.post(
        "/v1/completions", json={"model": "tiny:sql", "prompt": "x"}, headers=ADMIN
    )
    assert no_worker.status_code == 503, no_worker.text
    assert no_worker.json()["error"]["code"] == "no_worker"
    base = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=ADMIN)
    assert base.status_code == 503 and "no ready worker" in base.json()["error"]["message"]
    models = client.get("/v1/models", headers=ADMIN).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("tiny:sql", "tiny")]
    # none of them reached a worker: counted by error code, not by the client's model string
    text = client.get("/metrics").text
    for code, n in (("invalid_value", 2), ("not_found", 2), ("no_worker", 2)):
        assert f'loraplane_router_rejected_total{{code="{code}"}} {n}.0' in text, text
    assert "nope" not in text and 'adapter="other' not in text


def test_the_router_routes_answer_like_the_rest_of_the_api(
    client: TestClient, settings: Settings
) -> None:
    """The completion routes are served ahead of FastAPI (``api/proxy.py``): a missing or
    unknown token, a token without the route scope, a body over the limit sent without a
    length, and a wrong method get the answers every other route gives."""
    reader = make_token(client, ["read"], "default")
    for headers in ({}, {"Authorization": "Bearer lp_unknown"}, {"Authorization": "Basic x"}):
        routed = client.post("/v1/completions", json={"model": "m"}, headers=headers)
        api = client.get("/v1/adapters", headers=headers)
        assert routed.status_code == api.status_code == 401
        assert routed.json() == api.json() and routed.json()["error"]["code"] == "unauthenticated"
    scoped = client.post("/v1/chat/completions", json={"model": "m"}, headers=reader)
    assert scoped.status_code == 403 and scoped.json()["error"]["code"] == "forbidden_scope"
    assert "this call needs 'route'" in scoped.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is met as the body streams
        yield b'{"model": "'
        for _ in range(settings.max_request_bytes // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    too_large = {}
    for path in ("/v1/completions", "/v1/adapters"):
        answer = client.post(path, content=chunks(), headers=ADMIN)
        assert answer.status_code == 413, answer.text[:300]
        too_large[path] = answer.json()
    assert too_large["/v1/completions"] == too_large["/v1/adapters"]
    assert too_large["/v1/completions"]["error"]["field"] == "body"
    wrong_method = client.get("/v1/completions", headers=ADMIN)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert "/v1/completions" in client.get("/openapi.json").json()["paths"]
    # refused before routing: not counted as the router's rejections
    assert 'code="unauthenticated"' not in client.get("/metrics").text
    # through FastAPI's routing (the router mounted elsewhere), the same handler answers
    app = client.app
    assert isinstance(app, ControlPlaneApp)
    app.inference = None
    assert client.post("/v1/chat/completions", json={"model": "m"}, headers=reader).json() == (
        scoped.json()
    )
    unknown = client.post("/v1/completions", json={"model": "nope"}, headers=ADMIN)
    assert unknown.status_code == 404 and unknown.json()["error"]["field"] == "body.model"


def test_metrics_count_operations(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter())
    text = client.get("/metrics").text
    assert (
        'loraplane_operations_total{kind="register",namespace="default",outcome="succeeded",'
        'pool="tiny"} 1.0'
    ) in text
    # The in-process event bus (no Redis configured here) is up.
    assert "loraplane_event_bus_up 1.0" in text
    for name in (
        "loraplane_fanout_latency_seconds",
        "loraplane_drift_repaired_total",
        "loraplane_routed_requests_total",
        "loraplane_on_demand_loads_total",
        "loraplane_on_demand_wait_seconds",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text


def test_operations_and_placements_listing(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    register(client, make_adapter(), load=False)
    client.post("/v1/adapters/default/sql/unload", headers=ADMIN)
    ops = client.get("/v1/operations", params={"adapter": "sql"}, headers=ADMIN).json()["items"]
    assert [o["kind"] for o in ops] == ["unload", "register"]
    assert client.get("/v1/operations", params={"limit": 0}, headers=ADMIN).status_code == 422
    assert client.get("/v1/operations/op_missing", headers=ADMIN).status_code == 404
    assert client.get("/v1/placements", headers=ADMIN).json() == {"items": []}


def test_a_worker_slower_than_the_request_timeout_is_a_504_and_stays_ready(
    settings: Settings, db_url: str
) -> None:
    """A worker that accepts the request and does not answer in time is busy, not gone: the
    client gets 504 naming the timeout, and the worker is not taken out of rotation."""
    settings.reconciler.enabled = False  # its probes would time out on this worker too
    settings.router.request_timeout_s = 1
    worker = HungWorker()
    try:
        with TestClient(create_app(settings)) as client:
            join_hung_worker(client, worker, db_url)
            slow = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=ADMIN
            )
            assert slow.status_code == 504, slow.text
            error = slow.json()["error"]
            assert error["code"] == "upstream_timeout" and "within 1 s" in error["message"]
            assert client.get("/v1/workers/w0", headers=ADMIN).json()["state"] == "ready"
    finally:
        worker.close()


def test_a_body_over_the_limit_is_refused_with_413(
    settings: Settings, pool: dict[str, Any], client: TestClient
) -> None:
    big = b'{"name": "' + b"x" * (17 * 1024 * 1024) + b'"}'
    for path in ("/v1/adapters", "/v1/completions"):
        r = client.post(path, content=big, headers={**ADMIN, "content-type": "application/json"})
        assert r.status_code == 413, r.text[:300]
        assert r.json()["error"]["field"] == "body" and r.json()["error"]["code"] == "too_large"
    assert client.get("/v1/adapters", headers=ADMIN).json()["items"] == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"pinned": "yes"}, "body.pinned"),
        ({"load": 1}, "body.load"),
        ({"priority": "5"}, "body.priority"),
    ],
)
def test_booleans_and_numbers_are_not_coerced(
    client: TestClient,
    pool: dict[str, Any],
    make_adapter: Callable[..., Path],
    fields: dict[str, Any],
    field: str,
) -> None:
    r = register(client, make_adapter(), **fields)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field, r.text
    assert client.get("/v1/adapters", headers=ADMIN).json()["items"] == []


def test_load_policy_defaults_to_on_demand_and_takes_only_its_two_values(
    client: TestClient, pool: dict[str, Any], make_adapter: Callable[..., Path]
) -> None:
    bad = register(client, make_adapter(), load_policy="Never")
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "body.load_policy"
    created = register(client, make_adapter())
    assert created.status_code == 201 and created.json()["adapter"]["load_policy"] == "OnDemand"
    patched = client.patch(
        "/v1/adapters/default/sql", json={"load_policy": "Explicit"}, headers=ADMIN
    )
    assert patched.status_code == 200, patched.text
    assert client.get("/v1/adapters/default/sql", headers=ADMIN).json()["load_policy"] == "Explicit"
