"""The scheduler: which tokens of which sequences run in the next step. Pure logic over BlockPool.

Each step gets a token budget (`max_num_batched_tokens`). Running sequences go first, decodes
(one token) before prefill chunks, so a long prompt never holds decodes back for more than one
chunk; then waiting sequences are admitted while budget, blocks and `max_num_seqs` allow.
A sequence's work is always "the tokens it has but has not computed": prompt tokens while
prefilling, the last sampled token while decoding, prompt + generated tokens after preemption
(recompute), so one rule covers all three.

Prefix caching: a sequence entering from the waiting queue reuses every full cached block of
its tokens except the block holding the last token (at least one token is computed, for logits).
Blocks are committed to the cache as they fill; a finished sequence's blocks stay cached until
evicted. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are released and it returns to the front of the waiting queue.

Remote KV (the decode side of P/D): a sequence may enter with its prompt's blocks from
`RemoteKV.first_block` on already pulled from a prefill replica. At admission it takes all its
prompt blocks at once, counts the whole prompt but its last token as computed (that token is
recomputed to sample, as vLLM does) and names the fresh blocks the engine fills before the step's
forward. If the local prefix cache lost blocks the pull relied on, the pulled KV is stale and the
prompt is computed here. A preempted sequence always recomputes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from replica.block_pool import BlockPool
from routing.hashing import ROOT_HASH, block_hashes, hash_block


class RequestTooLarge(ValueError):
    """Prompt + max_tokens cannot fit the whole KV pool: it would never run."""


@dataclass
class RemoteKV:
    """Prompt blocks [first_block, end of prompt) pulled from elsewhere (the scheduler's view: the
    bytes stay with the engine). Admission sets `target_block_ids` (the local blocks to fill, in
    order) and `skip_blocks` (pulled blocks not needed: the cache held more than at pull time), or
    `stale`."""
    first_block: int
    target_block_ids: list[int] | None = None
    skip_blocks: int = 0
    stale: bool = False


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of committed (full) blocks
    num_cached_tokens: int | None = None   # prompt tokens reused at first admission
    num_preemptions: int = 0
    remote_kv: RemoteKV | None = None      # set by the engine; cleared once admission decided

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


@dataclass
class ScheduledChunk:
    sequence: Sequence
    start: int            # num_computed_tokens before this step
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.sequence.token_slice(self.start, self.start + self.num_tokens)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row yields the next token."""
        return self.start + self.num_tokens == self.sequence.num_tokens


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0   # prompt tokens looked up
    prefix_cache_hits: int = 0      # of which found cached


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_batched_tokens: int = 512, max_num_seqs: int = 64):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last one is the newest
        self.stats = SchedulerStats()

    # ---- requests in and out ----------------------------------------------------------------
    def add(self, sequence: Sequence) -> None:
        needed = -(-(len(sequence.prompt_token_ids) + sequence.max_tokens) // self.block_size)
        if needed > self.pool.num_blocks:
            raise RequestTooLarge(f"{len(sequence.prompt_token_ids)} prompt + {sequence.max_tokens} new tokens "
                                  f"need {needed} KV blocks; the cache holds {self.pool.num_blocks}")
        self.waiting.append(sequence)

    def finish(self, sequence: Sequence) -> None:
        """Remove a sequence (finished, aborted or failed) and free its blocks at once."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self._free(sequence)

    def detach(self, sequence: Sequence) -> list[int]:
        """Remove a finished sequence but keep its blocks allocated: the caller now owns their
        references (a prefill replica pins them for a pull) and releases them later."""
        self.running.remove(sequence)
        block_ids, sequence.block_ids = sequence.block_ids, []
        sequence.block_hashes = []
        return block_ids

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        # Decodes first, then running prefill chunks (partially prefilled or recomputing).
        for decode_pass in (True, False):
            for sequence in list(self.running):
                if budget == 0:
                    break
                if id(sequence) in scheduled or sequence not in self.running:
                    continue
                remaining = sequence.num_tokens - sequence.num_computed_tokens
                if (remaining == 1) != decode_pass:
                    continue
                count = min(remaining, budget)
                if not self._grow_or_preempt(sequence, sequence.num_computed_tokens + count, scheduled):
                    continue  # it preempted itself
                chunks.append(ScheduledChunk(sequence, sequence.num_computed_tokens, count))
                scheduled.add(id(sequence))
                budget -= count
        # Admit waiting sequences (no preemption on their behalf).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            if not self._admit(sequence, budget):
                break
            self.waiting.popleft()
            self.running.append(sequence)
            count = min(sequence.num_tokens - sequence.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(sequence, sequence.num_computed_tokens, count))
            budget -= count
        return chunks

    def update(self, chunks: list[ScheduledChunk], sampled: dict[int, int]) -> None:
        """After the forward: advance computed counts, commit newly full blocks, append sampled
        tokens (`sampled` maps id(sequence) -> token for chunks that sampled)."""
        for chunk in chunks:
            sequence = chunk.sequence
            sequence.num_computed_tokens = chunk.start + chunk.num_tokens
            self._commit_full_blocks(sequence)
            token = sampled.get(id(sequence))
            if token is not None:
                sequence.output_token_ids.append(token)

    # ---- internals --------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow_or_preempt(self, sequence: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Give `sequence` blocks for `num_tokens`, preempting the newest running sequences not
        already scheduled this step while the pool is short. False if `sequence` itself had to go."""
        needed = self._blocks_for(num_tokens) - len(sequence.block_ids)
        while needed > self.pool.num_free:
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
            self._preempt(victim)
            if victim is sequence:
                return False
        if needed > 0:
            sequence.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._free(sequence)
        sequence.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(sequence)

    def _free(self, sequence: Sequence) -> None:
        if sequence.block_ids:
            self.pool.release(sequence.block_ids)
        sequence.block_ids = []
        sequence.block_hashes = []
        sequence.num_computed_tokens = 0

    def _admit(self, sequence: Sequence, budget: int) -> bool:
        """Reuse cached blocks and allocate for the first chunk; False (nothing changed) if the
        pool cannot hold it now."""
        tokens = sequence.token_slice(0, sequence.num_tokens)
        reusable = (len(tokens) - 1) // self.block_size   # never the block holding the last token
        hashes = self._hash_chain(tokens[:reusable * self.block_size], sequence.cache_salt)
        hit_blocks = self.pool.longest_cached_prefix(hashes)
        remote = sequence.remote_kv
        if remote is not None and remote.target_block_ids is None and not remote.stale:
            if len(hit_blocks) >= remote.first_block and sequence.num_preemptions == 0:
                return self._admit_remote(sequence, tokens, hashes, hit_blocks, remote)
            remote.stale = True  # blocks the pull relied on were evicted meanwhile: compute here
        cached_tokens = len(hit_blocks) * self.block_size
        count = min(len(tokens) - cached_tokens, budget)
        new_blocks = self._blocks_for(cached_tokens + count) - len(hit_blocks)
        # hit blocks that sit in the free queue leave it when acquired
        reclaimed = sum(1 for b in hit_blocks if self.pool.ref_count(b) == 0)
        if new_blocks + reclaimed > self.pool.num_free:
            return False
        self.pool.acquire(hit_blocks)
        sequence.block_ids = hit_blocks + self.pool.allocate(new_blocks)
        sequence.block_hashes = hashes[:len(hit_blocks)]
        sequence.num_computed_tokens = cached_tokens
        if sequence.num_cached_tokens is None:  # first admission: what the client is told
            sequence.num_cached_tokens = cached_tokens
            self.stats.prefix_cache_queries += len(sequence.prompt_token_ids)
            self.stats.prefix_cache_hits += cached_tokens
        return True

    def _admit_remote(self, sequence: Sequence, tokens: list[int], hashes: list[int], hit_blocks: list[int],
                      remote: RemoteKV) -> bool:
        """Admit with every prompt block allocated and all but the last token computed."""
        new_blocks = self._blocks_for(len(tokens)) - len(hit_blocks)
        reclaimed = sum(1 for b in hit_blocks if self.pool.ref_count(b) == 0)
        if new_blocks + reclaimed > self.pool.num_free:
            return False
        self.pool.acquire(hit_blocks)
        fresh = self.pool.allocate(new_blocks)
        sequence.block_ids = hit_blocks + fresh
        sequence.block_hashes = hashes[:len(hit_blocks)]
        sequence.num_computed_tokens = len(tokens) - 1
        remote.target_block_ids = fresh
        remote.skip_blocks = len(hit_blocks) - remote.first_block
        # vLLM reports local + transferred tokens as cached; its prefix-cache stats count local hits.
        sequence.num_cached_tokens = len(tokens)
        self.stats.prefix_cache_queries += len(sequence.prompt_token_ids)
        self.stats.prefix_cache_hits += len(hit_blocks) * self.block_size
        # Committed now, filled by the engine before this step's forward (nothing reads them first).
        self._commit_full_blocks(sequence)
        return True

    def _hash_chain(self, tokens: list[int], cache_salt: str | None) -> list[int]:
        return block_hashes(tokens, self.block_size, cache_salt)

    def _commit_full_blocks(self, sequence: Sequence) -> None:
        full = sequence.num_computed_tokens // self.block_size
        bs = self.block_size
        salt = sequence.cache_salt.encode() if sequence.cache_salt else b""
        while len(sequence.block_hashes) < full:
            index = len(sequence.block_hashes)
            parent = sequence.block_hashes[-1] if sequence.block_hashes else ROOT_HASH
            tokens = sequence.token_slice(index * bs, (index + 1) * bs)
            block_hash = hash_block(parent, tokens, salt if index == 0 else b"")
            self.pool.commit(sequence.block_ids[index], block_hash,
                             sequence.block_hashes[-1] if sequence.block_hashes else None, tokens,
                             sequence.cache_salt if index == 0 else None)
            sequence.block_hashes.append(block_hash)
