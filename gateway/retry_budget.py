"""A retry budget (Envoy's idea): retries may be at most a fraction of recent requests, so that when
every replica struggles the gateway does not multiply the load it sends them. Below a minimum
count per window retries are always allowed (a quiet gateway still fails over)."""
from __future__ import annotations

from collections import deque

WINDOW_S = 10.0


class RetryBudget:
    def __init__(self, fraction: float, minimum: int, window_s: float = WINDOW_S) -> None:
        self.fraction = fraction
        self.minimum = minimum
        self.window_s = window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        for times in (self._requests, self._retries):
            while times and times[0] < horizon:
                times.popleft()

    def on_request(self, now_s: float) -> None:
        self._requests.append(now_s)

    def try_spend(self, now_s: float) -> bool:
        """True (and counted) if one more retry fits the budget now."""
        self._trim(now_s)
        if len(self._retries) >= max(self.minimum, self.fraction * len(self._requests)):
            return False
        self._retries.append(now_s)
        return True
