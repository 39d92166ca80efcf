"""A fixed CPU share per replica process (Linux CFS bandwidth control), so that co-located CPU
replicas behave like replicas on separate devices.

Why: in a real cluster each replica has its own accelerator; one replica's work does not slow
another's. Four CPU replicas on a 2-core machine do slow each other: a router that spreads load
keeps four processes computing at once (each at half speed), one that piles every request onto a
single replica keeps that replica at full speed and the others idle. TTFT figures then reward
piling up, the opposite of what happens on real hardware. With a cap, each replica has the same
compute whether the others are busy or idle, as on a device of its own.

    with CpuCaps(0.4) as caps:         # each capped process gets at most 0.4 of a core
        caps.cap(pid)                  # a process and all its threads
    caps.unavailable                   # why nothing is capped ("" when caps apply)

cgroup v1 (`/sys/fs/cgroup/cpu`) or v2 (a writable `/sys/fs/cgroup` with the cpu controller);
both need the right to create cgroups (root, or a delegated subtree). Without it nothing is capped
and `unavailable` says why: the caller prints it next to its figures."""
from __future__ import annotations

import os
from pathlib import Path

PERIOD_US = 10_000  # a short period: a capped prefill is throttled in 10 ms slices, not 100 ms stalls


class CpuCaps:
    def __init__(self, cores: float, root: str = "/sys/fs/cgroup") -> None:
        self.cores = cores
        self.unavailable = ""
        self._groups: list[Path] = []
        self._v2 = False
        self._base: Path | None = None
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

    def cap(self, pid: int) -> bool:
        """Put process `pid` (all its threads) in a cgroup of its own, at most `cores` of a core."""
        if self._base is None:
            return False
        group = self._base / f"kvgate-bench-{os.getpid()}-{pid}"
        quota_us = max(int(self.cores * PERIOD_US), 1000)
        try:
            group.mkdir(exist_ok=True)
            self._groups.append(group)
            if self._v2:
                (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota_us))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            self.unavailable = f"cannot cap a replica's CPU: {exc}"
            self._base = None
            return False
        return True

    def close(self) -> None:
        """Remove the cgroups (a process still in one goes back to the root first)."""
        for group in reversed(self._groups):
            try:
                for pid in _read(group / "cgroup.procs").split():
                    (group.parent / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass
        self._groups.clear()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
