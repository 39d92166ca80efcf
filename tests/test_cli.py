"""`kvgate up` end to end: replicas launched from YAML, gateway ready line, SIGTERM stops everything."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from tests.servers import REPO_ROOT, free_port, stop_process


def test_up_launches_replicas_serves_and_stops_them_on_sigterm(tmp_path):
    gateway_port, ports = free_port(), [free_port(), free_port()]
    config = tmp_path / "up.yaml"
    config.write_text(
        f"gateway: {{host: 127.0.0.1, port: {gateway_port}}}\nlogging: {{format: json}}\nreplicas:\n"
        + "".join(f"  - name: t{i}\n    url: http://127.0.0.1:{port}\n    model: tiny-served\n"
                  f"    launch: {{model: tiny, threads: 1}}\n" for i, port in enumerate(ports)))
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--config", str(config),
                                 "--startup-timeout-s", "120"], cwd=REPO_ROOT, stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: list[psutil.Process] = []
    try:
        ready = f"kvgate ready: http://127.0.0.1:{gateway_port}/v1 (model tiny-served, 2 replicas)"
        deadline = time.monotonic() + 150
        while ready not in log_path.read_text(errors="replace"):  # another process: poll its output
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        request = urllib.request.Request(
            f"http://127.0.0.1:{gateway_port}/v1/completions", method="POST",
            data=json.dumps({"model": "tiny-served", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 3 and answer["model"] == "tiny-served"
        output = log_path.read_text(errors="replace")
        logs_dir = Path(re.search(r"\(logs in (\S+); removed at a clean exit", output).group(1))
        assert sorted(p.name for p in logs_dir.iterdir()) == ["t0.log", "t1.log"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"replicas left running: {alive}"
        assert not logs_dir.exists()  # a clean exit leaves no temporary replica logs behind
        assert "replica logs kept" not in log_path.read_text(errors="replace")
    finally:
        stop_process(proc)
        for child in children:
            if child.is_running():
                child.kill()
