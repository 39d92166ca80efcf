"""Two counts over a sliding time window, kept per slice of it: what passive health (requests and
failures, gateway/health.py) and the retry budget (requests and retries, gateway/retry_budget.py)
measure their rates over.

Why slices: each event kept with its time costs a object per request held for the whole window
(80,000 at 8,000 requests/s for 10 s), and reading the window walks all of them on the event loop
(2.2 ms); an event never read (the retry budget's requests while nothing fails) was never dropped
at all. Per slice, an event is one increment and reading the window sums SLICES + 1 pairs. The
window's edge moves a slice at a time: window_s / SLICES (0.5 s of 10)."""
from __future__ import annotations

from collections import deque

SLICES = 20


class WindowCounts:
    __slots__ = ("window_s", "slice_s", "_slices", "_last", "_ends_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.slice_s = window_s / SLICES
        self._slices: deque[list] = deque()  # [slice start, total, marked], oldest first
        self._last = [0.0, 0, 0]  # the newest slice (a spare one before the first event)
        self._ends_s = float("-inf")  # when the newest slice ends: an event from then opens another

    def add(self, now_s: float, total: int = 1, marked: int = 0) -> None:
        """Count events at now_s (loop or monotonic time, one clock per window)."""
        last = self._last if now_s < self._ends_s else self._open(now_s)
        last[1] += total
        last[2] += marked

    def _open(self, now_s: float) -> list:
        last = self._last = [now_s, 0, 0]
        self._ends_s = now_s + self.slice_s
        self._slices.append(last)
        self._drop_before(now_s - self.window_s)
        return last

    def totals(self, now_s: float) -> tuple[int, int]:
        """(total, marked) over the window that ends at now_s."""
        self._drop_before(now_s - self.window_s)
        total = marked = 0
        for _, count, marks in self._slices:
            total += count
            marked += marks
        return total, marked

    def clear(self) -> None:
        self._slices.clear()
        self._ends_s = float("-inf")

    def _drop_before(self, horizon_s: float) -> None:
        slices = self._slices
        while slices and slices[0][0] < horizon_s:
            slices.popleft()
