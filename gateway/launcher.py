"""`kvgate up`: start a server process for every config entry with a `launch` block (kvgate's own
replica, vLLM or SGLang: gateway/engines.py builds each command), wait for each to answer /health
(bounded, per engine: real engines take minutes to load), and stop them all, children included,
on the way out. While the gateway serves, gateway/supervisor.py restarts the ones that exit.

Each replica's output goes to `<log dir>/<name>.log`. Without a log dir given (`kvgate up
--replica-logs DIR` keeps them there), the launcher makes a temporary one and removes it at a
clean exit: every replica stopped by us, none having died, failed to load or exited with an
error on the way. Otherwise the logs are kept, and `stop` says where."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from gateway.config import Config, ReplicaSpec
from gateway.engines import EngineCommand, engine_command, startup_timeout_s

STOP_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """A replica died or did not become healthy; the message carries its output tail."""


class LaunchedReplica:
    def __init__(self, spec: ReplicaSpec, proc: subprocess.Popen, log_path: Path, command: EngineCommand) -> None:
        self.spec = spec
        self.proc = proc
        self.command = command  # what it runs: a reload that changes it restarts the process
        self.log_path = log_path
        self.started_s = time.monotonic()

    def output_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no output captured)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def last_line(self) -> str:
        """Its latest line of output (a loading engine's progress), from the end of its log only."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(max(0, log_file.seek(0, os.SEEK_END) - 4096))
                lines = log_file.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line.strip() for line in reversed(lines) if line.strip()), "")


def die_with_parent() -> None:
    """Linux: the replica gets SIGTERM if kvgate itself is killed without cleaning up."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Launcher:
    def __init__(self, config: Config, log_dir: Path | None = None) -> None:
        self.config = config
        self.temporary_logs = log_dir is None  # ours to remove at a clean exit
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-replicas-"))
        self.replicas: list[LaunchedReplica] = []
        self.trouble: str | None = None  # why the logs are worth keeping (a replica died, failed to load)
        self._launched: set[str] = set()

    def start(self) -> None:
        for spec in self.config.replicas:
            if spec.launch is not None:
                self.replicas.append(self.launch(spec))

    def command(self, spec: ReplicaSpec) -> EngineCommand:
        return engine_command(spec, self.config.routing.block_size)

    def launch(self, spec: ReplicaSpec) -> LaunchedReplica:
        """Start (or restart: its output is appended to the same log) one replica process."""
        log_path = self.log_dir / f"{spec.name}.log"
        if spec.name in self._launched:
            self.trouble = self.trouble or f"{spec.name} was restarted"
        self._launched.add(spec.name)
        command = self.command(spec)
        with open(log_path, "ab") as log_file:
            log_file.write(f"kvgate: starting {spec.name}: {command.shell()}\n".encode())
            log_file.flush()
            proc = subprocess.Popen(
                command.argv, env={**os.environ, **command.env}, stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches kvgate, which stops replicas in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        return LaunchedReplica(spec, proc, log_path, command)

    def wait_healthy(self, timeout_s: float | None = None, progress=None) -> None:
        """Poll each replica's /health until all answer 200; LaunchError with the output tail if one
        exits or its time runs out (`timeout_s`, or its engine's: gateway/engines.py STARTUP_TIMEOUT_S).
        `progress(waiting_names, elapsed_s)` is called between polls."""
        started = time.monotonic()
        waiting = list(self.replicas)
        while waiting:
            for replica in list(waiting):
                code = replica.proc.poll()
                if code is not None:
                    self.trouble = f"{replica.spec.name} exited while loading"
                    raise LaunchError(f"replica {replica.spec.name} exited with code {code} while loading; "
                                      f"last output ({replica.log_path}):\n{replica.output_tail()}")
                if _healthy(replica.spec.url):
                    waiting.remove(replica)
            elapsed_s = time.monotonic() - started
            if not waiting:
                break
            late = [r for r in waiting if elapsed_s > (timeout_s or startup_timeout_s(r.spec))]
            if late:
                names = ", ".join(r.spec.name for r in late)
                self.trouble = f"{names} not healthy in time"
                tails = "\n".join(f"--- {r.spec.name} ({r.log_path}):\n{r.output_tail()}" for r in late)
                raise LaunchError(f"replica(s) {names} not healthy after {elapsed_s:.0f} s "
                                  f"(--startup-timeout-s)\n{tails}")
            if progress is not None:
                progress([r.spec.name for r in waiting], elapsed_s)
            time.sleep(0.25)  # a separate process: polling /health is the only signal it gives

    def stop(self) -> None:
        """Stop every replica; then remove a temporary log dir if all went well, else say where the
        logs are (stderr)."""
        running = []
        for replica in self.replicas:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
                running.append(replica)
            elif self.trouble is None:
                self.trouble = f"{replica.spec.name} had exited (code {replica.proc.returncode})"
        deadline = time.monotonic() + STOP_GRACE_S
        for replica in self.replicas:
            stop_process(replica, deadline)
        for replica in running:
            # 0, or killed by the SIGTERM itself: what a replica stopped by us exits with
            if replica.proc.returncode not in (0, -signal.SIGTERM) and self.trouble is None:
                self.trouble = f"{replica.spec.name} exited with code {replica.proc.returncode} when stopped"
        if self.trouble is not None:
            print(f"kvgate: replica logs kept in {self.log_dir} ({self.trouble})", file=sys.stderr, flush=True)
        elif self.temporary_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def stop_process(replica: LaunchedReplica, deadline_s: float) -> None:
    """SIGTERM (if not sent yet), wait until `deadline_s`, then SIGKILL its whole session."""
    if replica.proc.poll() is None:
        replica.proc.send_signal(signal.SIGTERM)
    try:
        replica.proc.wait(timeout=max(0.1, deadline_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    kill_leftovers(replica)
    replica.proc.wait(timeout=5)


def kill_leftovers(replica: LaunchedReplica) -> None:
    """SIGKILL what is left of a server's session: the server if it still runs, and the processes
    it started (vLLM's engine core and workers, SGLang's scheduler and detokenizer) when it died
    without stopping them; they would hold the GPU memory and ports its restart needs. The session
    id is the server's pid, which Linux does not hand out again while the session has members."""
    try:
        os.killpg(replica.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
