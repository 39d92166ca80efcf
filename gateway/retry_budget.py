"""A retry budget (Envoy's idea): retries may be at most a fraction of recent requests, so that when
every replica struggles the gateway does not multiply the load it sends them. Below a minimum
count per window retries are always allowed (a quiet gateway still fails over)."""
from __future__ import annotations

from gateway.window_counts import WindowCounts

WINDOW_S = 10.0


class RetryBudget:
    def __init__(self, fraction: float, minimum: int, window_s: float = WINDOW_S) -> None:
        self.fraction = fraction
        self.minimum = minimum
        self._window = WindowCounts(window_s)  # (requests, retries) in the last window_s

    def on_request(self, now_s: float) -> None:
        self._window.add(now_s)

    def try_spend(self, now_s: float) -> bool:
        """True (and counted) if one more retry fits the budget now."""
        requests, retries = self._window.totals(now_s)
        if retries >= max(self.minimum, self.fraction * requests):
            return False
        self._window.add(now_s, 0, 1)
        return True
