"""API keys and tenants.

`--api-keys-file` holds one key per line, optionally followed by a tenant name (`KEY tenant`);
blank lines and lines starting with `#` are skipped. A key without a tenant name is a tenant of
its own. Calls present `authorization: Bearer KEY` (HTTP calls may send `x-api-key: KEY`).

A presented key is compared, in constant time, with every known key (SHA-256 digests, so
comparisons have one length), and every comparison runs whatever matched before: how long a
check takes says nothing about which keys exist or how close a guess came. A missing and a wrong
key get the same answer.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

NO_TENANT = ""  # every request's tenant when no keys are configured


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, entries: list[tuple[str, str]]):
        if not entries:
            raise ValueError("the API keys file holds no key")
        self._keys = [(_digest(key), tenant) for key, tenant in entries]

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        entries = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, tenant = line.partition(" ")
            tenant = tenant.strip() or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
            if len(key) < 16:
                raise ValueError(f"{path}:{n}: an API key needs at least 16 characters")
            entries.append((key, tenant))
        return cls(entries)

    def tenant(self, metadata) -> str | None:
        """The tenant of the call's `authorization: Bearer KEY` (or, as Anthropic's clients send
        it, `x-api-key: KEY`), or None."""
        headers = {k: v for k, v in metadata or () if isinstance(v, str)}
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()
        digest = _digest(key)
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(digest, known) and found is None:
                found = tenant
        return found


def cache_namespace(tenant: str | None, salt: str) -> str:
    """What a request's cached pages are keyed under: its salt alone when tenants share the cache
    (or there are none), else the tenant and the salt, encoded so that no two pairs meet."""
    if not tenant:
        return salt
    return f"{len(tenant)}:{tenant}:{salt}"


async def caller_tenant(keys: ApiKeys | None, context) -> str:
    """The gRPC caller's tenant (NO_TENANT when the service takes no keys); aborts the call
    UNAUTHENTICATED without a valid key, with one message for a missing and a wrong key."""
    if keys is None:
        return NO_TENANT
    tenant = keys.tenant(context.invocation_metadata())
    if tenant is None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: send 'authorization: Bearer <key>'"
        )
    return tenant
