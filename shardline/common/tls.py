"""TLS for the public APIs (gRPC and HTTP) and mutual TLS between router and shards, from PEM
files.

Server credentials are dynamic: at each handshake the files are checked, and re-read when a
file's modification time or size changed, so certificates rotate without a restart (a file
caught half-written keeps the previous configuration until it parses).
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _stamp(paths: list[str]) -> list[tuple[int, int]]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size))
    return out


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """TLS with the key pair in `cert_file`/`key_file`; with `client_ca_file`, only clients
    presenting a certificate that CA signed get through."""
    paths = [p for p in (cert_file, key_file, client_ca_file) if p]

    def load() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(key_file), _read(cert_file))], root_certificates=_read(client_ca_file) if client_ca_file else None
        )

    state = {"stamp": _stamp(paths)}

    def fetch():  # None: keep the configuration in use
        try:
            stamp = _stamp(paths)
            if stamp == state["stamp"]:
                return None
            config = load()
        except (OSError, ValueError) as e:
            log.warning("TLS files changed but could not be read (%s); keeping the previous ones", e)
            return None
        state["stamp"] = stamp
        log.info("TLS certificates reloaded from %s", cert_file)
        return config

    return grpc.dynamic_ssl_server_credentials(load(), fetch, require_client_authentication=bool(client_ca_file))


def http_ssl_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """The HTTP API's TLS: the same files and rotation as `server_credentials` (the handshake's
    SNI callback swaps in a context made from the changed files)."""
    paths = [p for p in (cert_file, key_file, client_ca_file) if p]

    def load() -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_file, key_file)
        if client_ca_file:
            context.load_verify_locations(client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        context.sni_callback = rotate
        return context

    state = {"stamp": _stamp(paths), "context": None}

    def rotate(connection, _server_name, _context):
        try:
            stamp = _stamp(paths)
            if stamp != state["stamp"]:
                state["context"], state["stamp"] = load(), stamp
                log.info("TLS certificates reloaded from %s", cert_file)
        except (OSError, ValueError, ssl.SSLError) as e:
            log.warning("TLS files changed but could not be read (%s); keeping the previous ones", e)
        if state["context"] is not None:
            connection.context = state["context"]

    return load()


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """A client that trusts `ca_file` and, for mutual TLS, presents `cert_file`/`key_file`."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file) if key_file else None,
        certificate_chain=_read(cert_file) if cert_file else None,
    )


def client_credentials(args) -> grpc.ChannelCredentials | None:
    """A command-line client's credentials (`--tls-ca-file`, optional `--tls-cert-file` and
    `--tls-key-file`), or None for plaintext."""
    return channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file) if args.tls_ca_file else None


@dataclass(frozen=True)
class ShardTls:
    """The router <-> shard mutual TLS files (`--shard-tls-*`); every field set, or none."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_args(cls, args) -> ShardTls | None:
        files = cls(args.shard_tls_ca_file, args.shard_tls_cert_file, args.shard_tls_key_file)
        given = [bool(f) for f in (files.ca_file, files.cert_file, files.key_file)]
        if not any(given):
            return None
        if not all(given):
            raise SystemExit("--shard-tls-ca-file, --shard-tls-cert-file and --shard-tls-key-file go together")
        return files

    def server(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert_file, self.key_file, self.ca_file)

    def channel(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)


def listen(server: grpc.aio.Server, address: str, args) -> None:
    """Adds the public API's port to `server`: TLS from --tls-cert-file/--tls-key-file (and
    client certificates from --tls-client-ca-file), plaintext without them. Exits with a
    message on inconsistent flags or a port it cannot bind."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file) or (args.tls_client_ca_file and not args.tls_cert_file):
        raise SystemExit("--tls-cert-file and --tls-key-file go together (and --tls-client-ca-file needs them)")
    port = (
        server.add_secure_port(
            address, server_credentials(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
        )
        if args.tls_cert_file
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise SystemExit(f"cannot listen on {address}")
