"""What one request costs the gateway, counted rather than timed: the same figure on a busy host.

bench/vs_routers.py times CPU per request; on a shared 2-core machine one phase moves by +-10-20%
from the next, more than a change to the hot path saves. This bench counts instead, for a fixed
set of requests through a real gateway in front of the bench's 4 stubs (bench/stub_backend.py):

  instructions  machine instructions the gateway process executes per request, every thread
                (valgrind's callgrind, counting from a warm gateway; repeats within ~2%)
  opcodes       Python bytecodes the event loop's thread executes per request, and Python calls,
                with the functions that execute the most (sys.settrace opcode events)

Both are counted for round_robin and cache_aware, on a fixed prompt, unique prompts (a number in
front: every block new), streamed requests and a long prompt (~2,000 tokens, non-streamed: the
replica echoes its IDs), with token-ID logging on (bench/vs_routers.py's
gateway config). `--against REV` counts a git revision the same way in the same run (a worktree
under the temp dir, its changed C extensions built there), for a before/after ratio of a change.

    .venv/bin/python -m bench.request_cost [--counter instructions|opcodes] [--against REV] [--quick]

With the opcodes counter, REQUEST_COST_TOP=N lists the N functions that execute the most (15)
and REQUEST_COST_BY_LINE=1 counts per source line instead (where inside a function they go).

instructions needs valgrind on PATH (apt-get install valgrind); the counted gateway runs ~50x
slower under it, so a figure takes about a minute. Ends with `figure <name>: <value>` lines.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.stub_backend import StubProcess
from bench.vs_routers import OUTPUT_TOKENS, POLICIES, PROMPT, body, gateway_config
from tests.servers import free_port, run_gateway

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("fixed", "unique", "stream", "long")
LONG_PROMPT_REPEATS = 100  # the "long" workload: the bench prompt 100 times, ~2,000 tokens (a RAG or agent prompt)
CONNECTIONS = 8          # keep-alive client connections, each sends its next request when answered
WARMUP_REQUESTS = 300    # before counting: caches, pools and the load model settle
READY_TIMEOUT_S = 600.0  # a gateway under valgrind starts in ~30 s on a 2-core box

# Runs in the counted gateway process: the gateway's own entry point, plus a watcher task that
# starts and stops the opcode count when a flag file appears and goes (opcodes counter only).
_LAUNCH = """
import sys
sys.path.insert(0, {tree!r})
sys.argv = ["kvgate", "serve", "--config", {config!r}]
{prelude}
from gateway.cli import main
main()
"""
_OPCODES_PRELUDE = """
import asyncio, collections, os
_flag, _out = {flag!r}, {out!r}
_ops, _calls = collections.Counter(), collections.Counter()
_by_line = {by_line!r}
def _local(frame, event, arg):
    if event == "opcode":
        _ops[(frame.f_code, frame.f_lineno) if _by_line else frame.f_code] += 1
    return _local
def _tracer(frame, event, arg):
    if event != "call":
        return None
    _calls[frame.f_code] += 1
    frame.f_trace_opcodes, frame.f_trace_lines = True, False
    return _local
async def _watch():
    on = False
    while True:
        await asyncio.sleep(0.05)
        if not on and os.path.exists(_flag):
            sys.settrace(_tracer); on = True
        elif on and not os.path.exists(_flag):
            sys.settrace(None); on = False
            with open(_out + ".part", "w") as f:
                for key, n in _ops.most_common():
                    code, line = key if _by_line else (key, key.co_firstlineno)
                    f.write(f"{{n}}\\t{{_calls[code]}}\\t{{code.co_name}}\\t{{os.path.basename(code.co_filename)}}:{{line}}\\n")
            os.replace(_out + ".part", _out)
_run = asyncio.Runner.run
def _run_watched(self, coro, **kwargs):
    async def both():
        watcher = asyncio.ensure_future(_watch())
        try:
            return await coro
        finally:
            watcher.cancel()
    return _run(self, both(), **kwargs)
asyncio.Runner.run = _run_watched
"""


def request_bytes(workload: str, number: int) -> bytes:
    payload = body(workload == "stream")
    if workload == "unique":
        payload["prompt"] = f"Request {number}: {PROMPT}"
    elif workload == "long":
        payload["prompt"] = " ".join([PROMPT] * LONG_PROMPT_REPEATS)
    data = json.dumps(payload).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data))


async def send(port: int, workload: str, count: int, first_number: int, timeout_s: float) -> None:
    """`count` requests on CONNECTIONS keep-alive connections; raises on anything but a whole 200."""
    async def connection(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in range(k, count, CONNECTIONS):
                writer.write(request_bytes(workload, first_number + i))
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the gateway answered {head.splitlines()[0].decode(errors='replace')}")
                length = re.search(rb"(?i)content-length: (\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                else:
                    await reader.readuntil(b"\r\n0\r\n\r\n")
        finally:
            writer.close()
    await asyncio.wait_for(asyncio.gather(*(connection(k) for k in range(CONNECTIONS))), timeout_s)


def gateway_argv(tree: Path, config: Path, prelude: str = "") -> list[str]:
    """The command that serves `config` with source tree `tree`'s gateway, `prelude` (Python
    source) run first in its process."""
    return [sys.executable, "-c", _LAUNCH.format(tree=str(tree), config=str(config), prelude=prelude)]


@contextlib.contextmanager
def counted_gateway(tree: Path, config: Path, port: int, counter: str, directory: Path):
    """The gateway of source tree `tree` on `port`, under the counter, once its replicas are ready;
    yields (process, the opcode counter's flag and output files)."""
    flag, out = directory / "opcodes.on", directory / "opcodes.txt"
    by_line = os.environ.get("REQUEST_COST_BY_LINE") == "1"  # opcodes per source line, not per function
    prelude = (_OPCODES_PRELUDE.format(flag=str(flag), out=str(out), by_line=by_line) if counter == "opcodes"
               else "")
    argv = gateway_argv(tree, config, prelude)
    if counter == "instructions":
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={directory / 'callgrind.out'}"] + argv
    with run_gateway(config, port, argv=argv, startup_timeout_s=READY_TIMEOUT_S,
                     ready_timeout_s=READY_TIMEOUT_S) as server:
        yield server.proc, (flag, out)


def count_one(tree: Path, policy: str, workload: str, counter: str, requests: int, stub_urls: list[str],
              directory: Path) -> dict:
    """One gateway, warmed up, then `requests` counted: {"per_request": ..., "calls": ..., "top": [...]}."""
    port = free_port()
    config = gateway_config(directory, policy, stub_urls, port)
    with counted_gateway(tree, config, port, counter, directory) as (proc, (flag, out)):
        timeout_s = 30 + requests * (0.5 if counter == "instructions" else 0.2)
        asyncio.run(send(port, workload, WARMUP_REQUESTS, 10_000_000, timeout_s))
        if counter == "instructions":
            subprocess.run(["callgrind_control", "--zero", str(proc.pid)], capture_output=True, check=True, timeout=60)
            asyncio.run(send(port, workload, requests, 20_000_000, timeout_s))
            before = set(directory.glob("callgrind.out.*"))
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], capture_output=True, check=True,
                           timeout=60)
            dumps = set(directory.glob("callgrind.out.*")) - before
            total = sum(_callgrind_total(path) for path in dumps)
            keep = os.environ.get("REQUEST_COST_KEEP")
            for path in directory.glob("callgrind.out*"):
                if keep and path in dumps:  # for callgrind_annotate: where the instructions went
                    Path(keep).mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, Path(keep) / f"{policy}-{workload}-{path.name}")
                path.unlink()
            return {"per_request": total / requests, "calls": None, "top": []}
        flag.touch()
        time.sleep(0.3)  # the watcher looks every 50 ms
        asyncio.run(send(port, workload, requests, 20_000_000, timeout_s))
        flag.unlink()
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rows = [line.split("\t") for line in out.read_text().splitlines()]
        out.unlink()
        return {"per_request": sum(int(r[0]) for r in rows) / requests,
                "calls": sum(int(r[1]) for r in rows) / requests,
                "top": [(int(r[0]) / requests, int(r[1]) / requests, f"{r[2]} {r[3]}") for r in rows[:int(os.environ.get("REQUEST_COST_TOP", "15"))]]}


def _callgrind_total(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    return 0


def worktree(revision: str, directory: Path, stack: contextlib.ExitStack) -> Path:
    """A checkout of `revision` with its compiled extensions: this checkout's where the revision
    has the same C source, else built there (`setup.py build_ext --inplace`, a few seconds a file).
    Removed from git's worktrees when `stack` closes."""
    path = directory / f"tree-{re.sub(r'[^A-Za-z0-9_.-]', '_', revision)}"
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-f", str(path), revision],
                   check=True, capture_output=True, text=True)
    stack.callback(subprocess.run, ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(path)],
                   capture_output=True)
    differ = False
    for built in REPO_ROOT.glob("*/_*.so"):  # every package's (a package left out ran its pure-Python fallback)
        package = built.parent.name
        source = Path(package) / (built.name.split(".")[0] + ".c")
        if not (path / source).exists():
            continue
        if (path / source).read_bytes() == (REPO_ROOT / source).read_bytes():
            shutil.copy(built, path / package / built.name)
        else:
            differ = True
    if differ:  # setup.py lists every extension; the ones copied in are up to date and not rebuilt
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True,
                       capture_output=True, text=True, timeout=600)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What one request costs the gateway, counted.")
    parser.add_argument("--counter", choices=("instructions", "opcodes"), default="instructions")
    parser.add_argument("--against", metavar="REV", help="also count this git revision, for a ratio")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--requests", type=int, help="counted requests per figure (300; 100 with --quick)")
    parser.add_argument("--quick", action="store_true", help="round_robin and a fixed prompt only")
    args = parser.parse_args(argv)
    policies = ["round_robin"] if args.quick else args.policies.split(",")
    workloads = ["fixed"] if args.quick else args.workloads.split(",")
    requests = args.requests or (100 if args.quick else 300)
    if requests < 1:
        parser.error("--requests: at least 1")
    for name in policies:
        if name not in POLICIES:
            parser.error(f"--policies: {name!r} is not one of {', '.join(POLICIES)}")
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"--workloads: {name!r} is not one of {', '.join(WORKLOADS)}")
    if args.counter == "instructions" and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("request_cost: --counter instructions needs valgrind (apt-get install valgrind); "
              "--counter opcodes needs nothing", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table
    console = Console()
    unit = "instructions" if args.counter == "instructions" else "opcodes"
    results: dict[tuple[str, str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-request-cost-") as scratch, contextlib.ExitStack() as stack:
        directory = Path(scratch)
        trees = {"this tree": REPO_ROOT}
        if args.against:
            trees[args.against] = worktree(args.against, directory, stack)
        stubs = [stack.enter_context(StubProcess(output_tokens=OUTPUT_TOKENS, stderr=subprocess.DEVNULL))
                 for _ in range(4)]
        started = time.monotonic()
        for policy in policies:
            for workload in workloads:
                for label, tree in trees.items():
                    result = count_one(tree, policy, workload, args.counter, requests, [s.url for s in stubs],
                                       directory)
                    results[(label, policy, workload)] = result
                    console.print(f"[{time.monotonic() - started:6.1f} s] {label}: {policy} {workload}: "
                                  f"{result['per_request']:,.0f} {unit}/request")
                    for per_request, calls, name in result["top"]:
                        console.print(f"      {per_request:8.0f} {unit} {calls:6.2f} calls  {name}")
    table = Table(title=f"{unit} per request ({requests} counted after {WARMUP_REQUESTS} warm-up, "
                        f"{CONNECTIONS} connections, 4 stubs, token-ID logging on)")
    table.add_column("policy")
    table.add_column("workload")
    for label in trees:
        table.add_column(label, justify="right")
    if args.against:
        table.add_column("ratio", justify="right")
    for policy in policies:
        for workload in workloads:
            row = [f"{results[(label, policy, workload)]['per_request']:,.0f}" for label in trees]
            if args.against:
                row.append(f"{results[('this tree', policy, workload)]['per_request'] / results[(args.against, policy, workload)]['per_request']:.3f}")
            table.add_row(policy, workload, *row)
    console.print(table)
    for (label, policy, workload), result in results.items():
        if label == "this tree":
            print(f"figure kvgate_{policy}_{workload}_{unit}_per_request: {result['per_request']:.0f}")
            if result["calls"] is not None:
                print(f"figure kvgate_{policy}_{workload}_python_calls_per_request: {result['calls']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
