"""The scheduler as pure logic over a BlockPool: no torch, no model; 'running a step' means
calling update() with a made-up sampled token for each sampling chunk."""
import pytest

from replica.block_pool import BlockPool
from replica.scheduler import RequestTooLarge, Scheduler, Sequence
from routing.hashing import block_hashes

BS = 4


def run_step(scheduler: Scheduler, token: int = 7):
    chunks = scheduler.schedule()
    scheduler.update(chunks, {id(c.sequence): token for c in chunks if c.samples})
    return chunks


def finish_done(scheduler: Scheduler) -> list[Sequence]:
    done = [s for s in scheduler.running if len(s.output_token_ids) >= s.max_tokens]
    for sequence in done:
        scheduler.finish(sequence)
    return done


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    scheduler = Scheduler(BlockPool(256, BS), max_num_batched_tokens=16)
    short = Sequence("short", list(range(5)), max_tokens=50)
    scheduler.add(short)
    run_step(scheduler)                      # short's prefill
    long = Sequence("long", list(range(100, 200)), max_tokens=2)
    scheduler.add(long)
    steps = 0
    while long.num_computed_tokens < 100:
        chunks = run_step(scheduler)
        steps += 1
        assert chunks[0].sequence is short and chunks[0].num_tokens == 1   # decode first, every step
        assert sum(c.num_tokens for c in chunks) <= 16
    assert steps == -(-100 // 15)
    assert long.output_token_ids == [7]   # sampled only when its last prompt chunk ran


def test_prefix_hit_reuses_full_blocks_but_never_the_last_tokens_block():
    pool = BlockPool(64, BS)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks + 1
    first = Sequence("a", prompt, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    finish_done(scheduler)
    assert pool.usage == 0 and len(pool.cached_hashes()) == 4   # freed blocks stay cached
    again = Sequence("b", prompt, max_tokens=1)
    scheduler.add(again)
    chunks = run_step(scheduler)
    assert again.num_cached_tokens == 16 and chunks[0].start == 16 and chunks[0].num_tokens == 1
    # exactly 16 tokens: the 4th block holds the last token, so only 3 blocks are reused
    exact = Sequence("c", prompt[:16], max_tokens=1)
    scheduler.add(exact)
    run_step(scheduler)
    assert exact.num_cached_tokens == 12
    assert scheduler.stats.prefix_cache_queries == 17 + 17 + 16
    assert scheduler.stats.prefix_cache_hits == 16 + 12


def test_cache_salt_isolates_prefixes_and_hashes_match_routing():
    pool = BlockPool(64, BS)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    prompt = list(range(1, 14))
    scheduler.add(Sequence("a", prompt, max_tokens=1, cache_salt="tenant-a"))
    run_step(scheduler)
    finish_done(scheduler)
    assert pool.cached_hashes() == set(block_hashes(prompt, BS, "tenant-a"))
    other = Sequence("b", prompt, max_tokens=1, cache_salt="tenant-b")
    scheduler.add(other)
    run_step(scheduler)
    assert other.num_cached_tokens == 0


def test_generated_tokens_fill_and_commit_blocks():
    pool = BlockPool(64, BS)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    sequence = Sequence("a", [1, 2, 3], max_tokens=6)
    scheduler.add(sequence)
    for _ in range(6):
        run_step(scheduler, token=9)
    # 3 prompt + 6 generated; the KV of the first 8 is computed (the last sampled token's is not)
    assert pool.cached_hashes() == set(block_hashes([1, 2, 3] + [9] * 5, BS))


def test_pool_too_small_preempts_the_newest_and_every_request_finishes():
    pool = BlockPool(6, BS)   # 24 token slots for four sequences of up to 12 tokens
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    sequences = [Sequence(f"s{i}", [i + 1] * 4, max_tokens=8) for i in range(4)]
    for sequence in sequences:
        scheduler.add(sequence)
    finished, preempted_order = [], []
    for _ in range(200):
        before = scheduler.stats.num_preemptions
        running_before = list(scheduler.running)
        run_step(scheduler)
        if scheduler.stats.num_preemptions > before:
            victims = [s for s in running_before if s not in scheduler.running]
            preempted_order.extend(victims)
            # the newest running sequences go, back to the front of the waiting queue
            assert victims == running_before[len(running_before) - len(victims):]
            assert scheduler.waiting[0] is victims[-1]
        finished += finish_done(scheduler)
        assert pool.num_free + sum(len(s.block_ids) for s in scheduler.running) == pool.num_blocks  # no leak
        if not scheduler.has_work():
            break
    assert scheduler.stats.num_preemptions > 0
    assert sorted(s.request_id for s in finished) == ["s0", "s1", "s2", "s3"]
    assert all(s.output_token_ids == [7] * 8 for s in finished)
    assert pool.usage == 0


def test_finish_frees_blocks_at_once_for_running_and_waiting():
    pool = BlockPool(16, BS)
    scheduler = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=1)
    running = Sequence("r", list(range(10)), max_tokens=4)
    waiting = Sequence("w", list(range(10)), max_tokens=4)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    assert pool.usage > 0 and list(scheduler.waiting) == [waiting]
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert pool.usage == 0 and not scheduler.has_work()


def test_request_larger_than_the_pool_is_refused():
    scheduler = Scheduler(BlockPool(4, BS))
    with pytest.raises(RequestTooLarge):
        scheduler.add(Sequence("big", list(range(10)), max_tokens=10))
