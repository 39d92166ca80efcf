"""Per-key rate limits: requests per minute and tokens per minute, as token buckets, with the
numbers OpenAI's `x-ratelimit-*` headers carry.

A bucket holds up to `per_minute` units and refills continuously at per_minute / 60 a second, so
a key may burst its whole minute at once and then runs at its rate. When tokens are counted
(OpenAI's rule): at admission a request is charged its prompt tokens plus the output it may
produce (its max_tokens after the key's cap; nothing when it asks for none and no cap applies);
when it ends the charge is corrected to prompt + output actually produced. A correction may take
a bucket below zero (an answer without max_tokens that ran long): the key's next requests wait
until it refills. Pure logic over a clock: no I/O, unit-testable without sockets."""
from __future__ import annotations

import math
import time
from typing import Callable


class TokenBucket:
    __slots__ = ("per_minute", "level", "updated_s", "clock")

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self.clock = clock
        self.updated_s = clock()

    @property
    def per_s(self) -> float:
        return self.per_minute / 60.0

    def _refill(self) -> float:
        now = self.clock()
        self.level = min(float(self.per_minute), self.level + (now - self.updated_s) * self.per_s)
        self.updated_s = now
        return self.level

    def try_take(self, amount: float) -> float:
        """Take `amount` if the bucket holds it: 0.0; else nothing is taken and the seconds until
        it will hold it are returned (inf when it never can: more than a whole minute's worth)."""
        level = self._refill()
        if amount <= level:
            self.level = level - amount
            return 0.0
        if amount > self.per_minute:
            return math.inf
        return (amount - level) / self.per_s

    def adjust(self, amount: float) -> None:
        """Charge (positive) or refund (negative) after the fact; may go below zero, never above full."""
        self.level = min(float(self.per_minute), self._refill() - amount)

    def remaining(self) -> int:
        return max(0, math.floor(self._refill()))

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return max(0.0, (self.per_minute - self._refill()) / self.per_s)

    def resize(self, per_minute: int) -> None:
        """A reload changed the limit: keep what was spent, within the new size."""
        self._refill()
        self.per_minute = per_minute
        self.level = min(self.level, float(per_minute))


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `1.5s`, `6m0s`."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    rest = math.ceil(rest * 10) / 10
    text = f"{rest:g}s"
    return f"{int(minutes)}m{text}" if minutes else text


class KeyLimiter:
    """One key's buckets (either may be absent: no limit of that kind)."""

    def __init__(self, rpm: int | None, tpm: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.requests = TokenBucket(rpm, clock) if rpm else None
        self.tokens = TokenBucket(tpm, clock) if tpm else None

    def resize(self, rpm: int | None, tpm: int | None) -> None:
        self.requests = _resized(self.requests, rpm, self.clock)
        self.tokens = _resized(self.tokens, tpm, self.clock)

    def headers(self) -> dict[str, str]:
        out = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.per_minute)
                out[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining())
                out[f"x-ratelimit-reset-{kind}"] = duration(bucket.reset_s())
        return out


def _resized(bucket: TokenBucket | None, per_minute: int | None, clock) -> TokenBucket | None:
    if not per_minute:
        return None
    if bucket is None:
        return TokenBucket(per_minute, clock)
    bucket.resize(per_minute)
    return bucket
