"""Prefix hashes of the paged KV cache: the one definition by which a router indexes its pages
and a gateway predicts which replica holds a prompt's prefix.

Page i of a prompt hashes SHA-256 (truncated to 128 bits) over page i-1's hash and page i's
token ids (uint32, native byte order: x86 and ARM are little-endian), rooted in the model key
and the request's cache namespace (common/auth.py's `cache_namespace`: the salt, and the tenant
unless tenants share the cache). A cryptographic hash makes a collision, which would hand one
request another's KV, practically impossible without storing and comparing every page's tokens.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16  # 128 bits of SHA-256: a collision stays out of reach (birthday bound 2^64)


def root_hash(model_key: str, namespace: str = "") -> bytes:
    return hashlib.sha256(model_key.encode() + b"\0" + namespace.encode()).digest()[:HASH_BYTES]


def chain(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("I", tokens).tobytes()).digest()[:HASH_BYTES]


def prompt_hashes(prompt: list[int], page_size: int, model_key: str, namespace: str = "") -> list[bytes]:
    """Hashes of the prompt pages a cache hit may cover: full pages, leaving at least the last
    token to compute so that its logits exist."""
    hashes, h = [], root_hash(model_key, namespace)
    for i in range((len(prompt) - 1) // page_size):
        h = chain(h, prompt[i * page_size : (i + 1) * page_size])
        hashes.append(h)
    return hashes
