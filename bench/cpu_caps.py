"""A fixed CPU share per replica process (Linux CFS bandwidth control), so that co-located CPU
replicas behave like replicas on separate devices.

Why: in a real cluster each replica has its own accelerator; one replica's work does not slow
another's. Four CPU replicas on a 2-core machine do slow each other: a router that spreads load
keeps four processes computing at once (each at half speed), one that piles every request onto a
single replica keeps that replica at full speed and the others idle. TTFT figures then reward
piling up, the opposite of what happens on real hardware. With a cap, each replica has the same
compute whether the others are busy or idle, as on a device of its own.

    with CpuCaps(0.4) as caps:         # each capped process gets at most 0.4 of a core
        caps.cap(pid)                  # its compute threads (see below), else all its threads
    caps.unavailable                   # why nothing is capped ("" when caps apply)

What is capped is the compute, not the whole process. A GPU replica's host side (its HTTP server
reading requests, writing tokens) runs on the host's CPU whether or not the device is busy; a cap
on the whole process would also stop a busy replica from reading a new request or writing a
finished token until its next CFS period (up to 6 ms of every 10 at 0.4 of a core), time a
router's client sees and the replica's own TTFT does not, and most on the replicas a balanced
router keeps busy. The built-in replica's compute threads say which they are: they run
SCHED_BATCH at a nice value above the process's main thread's (replica/cpu_policy.py; its HTTP
thread runs SCHED_BATCH at its own nice value), so with cgroup v1 those threads alone join the
capped group (threads they start later inherit it) and the rest of the process stays uncapped.
`whole_process=True`, a replica without SCHED_BATCH threads (`--cpu-policy normal`), or cgroup
v2 (threads of one process in two groups need its threaded mode) cap every thread;
`caps.scope` says which happened.

cgroup v1 (`/sys/fs/cgroup/cpu`) or v2 (a writable `/sys/fs/cgroup` with the cpu controller);
both need the right to create cgroups (root, or a delegated subtree). Without it nothing is capped
and `unavailable` says why: the caller prints it next to its figures."""
from __future__ import annotations

import os
from pathlib import Path

PERIOD_US = 10_000  # a short period: a capped prefill is throttled in 10 ms slices, not 100 ms stalls
# The capped compute's weight against everything else on the host (cgroup v1 cpu.shares; the root
# default is 1024): low, so that the emulated device yields the CPU to host work (the router, the
# replicas' HTTP threads, the client) whenever that work wants it, and runs up to its cap otherwise.
SHARES = 128


class CpuCaps:
    def __init__(self, cores: float, root: str = "/sys/fs/cgroup", shares: int | None = SHARES) -> None:
        self.cores = cores
        self.shares = shares
        self.unavailable = ""
        self._groups: list[Path] = []
        self._v2 = False
        self._base: Path | None = None
        self.scope = ""  # "compute threads" or "whole process" once something is capped
        base = Path(root)
        if cores <= 0:
            self.unavailable = "CPU caps off"
        elif (base / "cpu" / "cpu.cfs_quota_us").exists():
            self._base = base / "cpu"
        elif "cpu" in _read(base / "cgroup.controllers").split():
            self._base, self._v2 = base, True
        else:
            self.unavailable = f"no cgroup cpu controller under {root}"
        if self._base is not None and not os.access(self._base, os.W_OK):
            self.unavailable = f"{self._base} is not writable (CPU caps need root or a delegated cgroup)"
            self._base = None

    def __enter__(self) -> "CpuCaps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def groups(self) -> list[Path]:
        """The cgroups made so far (removed by close)."""
        return list(self._groups)

    def cap(self, pid: int, whole_process: bool = False) -> bool:
        """Put process `pid`'s compute threads (its SCHED_BATCH ones; all its threads if it has none,
        under cgroup v2, or with `whole_process`) in a cgroup of its own, at most `cores` of a core."""
        if self._base is None:
            return False
        group = self._base / f"kvgate-bench-{os.getpid()}-{pid}"
        quota_us = max(int(self.cores * PERIOD_US), 1000)
        try:
            group.mkdir(exist_ok=True)
            self._groups.append(group)
            if self._v2:
                (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
                if self.shares:  # cpu.weight 1..10000, 100 the default: the same ratio as shares / 1024
                    (group / "cpu.weight").write_text(str(max(1, round(self.shares * 100 / 1024))))
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota_us))
                if self.shares:
                    (group / "cpu.shares").write_text(str(self.shares))
            compute = [] if whole_process or self._v2 else compute_threads(pid)
            if compute:
                for tid in compute:
                    (group / "tasks").write_text(str(tid))
            else:
                (group / "cgroup.procs").write_text(str(pid))
            scope = "compute threads" if compute else "whole process"
            self.scope = scope if self.scope in ("", scope) else "mixed"
        except OSError as exc:
            self.unavailable = f"cannot cap a replica's CPU: {exc}"
            self._base = None
            return False
        return True

    def close(self) -> None:
        """Remove the cgroups (a process still in one goes back to the root first)."""
        for group in reversed(self._groups):
            try:
                for tid in _read(group / "tasks").split() if not self._v2 else []:
                    (group.parent / "tasks").write_text(tid)
                for pid in _read(group / "cgroup.procs").split():
                    (group.parent / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass
        self._groups.clear()


def compute_threads(pid: int) -> list[int]:
    """The thread ids of `pid` that run SCHED_BATCH at a lower priority (higher nice value) than
    its main thread: a built-in replica's engine and its torch workers; [] where the OS cannot say."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return []
    found = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        main_nice = os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return []
    for tid in tids:
        try:
            if os.sched_getscheduler(int(tid)) == batch and os.getpriority(os.PRIO_PROCESS, int(tid)) > main_nice:
                found.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
