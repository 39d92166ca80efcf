"""KV blocks a prefill replica holds for a decode replica to pull: one lease per finished
`do_remote_decode` request. Pure bookkeeping (no tensors, no clock of its own).

A pin owns one block-pool reference per block (the finished sequence's), so the blocks can be
neither evicted nor reallocated, hence never written, while pinned: a reader may copy them from
any thread. A pin ends one of two ways: claimed by a pull (the puller copies the blocks, then
hands them back for release), or expired when its lease runs out (vLLM 0.33.0: kv_lease_duration,
30 s; it frees the blocks and counts the request as expired).
"""
from __future__ import annotations

from dataclasses import dataclass

from routing.hashing import ROOT_HASH, hash_block

DEFAULT_LEASE_S = 30.0


@dataclass
class KVPin:
    pin_id: str                  # the answer's remote_request_id
    block_ids: list[int]
    num_tokens: int              # tokens whose KV the blocks hold (remote_num_tokens)
    num_prompt_tokens: int
    prompt_digest: int           # prompt + cache_salt hashed: a pull for another prompt is refused
    expires_at_s: float          # monotonic clock


class PinTable:
    """Owned by the engine, changed under its state lock: the worker adds and expires pins, the
    server's pull handler claims them."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S):
        if lease_s <= 0:
            raise ValueError(f"the KV lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._pins: dict[str, KVPin] = {}
        self.num_blocks = 0
        self.expired_total = 0
        self.claimed_total = 0

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, pin_id: str, block_ids: list[int], num_tokens: int, num_prompt_tokens: int,
            prompt_digest: int, now_s: float) -> KVPin:
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} exists")
        pin = KVPin(pin_id, list(block_ids), num_tokens, num_prompt_tokens, prompt_digest, now_s + self.lease_s)
        self._pins[pin_id] = pin
        self.num_blocks += len(pin.block_ids)
        return pin

    def peek(self, pin_id: str) -> KVPin | None:
        return self._pins.get(pin_id)

    def claim(self, pin_id: str) -> KVPin | None:
        """Take a pin out of the table (it no longer expires); the caller releases its blocks."""
        pin = self._pins.pop(pin_id, None)
        if pin is not None:
            self.num_blocks -= len(pin.block_ids)
            self.claimed_total += 1
        return pin

    def expire(self, now_s: float) -> list[KVPin]:
        """Remove and return every pin whose lease has run out. Linear in the pins held (a few
        per in-flight P/D request), once per engine iteration."""
        if not self._pins:
            return []
        expired = [pin for pin in self._pins.values() if pin.expires_at_s <= now_s]
        for pin in expired:
            del self._pins[pin.pin_id]
            self.num_blocks -= len(pin.block_ids)
        self.expired_total += len(expired)
        return expired

    def next_expiry_s(self) -> float | None:
        return min((pin.expires_at_s for pin in self._pins.values()), default=None)


def prompt_digest(prompt_token_ids: list[int], cache_salt: str | None) -> int:
    """One 64-bit hash of a whole prompt and its salt (the block hash function over one
    prompt-long block): both legs of a P/D request must carry the same prompt."""
    return hash_block(ROOT_HASH, prompt_token_ids, cache_salt.encode() if cache_salt else b"")
