"""Other routers, installed and launched the way their users do, for side-by-side benches.

sglang-router (`SGLANG_ROUTER`) and vllm-router (`VLLM_ROUTER`) live in a bench-only virtualenv
(`BENCH_VENV`, git-ignored), never in the project's dependencies: created and filled with pip on
first use, with a message saying so. Each is launched as its README says (`python -m
sglang_router.launch_router --worker-urls ... --policy ...`; `python -m vllm_router.launch_router`,
what its `vllm-router` script runs) with its own defaults for every routing knob; only addresses
are pinned to loopback (their Prometheus listeners default to 0.0.0.0).

    python = sglang_router_python()                 # raises RouterUnavailable with the reason
    with run_sglang_router(python, [r.url for r in replicas]) as router:
        ... router.url ...
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Sequence

from tests.servers import REPO_ROOT, ServerProcess, ServerStartError, free_port, run_process

SGLANG_ROUTER_VERSION = "0.3.2"
SGLANG_ROUTER = f"sglang-router=={SGLANG_ROUTER_VERSION}"
VLLM_ROUTER_VERSION = "0.1.17"   # the newest on PyPI when bench/vs_routers.py was written
VLLM_ROUTER = f"vllm-router=={VLLM_ROUTER_VERSION}"
BENCH_VENV = REPO_ROOT / ".kvgate-cache" / "bench-venv"
INSTALL_TIMEOUT_S = 900.0
READY_POLL_S = 0.2  # another process's worker registration has no event to await: poll, bounded


class RouterUnavailable(RuntimeError):
    """The router cannot be installed or started here; the message says why."""


def _installed_version(python: Path, package: str = "sglang-router") -> str | None:
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", f"from importlib.metadata import version; print(version({package!r}))"],
                           capture_output=True, text=True, timeout=60)
    return probe.stdout.strip() if probe.returncode == 0 else None


def router_python(package: str, version: str, say: Callable[[str], None] = print) -> Path:
    """The bench venv's python with `package==version` installed; installs it on first use."""
    python = BENCH_VENV / "bin" / "python"
    if _installed_version(python, package) == version:
        return python
    requirement = f"{package}=={version}"
    say(f"installing {requirement} into {BENCH_VENV.relative_to(REPO_ROOT)} (bench-only virtualenv, "
        f"not a kvgate dependency; first use only, about a minute)")
    steps = ([] if python.exists() else [[sys.executable, "-m", "venv", str(BENCH_VENV)]]) + \
        [[str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet", requirement]]
    for argv in steps:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RouterUnavailable(f"{' '.join(argv[:4])}: {exc}") from None
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip().splitlines()
            errors = [line for line in output if line.startswith("ERROR")] or output[-5:]
            raise RouterUnavailable(f"{' '.join(argv[2:4])} {argv[-1]} failed: {' '.join(errors)[:800]}")
    installed = _installed_version(python, package)
    if installed != version:
        raise RouterUnavailable(f"installed {package} reports version {installed!r}, wanted {version}")
    return python


def sglang_router_python(say: Callable[[str], None] = print) -> Path:
    """The bench venv's python with sglang-router installed; installs it on first use."""
    return router_python("sglang-router", SGLANG_ROUTER_VERSION, say)


def vllm_router_python(say: Callable[[str], None] = print) -> Path:
    """The bench venv's python with vllm-router installed; installs it on first use."""
    return router_python("vllm-router", VLLM_ROUTER_VERSION, say)


def _ready_workers(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as response:
            return int(json.loads(response.read()).get("healthy_workers", 0))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return 0


@contextlib.contextmanager
def _run_router(name: str, module: str, python: Path, worker_urls: Sequence[str], policy: str, log_level: str,
                ready_timeout_s: float) -> Iterator[ServerProcess]:
    """sglang-router or vllm-router (the same launcher flags) in front of `worker_urls`; yields once
    every worker is registered and healthy (/health answers before registration finishes:
    /readiness counts the workers)."""
    port, metrics_port = free_port(), free_port()
    argv = [str(python), "-m", module, "--worker-urls", *worker_urls, "--policy", policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", log_level]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name=name) as router:
        deadline = time.monotonic() + ready_timeout_s
        while _ready_workers(router.url) < len(worker_urls):
            if router.proc.poll() is not None or time.monotonic() > deadline:
                raise ServerStartError(f"{name}: {len(worker_urls)} workers not ready after "
                                       f"{ready_timeout_s:.0f}s:\n{router.logs()[-4000:]}")
            time.sleep(READY_POLL_S)
        yield router


def run_sglang_router(python: Path, worker_urls: Sequence[str], *, policy: str = "cache_aware",
                      log_level: str = "warn", ready_timeout_s: float = 60.0):
    """sglang-router in front of `worker_urls`, ready (a context manager yielding its ServerProcess)."""
    return _run_router("sglang-router", "sglang_router.launch_router", python, worker_urls, policy, log_level,
                       ready_timeout_s)


def run_vllm_router(python: Path, worker_urls: Sequence[str], *, policy: str = "cache_aware",
                    log_level: str = "warning", ready_timeout_s: float = 60.0):
    """vllm-router in front of `worker_urls` (its policies include round_robin and cache_aware, the
    default), ready (a context manager yielding its ServerProcess)."""
    return _run_router("vllm-router", "vllm_router.launch_router", python, worker_urls, policy, log_level,
                       ready_timeout_s)
