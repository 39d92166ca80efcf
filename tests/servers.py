"""Start real server processes for tests: free loopback ports, wait for health, always stop them.

    with run_replica() as replica:            # python -m replica --model tiny on 127.0.0.1
        httpx.post(replica.url + "/v1/completions", ...)

    with run_process([sys.executable, "-m", "gateway", ...], "http://127.0.0.1:PORT/health") as gw:
        ...

Output (stdout + stderr) goes to a temp file, never a pipe, so a chatty server cannot block on a
full pipe; `logs()` reads it, and a server that dies or never gets healthy fails the test with it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
HEALTH_POLL_S = 0.1  # another process's readiness has no event to await: poll, bounded below


_PORT_CLAIMS = Path(tempfile.gettempdir()) / "kvgate-test-ports"
_CLAIM_FILES: list = []  # open for the life of the process: the kernel drops the locks when it exits


def _claim(port: int) -> bool:
    """Whether no other live process (pytest-xdist's other workers, a bench next to the tests)
    holds port: an exclusive flock on a file named after it, kept until this process exits, so a
    claim never goes stale and nothing needs cleaning up."""
    _PORT_CLAIMS.mkdir(exist_ok=True)
    handle = open(_PORT_CLAIMS / str(port), "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return False
    _CLAIM_FILES.append(handle)
    return True


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago and that no test or bench process has
    handed out before. Linux picks bind(0)'s port at random, so two calls in a row, or in two
    xdist workers, can return the same one: a CI run once got a gateway port equal to a replica's,
    and another saw its replica's /health answered by another worker's gateway on the same port
    while its own replica could not bind. A port is never given back: a run uses a few hundred of
    ~28k."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if _claim(port):  # flock conflicts with this process's own earlier claims too
            return port
    raise RuntimeError("no loopback port free that no test process has handed out already")


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


ReplicaProcess = ServerProcess


class ServerStartError(RuntimeError):
    pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _listens(pid: int, port: int) -> bool:
    """Whether pid or a process it started (a gateway's workers, `kvgate up`'s children) listens on
    port: a server that lost its port to another process (its bind failed late, after loading a
    model) must not be mistaken for whatever answers there."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for member in family:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in member.net_connections("tcp")):
                return True
    return False


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL: never leave a server behind."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


@contextlib.contextmanager
def run_process(argv: Sequence[str], health_url: str, *, port: int, env: dict | None = None,
                startup_timeout_s: float = 120.0, stop_timeout_s: float = 10.0,
                name: str = "server") -> Iterator[ServerProcess]:
    """Run argv from the repo root until the `with` block ends; yields once health_url answers 200."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
    log_file = tempfile.NamedTemporaryFile(prefix=f"kvgate-{name}-", suffix=".log", delete=False)
    log_path = Path(log_file.name)
    proc = subprocess.Popen(list(argv), cwd=REPO_ROOT, env=full_env, stdout=log_file,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log_file.close()
    server = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(health_url):
            if proc.poll() is not None:
                raise ServerStartError(f"{name} exited with code {proc.returncode} before becoming "
                                       f"healthy:\n{server.logs()[-4000:]}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"{name} not healthy at {health_url} after {startup_timeout_s:.0f}s:"
                                       f"\n{server.logs()[-4000:]}")
            time.sleep(HEALTH_POLL_S)
        health_port = urllib.parse.urlsplit(health_url).port
        if health_port is not None and not _listens(proc.pid, health_port):
            raise ServerStartError(f"{health_url} is answered by another process, not this {name}:"
                                   f"\n{server.logs()[-4000:]}")
        yield server
    finally:
        stop_process(proc, stop_timeout_s)
        with contextlib.suppress(OSError):
            log_path.unlink()


@contextlib.contextmanager
def run_replica(model: str = "tiny", threads: int = 1, extra_args: Sequence[str] = (),
                startup_timeout_s: float = 120.0) -> Iterator[ReplicaProcess]:
    """A built-in replica (`python -m replica`) on a free loopback port."""
    port = free_port()
    argv = [sys.executable, "-m", "replica", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--log-format", "json", *extra_args]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="replica",
                     startup_timeout_s=startup_timeout_s) as server:
        yield server


def _all_replicas_ready(health_url: str) -> bool:
    try:
        with urllib.request.urlopen(health_url, timeout=2) as response:
            return bool(json.loads(response.read()).get("all_ready"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return False


@contextlib.contextmanager
def run_gateway(config_path: str | Path, port: int, *, ready_timeout_s: float = 60.0,
                argv: Sequence[str] | None = None, startup_timeout_s: float = 120.0) -> Iterator[ServerProcess]:
    """`python -m gateway.cli serve --config FILE` (or `argv`, a command that serves that config) on
    `port`; yields once every replica is ready (its tokenizer fetched: /health says all_ready), not
    just once the gateway listens."""
    argv = argv or [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
    health_url = f"http://127.0.0.1:{port}/health"
    with run_process(argv, health_url, port=port, name="gateway", startup_timeout_s=startup_timeout_s) as gateway:
        deadline = time.monotonic() + ready_timeout_s
        while not _all_replicas_ready(health_url):  # another process: poll, bounded
            if time.monotonic() > deadline:
                raise ServerStartError(f"gateway replicas not ready after {ready_timeout_s:.0f}s:\n"
                                       f"{gateway.logs()[-4000:]}")
            time.sleep(HEALTH_POLL_S)
        yield gateway


def gateway_config_over(directory: Path, upstream: str, model: str) -> tuple[Path, int]:
    """A round-robin gateway's config in `directory` over one OpenAI-shaped upstream serving
    `model` (the tiny tokenizer), and the free port it names."""
    from replica.tiny import tiny_checkpoint_dir

    port = free_port()
    config = directory / "gateway.yaml"
    config.write_text(
        f"gateway: {{host: 127.0.0.1, port: {port}}}\nlogging: {{format: json}}\n"
        f"routing: {{policy: round_robin}}\nreplicas:\n"
        f"  - {{name: {model}-0, url: '{upstream}', model: {model}, tokenizer: '{tiny_checkpoint_dir()}'}}\n")
    return config, port


@contextlib.contextmanager
def openai_upstream(model: str, completions, **runner_kwargs) -> Iterator[str]:
    """An OpenAI-shaped aiohttp server on its own thread (/health, /v1/models serving `model`,
    POST /v1/completions answered by `completions`), for upstream faults a real replica cannot
    play; yields its URL, stopped on exit."""
    import asyncio
    import threading

    from aiohttp import web

    port = free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 2048}]})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, **runner_kwargs)
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
