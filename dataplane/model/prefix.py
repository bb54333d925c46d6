"""Content keys of KV blocks: the identity under which a page is reused across requests.

    key_0 = sha256(sha256(model_digest) || tokens of block 0)
    key_i = sha256(key_{i-1} || tokens of block i)

(vLLM's block hash, chained). A key names the whole prefix up to the end of its block, so two
sequences share block i only if they agree on every token before it. Only full blocks get keys:
a partial page is still being written. Tokens are hashed as little-endian int32.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def root_key(model_digest: str) -> bytes:
    return hashlib.sha256(b"residency-kv-root|" + model_digest.encode()).digest()


def chain_key(parent: bytes, block_tokens: Sequence[int]) -> bytes:
    """The key of one full block given its parent's key (raw 32 bytes)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(block_tokens)}i", *block_tokens)).digest()


def block_content_keys(token_ids: Sequence[int], page_tokens: int, model_digest: str) -> list[str]:
    """Hex keys of every full block of ``token_ids`` (len(token_ids) // page_tokens of them)."""
    keys = []
    k = root_key(model_digest)
    for i in range(len(token_ids) // page_tokens):
        k = chain_key(k, token_ids[i * page_tokens:(i + 1) * page_tokens])
        keys.append(k.hex())
    return keys


class KeyChain:
    """Keys of a growing sequence, extended one full block at a time (no rehash of the prefix)."""

    def __init__(self, model_digest: str, page_tokens: int):
        self.page_tokens = page_tokens
        self.keys: list[str] = []
        self._last = root_key(model_digest)

    def extend(self, token_ids: Sequence[int]) -> list[str]:
        """Add keys for blocks completed by ``token_ids`` (the full sequence so far); returns the new ones."""
        new = []
        while (len(self.keys) + 1) * self.page_tokens <= len(token_ids):
            i = len(self.keys)
            self._last = chain_key(self._last, token_ids[i * self.page_tokens:(i + 1) * self.page_tokens])
            self.keys.append(self._last.hex())
            new.append(self.keys[-1])
        return new
