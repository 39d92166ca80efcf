"""`kvgate up`: start a built-in replica process for every config entry with a `launch` block,
wait for each to answer /health (bounded), and stop them all, children included, on the way out.
While the gateway serves, gateway/supervisor.py restarts the ones that exit (through `launch`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config import Config, ReplicaSpec

STOP_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """A replica died or did not become healthy; the message carries its output tail."""


class LaunchedReplica:
    def __init__(self, spec: ReplicaSpec, proc: subprocess.Popen, log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path
        self.started_s = time.monotonic()

    def output_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no output captured)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def replica_argv(spec: ReplicaSpec) -> list[str]:
    launch = spec.launch
    host = urlsplit(spec.url).hostname or "127.0.0.1"
    argv = [sys.executable, "-m", "replica", "--model", launch.model, "--host", host, "--port", str(spec.port),
            "--threads", str(launch.threads), "--served-model-name", spec.model]
    if spec.kv_events is not None:  # the replica publishes where the gateway subscribes
        argv += ["--kv-events-endpoint", spec.kv_events.endpoint]
        if spec.kv_events.replay_endpoint:
            argv += ["--kv-events-replay-endpoint", spec.kv_events.replay_endpoint]
    return argv + list(launch.extra_args)


def _die_with_parent() -> None:
    """Linux: the replica gets SIGTERM if kvgate itself is killed without cleaning up."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Launcher:
    def __init__(self, config: Config, log_dir: Path | None = None) -> None:
        self.config = config
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-replicas-"))
        self.replicas: list[LaunchedReplica] = []

    def start(self) -> None:
        for spec in self.config.replicas:
            if spec.launch is not None:
                self.replicas.append(self.launch(spec))

    def launch(self, spec: ReplicaSpec) -> LaunchedReplica:
        """Start (or restart: its output is appended to the same log) one replica process."""
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                replica_argv(spec), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches kvgate, which stops replicas in order
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        return LaunchedReplica(spec, proc, log_path)

    def wait_healthy(self, timeout_s: float, progress=None) -> None:
        """Poll each replica's /health until all answer 200; LaunchError with the output tail if one
        exits or the time runs out. `progress(waiting_names, elapsed_s)` is called between polls."""
        started = time.monotonic()
        waiting = list(self.replicas)
        while waiting:
            for replica in list(waiting):
                code = replica.proc.poll()
                if code is not None:
                    raise LaunchError(f"replica {replica.spec.name} exited with code {code} while loading; "
                                      f"last output ({replica.log_path}):\n{replica.output_tail()}")
                if _healthy(replica.spec.url):
                    waiting.remove(replica)
            elapsed_s = time.monotonic() - started
            if not waiting:
                break
            if elapsed_s > timeout_s:
                names = ", ".join(r.spec.name for r in waiting)
                tails = "\n".join(f"--- {r.spec.name} ({r.log_path}):\n{r.output_tail()}" for r in waiting)
                raise LaunchError(f"replica(s) {names} not healthy after {timeout_s:.0f} s\n{tails}")
            if progress is not None:
                progress([r.spec.name for r in waiting], elapsed_s)
            time.sleep(0.25)  # a separate process: polling /health is the only signal it gives

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for replica in self.replicas:
            stop_process(replica, deadline)


def stop_process(replica: LaunchedReplica, deadline_s: float) -> None:
    """SIGTERM (if not sent yet), wait until `deadline_s`, then SIGKILL its whole session."""
    if replica.proc.poll() is None:
        replica.proc.send_signal(signal.SIGTERM)
    try:
        replica.proc.wait(timeout=max(0.1, deadline_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(replica.proc.pid, signal.SIGKILL)  # its own session: takes its children too
        replica.proc.wait(timeout=5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
