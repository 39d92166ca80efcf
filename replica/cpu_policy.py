"""How the engine's compute threads ask the Linux scheduler to treat them: as batch work.

A built-in replica often shares its host's cores with the gateway (`kvgate up`, a bench, a small
box). A thread the kernel wakes (a request handed to the engine, a socket read) normally preempts
whatever runs on the CPU it wakes on, since it slept and is owed time; when that thread then
computes a prefill for milliseconds, the gateway's event loop, preempted in the middle of a
write, waits for it with every request it holds (measured: the gateway's write() of a request to a
co-located replica returned after ~0.9 ms, the replica's whole turn, instead of ~0.04 ms).
SCHED_BATCH (sched(7)) gives up the preemption on wake-up: the gateway, I/O work in short bursts,
runs on until it waits, and the engine gets the CPU then or on another core. The thread's nice
value also goes up to BATCH_NICE (weight 335 against a normal thread's 1024): when a burst of
requests has the gateway tokenizing and routing while every replica computes, the gateway gets
its CPU first instead of a fair fraction, and the engine still has every cycle nobody else wants.
An unprivileged process may do both to itself (raising a nice value needs no privilege; lowering
it back does, so 'normal' leaves the nice value as it finds it).

The policy is per thread and inherited by the threads a thread starts: the engine thread sets it
before its first torch op, so the intra-op worker threads torch starts for it (--threads > 1)
inherit it. The replica's HTTP thread, and the helper threads it starts (the KV event
publisher's, which wakes every engine step, and ZMQ's), run SCHED_BATCH too, at the nice value
they had: a fair share of the CPU (they parse, tokenize, stream, publish), but the gateway's write
of a request no longer hands them the CPU mid-write. Measured on the conversation trace (4
replicas and the gateway on 2 cores): the gateway's time from a request's arrival to its routing,
routed_ms, went from 5.3 to 2.9 ms mean and from 21.8 to 8.8 ms p99, once the replicas' HTTP
threads stopped preempting it."""
from __future__ import annotations

import os
import threading

POLICIES = ("batch", "normal")
BATCH_NICE = 5


def checked(policy: str) -> str:
    """`policy` if it is one of POLICIES, else ValueError naming them."""
    if policy not in POLICIES:
        raise ValueError(f"cpu policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    return policy


def apply_to_current_thread(policy: str, lower_priority: bool = True) -> bool:
    """Set the calling thread's scheduling policy, and for 'batch' its nice value to at least
    BATCH_NICE unless `lower_priority` is False; False where the OS has no SCHED_BATCH or refuses
    (then the thread keeps the policy it had: serving works the same, only wake-ups differ)."""
    wanted = getattr(os, "SCHED_BATCH" if checked(policy) == "batch" else "SCHED_OTHER", None)
    if wanted is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, wanted, os.sched_param(0))  # pid 0: this thread (Linux)
        if policy == "batch" and lower_priority:  # per thread on Linux, inherited by the threads it starts
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BATCH_NICE))
    except OSError:
        return False
    return True
