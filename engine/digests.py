"""Chained block digests, shared by the engine's prefix cache and the router's index.

``d_i = xxh64(d_{i-1} as 8 little-endian bytes + block token ids as int32 little-endian, seed 0)``;
the first block hashes its token bytes alone, or chains on its tenant's ``namespace`` (a
``cache_salt``, a LoRA adapter) when it has one. Only full blocks have digests. This module imports
neither torch nor Django so the router can use it cheaply.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

_U64 = struct.Struct("<Q")

# How /server_info names this scheme (``prefix_digest``): a router uses an engine's KV events only
# when the engine's digests are the ones it computes itself.
SCHEME = "xxh64-chained/parent-u64le+tokens-i32le/seed0"


def namespace(cache_salt: str | None = None, adapter: str | None = None) -> int | None:
    """The parent of a prompt's first block for one tenant: None without a salt or an adapter
    (the plain chain), else the xxh64 of typed, length-prefixed fields (``b"salt"`` /
    ``b"adapter"``, the UTF-8 length as 4 little-endian bytes, the text), so a salt and an
    adapter name of the same text never give the same chain (vllm#44701), nor do two fields that
    concatenate alike. Every later block chains on from it, as on any parent: one tenant's blocks
    are never another's hits. The router computes the same for each request it routes."""
    if not cache_salt and not adapter:
        return None
    data = b""
    for kind, value in ((b"adapter", adapter), (b"salt", cache_salt)):
        if value:
            raw = value.encode("utf-8", "surrogatepass")
            data += kind + len(raw).to_bytes(4, "little") + raw
    return xxhash.xxh64_intdigest(data, seed=0)


def block_digest(parent: int | None, token_ids: Sequence[int]) -> int:
    """Digest of one full block given its parent's digest (None for the first block)."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    if parent is not None:
        data = _U64.pack(parent) + data
    return xxhash.xxh64_intdigest(data, seed=0)


def chain_digests(
    token_ids: Sequence[int], block_size: int, parent: int | None = None
) -> list[int]:
    """Digests of every full block of ``token_ids`` (a trailing partial block has none): the same
    as ``block_digest`` block by block, with the ids made bytes once (the router digests every
    request's whole prompt, ~1,000 blocks for a 15 k-token one, on its event loop)."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    width = 4 * block_size
    digest, pack = xxhash.xxh64_intdigest, _U64.pack
    digests = []
    for start in range(0, len(token_ids) // block_size * width, width):
        block = data[start : start + width]
        parent = digest(block if parent is None else pack(parent) + block, seed=0)
        digests.append(parent)
    return digests
