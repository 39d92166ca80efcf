"""Block hashing (DESIGN contract 1): what routing and the replica's prefix cache agree on."""
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
