"""How much slower this host runs code that has not run for a while: the same small piece of the
gateway's per-request work, timed back to back and after a gap in which the thread keeps its core
busy with other, tiny work (a spin on the clock: it touches almost no memory, does not sleep and is
never descheduled).

Why: on a machine where a core's caches are shared with, or flushed by, work outside the process
(a hyperthread sibling running another guest, the hypervisor), what a lone request costs follows
the memory it touches, not the instructions it runs. Every process of the gateway benches runs
like that at 200 req/s (a request every 5 ms), and not at saturation (the same code over and over).
This prints the factor, so a reader can tell such a host from a quiet one before comparing
latency figures across machines.

    .venv/bin/python -m bench.host_cold [--rounds 300]

Figures: `host_cold_factor_{gap}ms` = median time after the gap / median time back to back."""
from __future__ import annotations

import argparse
import json
import statistics
import time

GAPS_MS = (0.1, 1.0, 2.0, 3.0, 4.0, 5.0, 20.0)


def _work():
    """A representative piece of a request: decode a completions body into the gateway's struct,
    check it, and encode a small record."""
    from protocol.requests import decode_completion
    import msgspec
    body = json.dumps({"model": "stub", "prompt": "The quick brown fox jumps over the lazy dog. " * 4,
                       "max_tokens": 16, "temperature": 0.0}).encode()
    encode = msgspec.json.Encoder().encode

    def work() -> None:
        request = decode_completion(body)
        encode({"event": "request", "model": request.model, "max_tokens": request.max_tokens,
                "prompt_chars": len(request.prompt), "ids": list(range(64))})
    return work


def timed(work, rounds: int, gap_s: float) -> float:
    """Median wall time of `work` (ns), each run after `gap_s` of spinning on the clock."""
    clock = time.perf_counter_ns
    costs = []
    for _ in range(rounds):
        if gap_s:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        start = clock()
        work()
        costs.append(clock() - start)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="How much slower code runs after a gap, on this host.")
    parser.add_argument("--rounds", type=int, default=300, help="timed runs per gap (20 ms gaps: ~6 s)")
    args = parser.parse_args(argv)
    work = _work()
    for _ in range(1000):
        work()
    warm = timed(work, args.rounds * 10, 0.0)
    print(f"back to back: {warm / 1000:.1f} us")
    for gap_ms in GAPS_MS:
        cold = timed(work, max(20, int(args.rounds * min(1.0, 5.0 / gap_ms))), gap_ms / 1000)
        print(f"after {gap_ms:g} ms of spinning: {cold / 1000:.1f} us ({cold / warm:.1f}x)")
        print(f"figure host_cold_factor_{gap_ms:g}ms: {cold / warm:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
