"""Chained block hashes of a token sequence: the one definition of a "prefix block" in kvgate.

Block i covers tokens [i*block_size, (i+1)*block_size); only full blocks are hashed (as vLLM).
hash_i = xxh3_64(parent_hash (8 bytes LE) || extra || token IDs as uint32 LE), with
parent_hash of block 0 = ROOT_HASH and `extra` = the cache_salt, on block 0 only (tenant
isolation: two salts never share a block). The gateway's prefix table and the built-in
replica's prefix cache both call this, so their keys agree by construction.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16
ROOT_HASH = 0x6B76_6761_7465_0001  # fixed seed for block 0's parent ("kvgate" + version)
_xxh = xxhash.xxh3_64_intdigest


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash. 64-bit, non-cryptographic."""
    return _xxh(parent_hash.to_bytes(8, "little") + extra + array("I", token_ids).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 cache_salt: str | None = None, parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`.

    Fast path: the IDs are packed to bytes once and each block hashes a slice, so an
    8k-token prompt (500 blocks) costs ~500 short xxh3 calls and no per-token Python work."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    packed = array("I", token_ids).tobytes()
    block_bytes = 4 * block_size
    hashes: list[int] = []
    parent = parent_hash
    salt = cache_salt.encode() if cache_salt else b""
    for start in range(0, len(packed) - block_bytes + 1, block_bytes):
        extra = salt if start == 0 else b""
        parent = _xxh(parent.to_bytes(8, "little") + extra + packed[start:start + block_bytes])
        hashes.append(parent)
    return hashes
