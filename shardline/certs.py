"""`shardline certs`: a local CA and the certificates for mutual TLS between a router and its
shards, for deployments without a PKI of their own (the compose stack runs it once into a volume).

Writes into --out: ca.crt, ca.key (kept to issue more later), router.crt/.key, shard.crt/.key;
the shard certificate names every host in --names plus localhost and 127.0.0.1. Files that
exist are kept: a second run changes nothing. Keys are written owner-only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = datetime.timedelta(days=825)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    path.write_bytes(data)
    if secret:
        os.chmod(path, 0o600)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _issue(ca_key, ca_cert, cn: str, hosts: list[str], usage) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [_alt_name(h) for h in hosts]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_certs(out: Path, names: list[str]) -> list[str]:
    """Writes what is missing in `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    ca_crt, ca_key_path = out / "ca.crt", out / "ca.key"
    if ca_crt.exists() and ca_key_path.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("shardline local CA"))
            .issuer_name(_name("shardline local CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        _write(ca_key_path, _key_pem(ca_key), secret=True)
        _write(ca_crt, ca_cert.public_bytes(serialization.Encoding.PEM))
        written += [str(ca_crt), str(ca_key_path)]
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    # The router's certificate serves both its client side to the shards and its public API (to
    # clients and gateways, which reach it by one of `names`); a gateway serves its API with it too.
    for role, hosts in (
        ("router", ["router", "shardline-router", "gateway", "shardline-gateway", *names, "localhost", "127.0.0.1"]),
        ("shard", [*names, "localhost", "127.0.0.1"]),
    ):
        crt, key = out / f"{role}.crt", out / f"{role}.key"
        if crt.exists() and key.exists():
            continue
        cert_pem, key_pem = _issue(ca_key, ca_cert, f"shardline {role}", hosts, both)
        _write(key, key_pem, secret=True)
        _write(crt, cert_pem)
        written += [str(crt), str(key)]
    return written
