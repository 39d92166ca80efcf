"""Chained block hashes of a token sequence: the one definition of a "prefix block" in kvgate.

Block i covers tokens [i*block_size, (i+1)*block_size); only full blocks are hashed (as vLLM).
hash_i = xxh3_64(parent_hash (8 bytes LE) || extra || token IDs as uint32 LE), with
parent_hash of block 0 = ROOT_HASH and `extra` = the cache_salt, on block 0 only (tenant
isolation: two salts never share a block). The gateway's prefix table and the built-in
replica's prefix cache both call this, so their keys agree by construction.

The loop runs in C (routing/_block_hash.c, ~20 ns a block) where the install built it, else in
Python (~2 us a block); tests/test_hashing.py checks both give the same hashes.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

try:
    from routing._block_hash import chain as _native_chain
except ImportError:  # built without a C compiler: the Python loop below
    _native_chain = None
NATIVE = True  # False: the Python loop even where the C one was built (tests compare the two)

DEFAULT_BLOCK_SIZE = 16
ROOT_HASH = 0x6B76_6761_7465_0001  # fixed seed for block 0's parent ("kvgate" + version)
_xxh = xxhash.xxh3_64_intdigest


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash. 64-bit, non-cryptographic."""
    return _xxh(parent_hash.to_bytes(8, "little") + extra + array("I", token_ids).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 cache_salt: str | None = None, parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`.

    One C call (a list of IDs is packed there, block by block; an array('I') or a uint32 numpy
    array is read as is), or without the extension the IDs packed to bytes once (a list costs
    ~13 ns a token to convert) and python_chain's loop."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    salt = cache_salt.encode() if cache_salt else b""
    if _native_chain is not None and NATIVE:
        return _native_chain(token_ids if type(token_ids) is list else _packed(token_ids), 4 * block_size,
                             parent_hash, salt)
    return python_chain(_packed(token_ids), 4 * block_size, parent_hash, salt)


def python_chain(packed: bytes, block_bytes: int, parent_hash: int, salt: bytes) -> list[int]:
    """The reference loop (routing/_block_hash.c's chain does the same): prebound names, one
    8+64-byte concatenation and one xxh3 call a block, the salt handled outside the loop."""
    end = len(packed) - len(packed) % block_bytes
    if end == 0:
        return []
    xxh = _xxh
    parent = xxh(parent_hash.to_bytes(8, "little") + salt + packed[:block_bytes])
    hashes = [parent]
    append = hashes.append
    for start in range(block_bytes, end, block_bytes):
        parent = xxh(parent.to_bytes(8, "little") + packed[start:start + block_bytes])
        append(parent)
    return hashes


def _packed(token_ids) -> bytes:
    """Token IDs as native uint32 bytes (what array('I') gives; little-endian on every platform we run)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    dtype = getattr(token_ids, "dtype", None)  # numpy without importing it: this module is stdlib + xxhash
    if dtype is not None and dtype.char == "I" and dtype.isnative:
        return token_ids.tobytes()
    return array("I", token_ids).tobytes()
