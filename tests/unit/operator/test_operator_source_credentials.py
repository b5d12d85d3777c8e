"""`spec.source.credentialsSecretRef`: the Secret in the adapter's namespace is read, its keys
mapped to the control plane's `source.credentials` and sent with register and new-version; a
missing or useless Secret leaves the adapter Pending (retried on every pass), naming the field
and the namespace."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from kubernetes import client
from tests.unit.operator.adapter_pass import reconcile_adapter_once

from loraplane.operator import builders, handlers
from loraplane.operator.cpclient import ControlPlaneError
from loraplane.operator.kube import Kube, SecretNotReadable, decode_secret_data

pytestmark = pytest.mark.unit

UID = "5ec2"
S3_SPEC: dict[str, Any] = {
    "pool": "p",
    "source": {"uri": "s3://models/team/sql", "credentialsSecretRef": {"name": "s3-keys"}},
}
AWS = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalr-secret",
    "AWS_SESSION_TOKEN": "session-tok",
}


class SecretsKube:
    """The Kubernetes calls the adapter handler makes; Secrets by (namespace, name), already
    decoded as `Kube.get_secret_data` returns them. `forbidden` answers like a 403."""

    def __init__(self, secrets: dict[tuple[str, str], dict[str, str]] | None = None) -> None:
        self.secrets = secrets or {}
        self.forbidden = False
        self.reads: list[tuple[str, str]] = []

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"spec": {"maxLorasPerBatch": 4}} if name == "p" else None

    def list_adapters(self, namespace: str) -> list[dict[str, Any]]:
        return []

    def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        self.reads.append((namespace, name))
        if self.forbidden:
            raise SecretNotReadable(f"the operator may not get Secret {namespace}/{name}")
        found = self.secrets.get((namespace, name))
        return dict(found) if found is not None else None


class RecordingControlPlane:
    """Register and new-version as the control plane answers them; every body kept."""

    def __init__(self) -> None:
        self.adapter: dict[str, Any] | None = None
        self.registered: list[dict[str, Any]] = []
        self.versions: list[dict[str, Any]] = []

    def list_workers(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [{"name": "w0", "state": "ready"}]

    def get_adapter(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.adapter)

    def register_adapter(self, body: dict[str, Any], key: str) -> Any:
        self.registered.append(copy.deepcopy(body))
        self._set(body["source"], body["placement"])
        return {"operation": {"state": "succeeded"}, "adapter": copy.deepcopy(self.adapter)}

    def new_version(self, namespace: str, name: str, source: dict[str, Any], key: str) -> Any:
        self.versions.append(copy.deepcopy(source))
        assert self.adapter is not None
        self._set(source, self.adapter["placement"])
        return {"operation": {"state": "succeeded"}, "adapter": copy.deepcopy(self.adapter)}

    def _set(self, source: dict[str, Any], placement: Any) -> None:
        # What the control plane reports: the source without its credentials.
        self.adapter = {
            "source": {"uri": source["uri"], "sha256": source.get("sha256")},
            "pinned": False,
            "priority": 0,
            "placement": placement,
            "phase": "Ready",
            "routable": True,
            "loaded_workers": ["w0"],
            "placements": [{"worker": "w0", "dp_group": 0, "state": "loaded"}],
        }


@pytest.fixture(autouse=True)
def no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers.kopf, "event", lambda *args, **kwargs: None)


def reconcile(
    kube: SecretsKube,
    cp: RecordingControlPlane,
    spec: dict[str, Any],
    status: dict[str, Any],
    generation: int = 1,
) -> dict[str, Any]:
    """One handler pass over LoRAAdapter ml/a; returns the status it writes."""
    return reconcile_adapter_once(kube, cp, spec, status, uid=UID, generation=generation)


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == type_)
    return found


def test_the_secret_is_read_in_the_adapter_namespace_and_sent_with_register() -> None:
    kube = SecretsKube({("ml", "s3-keys"): {**AWS, "TOKEN": "unused-for-s3"}})
    cp = RecordingControlPlane()
    status = reconcile(kube, cp, S3_SPEC, {})
    assert kube.reads == [("ml", "s3-keys")]
    assert cp.registered[0]["source"] == {
        "uri": "s3://models/team/sql",
        "credentials": {
            "aws_access_key_id": "AKIAEXAMPLE",
            "aws_secret_access_key": "wJalr-secret",
            "aws_session_token": "session-tok",
        },
    }
    assert status["phase"] == "Ready"
    # Nothing of the Secret reaches the LoRAAdapter's status.
    assert not any(value in repr(status) for value in AWS.values())
    # In sync: no fetch, so the Secret is not read again.
    reconcile(kube, cp, S3_SPEC, status)
    assert kube.reads == [("ml", "s3-keys")] and len(cp.registered) == 1


def test_a_new_source_version_is_sent_with_the_secret() -> None:
    spec = {
        "pool": "p",
        "source": {"uri": "https://models.example/sql/v1", "credentialsSecretRef": {"name": "t"}},
    }
    kube = SecretsKube({("ml", "t"): {"TOKEN": "bearer-1"}})
    cp = RecordingControlPlane()
    status = reconcile(kube, cp, spec, {})
    assert cp.registered[0]["source"]["credentials"] == {"token": "bearer-1"}
    kube.secrets[("ml", "t")] = {"TOKEN": "bearer-2"}  # rotated since
    newer = copy.deepcopy(spec)
    newer["source"]["uri"] = "https://models.example/sql/v2"
    status = reconcile(kube, cp, newer, status, generation=2)
    assert cp.versions == [
        {"uri": "https://models.example/sql/v2", "credentials": {"token": "bearer-2"}}
    ]
    assert status["phase"] == "Ready"


def test_a_missing_secret_leaves_the_adapter_pending_until_it_exists() -> None:
    kube = SecretsKube()
    cp = RecordingControlPlane()
    status = reconcile(kube, cp, S3_SPEC, {})
    assert cp.registered == []
    assert status["phase"] == "Pending" and status["attempts"] == 0
    validated = condition(status, "Validated")
    assert validated["status"] == "False" and validated["reason"] == "CredentialsNotFound"
    message = validated["message"]
    assert message.startswith("spec.source.credentialsSecretRef.name: ")
    assert "'s3-keys'" in message and "namespace ml" in message
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
    # Still missing on the next pass: still Pending, nothing sent, no attempt counted.
    status = reconcile(kube, cp, S3_SPEC, status)
    assert status["phase"] == "Pending" and cp.registered == [] and status["attempts"] == 0
    # Created: the next pass registers with it.
    kube.secrets[("ml", "s3-keys")] = dict(AWS)
    status = reconcile(kube, cp, S3_SPEC, status)
    assert status["phase"] == "Ready" and len(cp.registered) == 1
    assert condition(status, "Validated")["status"] == "True"


def test_a_secret_in_another_namespace_is_not_used() -> None:
    kube = SecretsKube({("default", "s3-keys"): dict(AWS)})
    status = reconcile(kube, RecordingControlPlane(), S3_SPEC, {})
    assert kube.reads == [("ml", "s3-keys")]
    assert condition(status, "Validated")["reason"] == "CredentialsNotFound"


@pytest.mark.parametrize(
    ("uri", "data", "wanted"),
    [
        # Half a key pair, or only a key another scheme uses.
        (
            "s3://m/sql",
            {"AWS_ACCESS_KEY_ID": "AKIA"},
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
        ("s3://m/sql", {"TOKEN": "t"}, "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        ("https://h/sql", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}, "TOKEN"),
        ("hf://org/sql", {"TOKEN": ""}, "TOKEN"),
    ],
)
def test_a_secret_without_usable_keys_leaves_the_adapter_pending(
    uri: str, data: dict[str, str], wanted: str
) -> None:
    spec = {"pool": "p", "source": {"uri": uri, "credentialsSecretRef": {"name": "creds"}}}
    cp = RecordingControlPlane()
    status = reconcile(SecretsKube({("ml", "creds"): data}), cp, spec, {})
    assert cp.registered == [] and status["phase"] == "Pending"
    validated = condition(status, "Validated")
    assert validated["reason"] == "CredentialsNotFound"
    assert "spec.source.credentialsSecretRef.name" in validated["message"]
    assert "namespace ml" in validated["message"] and wanted in validated["message"]
    # Key names may be shown, values never.
    assert not any(v and v in validated["message"] for v in data.values() if len(v) > 1)


def test_a_secret_the_operator_may_not_read_is_pending_too() -> None:
    kube = SecretsKube({("ml", "s3-keys"): dict(AWS)})
    kube.forbidden = True
    status = reconcile(kube, RecordingControlPlane(), S3_SPEC, {})
    validated = condition(status, "Validated")
    assert status["phase"] == "Pending" and validated["reason"] == "CredentialsNotReadable"
    assert validated["message"].startswith("spec.source.credentialsSecretRef.name: ")


def test_a_local_source_with_a_secret_is_an_invalid_spec() -> None:
    spec = {"pool": "p", "source": {"uri": "file:///m/sql", "credentialsSecretRef": {"name": "x"}}}
    kube = SecretsKube()
    cp = RecordingControlPlane()
    status = reconcile(kube, cp, spec, {})
    assert status["phase"] == "Failed" and cp.registered == [] and kube.reads == []
    validated = condition(status, "Validated")
    assert validated["reason"] == "InvalidSpec"
    assert "spec.source.credentialsSecretRef" in validated["message"]


def test_a_source_without_a_secret_sends_no_credentials() -> None:
    kube = SecretsKube()
    cp = RecordingControlPlane()
    reconcile(kube, cp, {"pool": "p", "source": {"uri": "s3://m/sql"}}, {})
    assert cp.registered[0]["source"] == {"uri": "s3://m/sql"} and kube.reads == []


def test_control_plane_errors_about_credentials_name_the_secret_ref() -> None:
    assert handlers.spec_field("body.source.credentials.token: bad") == (
        "spec.source.credentialsSecretRef.token: bad"
    )
    assert handlers.spec_field("body.source.uri: x") == "spec.source.uri: x"
    cp = RecordingControlPlane()
    error = ControlPlaneError(
        422,
        "validation_error",
        "body.source.credentials.token: String should have at most 8192 characters",
        "body.source.credentials.token",
        None,
    )

    def reject(body: dict[str, Any], key: str) -> Any:
        raise error

    cp.register_adapter = reject  # type: ignore[method-assign]
    status = reconcile(SecretsKube({("ml", "s3-keys"): dict(AWS)}), cp, S3_SPEC, {})
    assert status["phase"] == "Failed"
    assert condition(status, "Validated")["message"].startswith(
        "spec.source.credentialsSecretRef.token: "
    )


# ------------------------------------------------------------------ pure pieces


def test_source_credentials_take_the_keys_of_the_scheme() -> None:
    data = {**AWS, "TOKEN": "t", "OTHER": "x"}
    assert builders.source_credentials("S3://b/p", data) == {
        "aws_access_key_id": "AKIAEXAMPLE",
        "aws_secret_access_key": "wJalr-secret",
        "aws_session_token": "session-tok",
    }
    assert builders.source_credentials("s3://b/p", {**AWS, "AWS_SESSION_TOKEN": ""}) == {
        "aws_access_key_id": "AKIAEXAMPLE",
        "aws_secret_access_key": "wJalr-secret",
    }
    for uri in ("http://h/p", "https://h/p", "hf://org/repo@v1"):
        assert builders.source_credentials(uri, data) == {"token": "t"}
    assert builders.source_credentials("https://h/p", AWS) == {}
    for uri in ("file:///m/a", "pvc://claim/a"):
        with pytest.raises(ValueError, match="take no credentials"):
            builders.source_credentials(uri, data)


def test_registration_body_carries_credentials_only_when_given() -> None:
    spec = {"pool": "p", "source": {"uri": "hf://o/r", "credentialsSecretRef": {"name": "s"}}}
    assert "credentials" not in builders.build_adapter_registration("ml", "a", spec)["source"]
    body = builders.build_adapter_registration("ml", "a", spec, {"token": "t"})
    assert body["source"] == {"uri": "hf://o/r", "credentials": {"token": "t"}}


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def test_secret_data_is_decoded_and_trailing_newlines_dropped() -> None:
    assert decode_secret_data(
        {"TOKEN": b64("tok\n"), "AWS_ACCESS_KEY_ID": b64("AKIA"), "BINARY": b64(b"\xff\xfe")}
    ) == {"TOKEN": "tok", "AWS_ACCESS_KEY_ID": "AKIA"}
    assert decode_secret_data(None) == {}
    assert decode_secret_data({"BROKEN": "not base64!"}) == {}


class FakeCoreV1:
    """`read_namespaced_secret` as the kubernetes client answers it."""

    def __init__(self, secrets: dict[tuple[str, str], client.V1Secret], status: int = 0) -> None:
        self.secrets, self.status = secrets, status

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        if self.status:
            raise client.ApiException(status=self.status, reason="Forbidden")
        if (namespace, name) not in self.secrets:
            raise client.ApiException(status=404, reason="Not Found")
        return self.secrets[(namespace, name)]


def test_kube_reads_a_secret_through_the_core_api() -> None:
    kube = Kube.__new__(Kube)  # no cluster: only the core API is used
    secret = client.V1Secret(data={"TOKEN": b64("tok")})
    kube.core = FakeCoreV1({("ml", "t"): secret})  # type: ignore[assignment]
    assert kube.get_secret_data("ml", "t") == {"TOKEN": "tok"}
    assert kube.get_secret_data("other", "t") is None
    kube.core = FakeCoreV1({}, status=403)  # type: ignore[assignment]
    with pytest.raises(SecretNotReadable, match="ml/t"):
        kube.get_secret_data("ml", "t")
    kube.core = FakeCoreV1({}, status=500)  # type: ignore[assignment]
    with pytest.raises(client.ApiException):
        kube.get_secret_data("ml", "t")
