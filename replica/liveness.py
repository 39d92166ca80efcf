"""Whether the engine can make progress: what the replica's /health reports, so a gateway takes a
replica out of rotation when its engine thread died or stopped stepping, not only when its socket
closes. A dead engine also ends the process (its requests failed; a supervisor restarts it).

`stalled` means: work is queued or running, and no engine step has finished for `stall_s`
(a single step is milliseconds to a second or two on a CPU). An idle engine is never stalled,
nor one whose queued requests wait for KV blocks to free up.

The debug faults (`--debug-fault crash-after-steps=N | stall-after-steps=N`) make the worker
thread die or hang for real after N steps: the failover tests need an engine failure that no
request can cause."""
from __future__ import annotations

import threading
import time


class EngineLiveness:
    def __init__(self, stall_s: float = 30.0, debug_fault: str | None = None) -> None:
        self.stall_s = stall_s
        self.last_step_s = time.monotonic()
        self.waiting_for_room = False  # the last turn had work but nothing could run (KV blocks pinned/full)
        self.fatal: BaseException | None = None
        self.steps = 0
        self._fault, self._fault_after = _parse_fault(debug_fault)

    def stepped(self, ran_something: bool) -> None:
        """The worker finished one loop turn (called on the worker thread)."""
        self.last_step_s = time.monotonic()
        self.waiting_for_room = not ran_something
        self.steps += 1
        if self._fault is not None and self.steps >= self._fault_after:
            if self._fault == "crash":
                raise RuntimeError(f"debug fault: engine crash after {self.steps} steps")
            threading.Event().wait()  # debug fault: the worker hangs for good

    def died(self, error: BaseException) -> None:
        self.fatal = error

    def problem(self, thread_alive: bool, has_work: bool) -> str | None:
        """None when the engine can make progress; else why not (for /health and the gateway's log)."""
        if self.fatal is not None or not thread_alive:
            return f"engine thread died: {type(self.fatal).__name__}: {self.fatal}" if self.fatal \
                else "engine thread is not running"
        idle_s = time.monotonic() - self.last_step_s
        if has_work and not self.waiting_for_room and idle_s > self.stall_s:
            return f"engine stalled: no step for {idle_s:.1f} s with requests waiting"
        return None


def _parse_fault(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    kind, _, count = spec.partition("=")
    faults = {"crash-after-steps": "crash", "stall-after-steps": "stall"}
    if kind not in faults or not count.isdigit():
        raise ValueError(f"--debug-fault {spec!r}: expected crash-after-steps=N or stall-after-steps=N")
    return faults[kind], int(count)
