"""Stop strings on streamed text, one rule for every server that checks them (the replica's engine
per token; the gateway across a resumed stream's seam).

What was already released is stop-free, so a search only needs to start len(stop) - 1
characters before the end of it; and text that could be the start of a stop string is held
back until the next token decides."""
from __future__ import annotations


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string in text that ends after `search_from` (what was released is stop-free,
    so only its last len(stop)-1 characters can start a match)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back_chars(text: str, stops: list[str]) -> int:
    """How many trailing characters could be the start of a stop string (and must wait)."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):  # stops are short: cheap
            if text.endswith(stop[:size]):
                held = size
                break
    return held
