"""Block hashing (DESIGN contract 1): what routing and the replica's prefix cache agree on."""
import random
import shutil
from array import array

import numpy as np
import pytest

from routing import hashing
from routing.hashing import ROOT_HASH, block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(47)), block_size=16)) == 2
    assert len(block_hashes(list(range(48)), block_size=16)) == 3
    assert block_hashes(list(range(15)), block_size=16) == []


def test_shared_prefix_gives_shared_hashes_then_diverges():
    a = list(range(64))
    b = list(range(40)) + [999] * 24
    ha, hb = block_hashes(a), block_hashes(b)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]


def test_hash_is_chained_on_the_parent():
    tokens = list(range(32))
    first, second = block_hashes(tokens)
    assert first == hash_block(ROOT_HASH, tokens[:16])
    assert second == hash_block(first, tokens[16:])
    # The same block content after a different prefix is a different block.
    assert block_hashes([7] * 16 + tokens[16:])[1] != second


def test_cache_salt_isolates_tenants_from_the_first_block():
    tokens = list(range(64))
    plain, salted, other = block_hashes(tokens), block_hashes(tokens, cache_salt="a"), block_hashes(tokens, cache_salt="b")
    assert all(x != y for x, y in zip(plain, salted))
    assert all(x != y for x, y in zip(salted, other))
    assert block_hashes(tokens, cache_salt="a") == salted


def test_hash_values_are_pinned():
    # Fixed values pin the definition: replicas and gateways of different builds must agree,
    # so changing the function is a deliberate, visible break.
    assert block_hashes(list(range(32))) == [11176632531207230278, 13221258471904948277]


def test_the_c_loop_is_built_where_a_compiler_is():
    """`pip install` compiles routing/_block_hash.c when it can (optional: the Python loop serves without)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert hashing._native_chain is not None


@pytest.mark.skipif(hashing._native_chain is None, reason="routing/_block_hash.c not built")
def test_c_loop_gives_the_reference_hashes(monkeypatch):
    rng = random.Random(7)
    cases = [(list(range(15)), 16, None, ROOT_HASH), ([], 16, "a", ROOT_HASH), ([5] * 16, 16, "ß-tenant", ROOT_HASH),
             (list(range(33)), 1, None, 0), (list(range(64)), 16, None, 2**64 - 1)]
    for _ in range(200):
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 400))]
        cases.append((tokens, rng.choice([1, 3, 16, 32, 256]), rng.choice([None, "", "s", "tenant-42" * 9]),
                      rng.randrange(2**64)))
    for tokens, block_size, salt, parent in cases:
        for form in (tokens, array("I", tokens), np.array(tokens, dtype=np.uint32)):
            native = block_hashes(form, block_size, salt, parent)
            monkeypatch.setattr(hashing, "NATIVE", False)
            reference = block_hashes(form, block_size, salt, parent)
            monkeypatch.setattr(hashing, "NATIVE", True)
            assert native == reference, (len(tokens), block_size, salt, parent)
    for bad in (-1, 2**64):  # a parent past 64 bits is refused the same way by both
        with pytest.raises(OverflowError):
            block_hashes(list(range(16)), 16, None, bad)
        monkeypatch.setattr(hashing, "NATIVE", False)
        with pytest.raises(OverflowError):
            block_hashes(list(range(16)), 16, None, bad)
        monkeypatch.setattr(hashing, "NATIVE", True)
    for tokens in ([-1] * 16, [2**32] * 16, list(range(16)) + [2**32], list(range(16)) + ["x"], [1.5] * 16):
        errors = []
        for native in (True, False):  # an ID array('I') cannot hold is refused by both, in a full block or the tail
            monkeypatch.setattr(hashing, "NATIVE", native)
            with pytest.raises((OverflowError, TypeError)) as info:
                block_hashes(tokens, 16)
            errors.append(info.type)
        assert errors[0] is errors[1], tokens
