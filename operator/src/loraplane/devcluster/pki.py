"""Certificates and keys for a loopback-only cluster: one CA, serving and client certs,
and the service-account token signing key. ECDSA P-256 keys, so generating them all
takes milliseconds; nothing here leaves the state directory."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def write_pki(pki: Path) -> None:
    """Write ca, apiserver (serving), admin/controller-manager/scheduler (client) certs and
    the service-account key pair sa.key/sa.pub into `pki`."""
    pki.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)

    ca_key = _key()
    ca_name = _name("loraplane-devcluster-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki / "ca.key", ca_key)
    _write_cert(pki / "ca.crt", ca)

    def issue(stem: str, subject: x509.Name, *, server: bool) -> None:
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH]
                    if server
                    else [ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.DNSName("kubernetes.default.svc.cluster.local"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
                    ]
                ),
                critical=False,
            )
        _write_key(pki / f"{stem}.key", key)
        _write_cert(pki / f"{stem}.crt", builder.sign(ca_key, hashes.SHA256()))

    issue("apiserver", _name("kube-apiserver"), server=True)
    # Bootstrap RBAC grants these identities what each component needs.
    issue("admin", _name("kubernetes-admin", "system:masters"), server=False)
    issue("controller-manager", _name("system:kube-controller-manager"), server=False)
    issue("scheduler", _name("system:kube-scheduler"), server=False)

    sa_key = _key()
    _write_key(pki / "sa.key", sa_key)
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def kubeconfig(server: str, pki: Path, user: str) -> str:
    """A self-contained kubeconfig (YAML text) for `user` (admin, controller-manager,
    scheduler), with the CA and the client certificate embedded."""

    def data(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    return f"""apiVersion: v1
kind: Config
clusters:
- name: loraplane-dev
  cluster:
    server: {server}
    certificate-authority-data: {data("ca.crt")}
users:
- name: {user}
  user:
    client-certificate-data: {data(f"{user}.crt")}
    client-key-data: {data(f"{user}.key")}
contexts:
- name: loraplane-dev
  context:
    cluster: loraplane-dev
    user: {user}
current-context: loraplane-dev
"""
