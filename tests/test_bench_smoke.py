"""The bench stub speaks vLLM's dialect well enough for the official `openai` client, and the load
generator records what it sent. Real processes on loopback; a few seconds in all."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from bench.loadgen import Phase, run_phase, summary
from bench.stub_backend import StubProcess
from tests.servers import free_port
from tokenization.bundle import TokenizerBundle


@pytest.fixture(scope="module")
def stub():
    with StubProcess(output_tokens=8) as process:
        yield process


@pytest.fixture(scope="module")
def client(stub):
    with openai.OpenAI(base_url=stub.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read()


def test_completion_carries_vllm_token_ids_and_usage(client):
    response = client.completions.create(model="stub", prompt="Hello, world!", max_tokens=5,
                                         extra_body={"return_token_ids": True})
    choice = response.choices[0]
    extra = choice.model_extra
    assert len(extra["token_ids"]) == 5 and choice.finish_reason == "length"
    assert extra["prompt_token_ids"] and response.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="stub", prompt="Hello, world!", max_tokens=5,
                                      extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]  # deterministic


def test_completion_without_return_token_ids_has_no_id_fields(client):
    choice = client.completions.create(model="stub", prompt="Hello", max_tokens=20).choices[0]
    assert "token_ids" not in (choice.model_extra or {})
    assert choice.finish_reason == "stop"  # the stub answers 8 tokens, fewer than asked for


def test_chat_puts_prompt_ids_at_top_level(client):
    response = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"return_token_ids": True})
    assert response.model_extra["prompt_token_ids"]
    assert len(response.choices[0].model_extra["token_ids"]) == 8
    assert response.choices[0].message.content and response.choices[0].message.role == "assistant"


def test_completion_stream_sends_prompt_ids_first_and_usage_last(client):
    chunks = list(client.completions.create(model="stub", prompt="Hello", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 4
    assert token_chunks[0].choices[0].model_extra["prompt_token_ids"]
    assert all(len(c.choices[0].model_extra["token_ids"]) == 1 for c in token_chunks)
    assert "prompt_token_ids" not in token_chunks[1].choices[0].model_extra
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_opens_with_role_and_prompt_ids(client):
    chunks = list(client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"]
    deltas = [c for c in chunks[1:] if c.choices]
    assert len(deltas) == 3 and all(c.choices[0].model_extra["token_ids"] for c in deltas)
    assert "".join(c.choices[0].delta.content for c in deltas)
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 3


def test_a_paced_stub_streams_each_token_a_decode_step_after_the_last():
    """--token-interval-ms: a streamed answer's events come that far apart, as an engine's decode
    steps do (bench.stream_relay relies on each token being its own read); a JSON answer is whole."""
    import time
    with StubProcess(output_tokens=5, token_interval_ms=60) as paced:
        with openai.OpenAI(base_url=paced.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
            arrived = []
            for chunk in c.completions.create(model="stub", prompt="Hello", max_tokens=5, stream=True):
                if chunk.choices:
                    arrived.append(time.monotonic())
            gaps = [b - a for a, b in zip(arrived, arrived[1:])]
            assert len(arrived) == 5 and min(gaps) > 0.04, gaps
            assert c.completions.create(model="stub", prompt="Hello", max_tokens=5).usage.completion_tokens == 5


def test_bad_json_and_unknown_model_are_openai_errors(stub, client):
    request = urllib.request.Request(stub.url + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    error = json.loads(caught.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_models_metrics_and_tokenizer_endpoints(stub, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["stub"] and models[0].model_extra["max_model_len"] > 0
    status, metrics = _get(stub.url + "/metrics")
    assert status == 200 and b'vllm:num_requests_waiting{model_name="stub"} 0.0' in metrics
    assert _get(stub.url + "/health")[0] == 200
    bundle = TokenizerBundle.from_payload(_get(stub.url + "/kvgate/tokenizer")[1])
    assert bundle.encode("Hello") and bundle.chat_template


def test_loadgen_open_loop_records_every_request(stub):
    body = {"model": "stub", "prompt": "Hello", "max_tokens": 4, "stream": True}
    phase = Phase(name="smoke", url=stub.url + "/v1/completions", body=body, mode="open", rate_rps=50,
                  duration_s=0.4, arrivals="fixed", timeout_s=10)
    result = asyncio.run(run_phase(phase))
    assert len(result.results) == 19  # evenly spaced, t < 0.4 s
    assert all(r.status == 200 and r.ttfb_s is not None and r.ttfb_s <= r.latency_s for r in result.results)
    assert summary(result)["errors"] == 0


def test_loadgen_takes_its_urls_in_turn(stub):
    """vs_routers' baseline without a router: the client spreads its requests over the backends
    itself, request i to urls[i % n] (here every other one to a port nobody listens on)."""
    body = {"model": "stub", "prompt": "Hello", "max_tokens": 2}
    dead = f"http://127.0.0.1:{free_port()}/v1/completions"
    for mode in ("open", "closed"):
        phase = Phase(name="turns", url=stub.url + "/v1/completions", body=body, mode=mode, rate_rps=50,
                      duration_s=0.2, arrivals="fixed", concurrency=1, count=6, timeout_s=10,
                      urls=[stub.url + "/v1/completions", dead])
        results = sorted(asyncio.run(run_phase(phase)).results, key=lambda r: r.scheduled_s)
        assert len(results) >= 6
        assert [r.status for r in results] == [200, 0] * (len(results) // 2) + [200] * (len(results) % 2)


def test_the_lean_router_relays_a_completion_and_logs_its_token_ids(stub, tmp_path):
    """vs_routers' lean reference does the work it is said to do: the stub's answer reaches the
    client without the token IDs it did not ask for, and one record per request carries both ID
    lists, the prompt's as the stub counted them."""
    from tests.servers import run_process

    port, log = free_port(), tmp_path / "lean.jsonl"
    argv = [sys.executable, "-m", "bench.lean_router", "--port", str(port), "--backend", stub.url,
            "--log-file", str(log)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="lean-router"):
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=10) as lean:
            answers = [lean.completions.create(model="stub", prompt=f"Hello number {i}", max_tokens=3)
                       for i in range(3)]
        direct = urllib.request.urlopen(urllib.request.Request(
            stub.url + "/v1/completions", data=json.dumps(
                {"model": "stub", "prompt": "Hello number 2", "max_tokens": 3, "return_token_ids": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=10)
        expected = json.loads(direct.read())
    assert [a.choices[0].finish_reason for a in answers] == ["length"] * 3
    assert "token_ids" not in answers[2].choices[0].model_dump_json()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # stopped: every line written
    assert len(records) == 3 and all(r["event"] == "request" and r["status"] == 200 for r in records)
    assert records[2]["prompt_token_ids"] == expected["choices"][0]["prompt_token_ids"]
    assert records[2]["output_token_ids"] == expected["choices"][0]["token_ids"]
    assert answers[2].choices[0].text == expected["choices"][0]["text"]


def test_the_layers_bench_lean_path_goes_through_the_gateways_own_parts(stub, tmp_path):
    """bench/layers.py's second listener serves through the gateway's router, upstream client and
    request log: the answer comes back and the gateway writes the request's one record, with its
    routing explanation and token IDs, as it does for its own path."""
    from bench.vs_routers import gateway_config
    from tests.servers import run_process

    port, lean_port = free_port(), free_port()
    config = gateway_config(tmp_path, "cache_aware", [stub.url], port)
    argv = [sys.executable, "-m", "bench.layers", "--serve", str(config), "--lean-port", str(lean_port)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="layers") as server:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{lean_port}/v1", api_key="unused", max_retries=0,
                           timeout=10) as lean:
            response = lean.completions.with_raw_response.create(model="stub", prompt="Hello there", max_tokens=3)
        request_id = response.headers["x-request-id"]
        assert response.parse().choices[0].finish_reason == "length"
        deadline = time.monotonic() + 10
        while request_id not in server.logs() and time.monotonic() < deadline:
            time.sleep(0.05)
        records = [json.loads(line) for line in server.logs().splitlines()
                   if line.startswith("{") and request_id in line]
    assert len(records) == 1, records
    record = records[0]
    assert record["event"] == "request" and record["status"] == 200 and record["replica"] == "stub-0"
    assert record["routing"]["policy"] == "cache_aware" and record["routing"]["chosen"] == "stub-0"
    assert len(record["output_token_ids"]) == 3 and record["prompt_token_ids"]


def test_every_bench_script_runs_the_way_the_readmes_show():
    """README.md and bench/README.md show one way to run a bench (`python -m bench.NAME`); every
    script under bench/ is documented that way and answers `--help` when run so."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    docs = (root / "README.md").read_text() + (root / "bench" / "README.md").read_text()
    assert not re.search(r"python3? bench/[a-z_]+\.py", docs), "a README runs a bench script by its path"
    shown = set(re.findall(r"python -m bench\.(\w+)", docs))
    scripts = {p.stem for p in (root / "bench").glob("*.py") if "__main__" in p.read_text()}
    assert scripts and scripts <= shown, f"not shown as `python -m bench.NAME`: {sorted(scripts - shown)}"
    for name in sorted(scripts):
        done = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=root,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (name, done.stderr[-500:])


def test_request_cost_counts_a_real_gateways_python_work_per_request():
    """bench.request_cost's opcode counter, through a real gateway over the stubs: a per-request
    figure in the range a routed, logged request takes, with the proxy's own functions on top."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "bench.request_cost", "--counter", "opcodes", "--quick",
                           "--requests", "50"], cwd=root, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    opcodes = int(re.search(r"figure kvgate_round_robin_fixed_opcodes_per_request: (\d+)", done.stdout).group(1))
    calls = float(re.search(r"figure kvgate_round_robin_fixed_python_calls_per_request: ([\d.]+)",
                            done.stdout).group(1))
    assert 1_000 < opcodes < 50_000 and 20 < calls < 2_000, (opcodes, calls)
    assert "proxy.py" in done.stdout and "hot_path.py" in done.stdout  # the top functions are the request path's


def test_request_cost_counts_another_revision_with_every_compiled_extension(tmp_path):
    """`bench.request_cost --against REV` checks REV out beside this tree and copies in this tree's
    compiled extensions: every one whose C source REV has, in any package. One left out runs its
    pure-Python fallback there and flatters every ratio (protocol/_strip_ids was, for a session)."""
    import contextlib

    from bench.request_cost import REPO_ROOT, worktree

    built = [p.relative_to(REPO_ROOT) for p in REPO_ROOT.glob("*/_*.so")
             if (p.parent / (p.name.split(".")[0] + ".c")).exists()]
    if not built:
        pytest.skip("no compiled extension in this checkout (no C compiler at install)")
    with contextlib.ExitStack() as stack:  # the worktree is removed when it closes
        path = worktree("HEAD", tmp_path, stack)
        assert [str(b) for b in built if not (path / b).exists()] == []


def test_a_capped_process_gets_its_share_of_a_core_and_its_cgroup_goes_away_after():
    """bench.cpu_caps, which bench.cache_routing puts each replica under: a busy loop capped at
    0.2 of a core spends at most about 0.2 s of CPU per second, where uncapped it would spend about 1.
    The group gets the default weight here (shares=None): the bench's low cpu.shares let other work
    go first, and beside the rest of the suite a capped loop then got 0.0997 and 0.013 of a core in
    two clean-clone runs, what the weight is for and no sign of a broken cap."""
    import subprocess
    import sys
    import time

    from bench.cpu_caps import CpuCaps
    from bench.loadgen import process_cpu_s

    with CpuCaps(0.2, shares=None) as caps:
        if caps.unavailable:
            pytest.skip(caps.unavailable)
        spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"])
        try:
            assert caps.cap(spin.pid), caps.unavailable
            time.sleep(0.3)
            cpu0, wall0 = process_cpu_s(spin.pid), time.monotonic()
            time.sleep(1.5)
            share = (process_cpu_s(spin.pid) - cpu0) / (time.monotonic() - wall0)
        finally:
            spin.kill()
            spin.wait()
        groups = caps.groups
    assert 0.05 < share < 0.3, share
    assert groups and not any(g.exists() for g in groups)


# Each thread spins in hashlib, which releases the GIL for large inputs: what each thread gets is
# then the scheduler's doing, not the GIL's.
SPIN_TWO_THREADS = """
import hashlib, threading, time
from replica.cpu_policy import apply_to_current_thread
end = time.time() + 30
data = bytes(1 << 20)
def spin(compute):
    apply_to_current_thread("batch", lower_priority=compute)  # as the replica's engine / HTTP thread
    while time.time() < end:
        hashlib.sha256(data).digest()
threading.Thread(target=spin, args=(True,), daemon=True).start()
spin(False)
"""


def _thread_cpu_s(pid: int, tid: int) -> float:
    import os
    raw = open(f"/proc/{pid}/task/{tid}/stat", "rb").read()
    fields = raw[raw.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_only_a_replicas_compute_threads_are_capped():
    """A process with the built-in replica's two kinds of thread (replica/cpu_policy.py): a compute
    one (SCHED_BATCH at a raised nice value, its engine) and its HTTP thread (SCHED_BATCH at the
    process's nice value): the cap holds the compute thread to its share and leaves the other free.
    The default weight for the group, as in the test above."""
    import os
    import subprocess
    import sys
    import time

    from bench.cpu_caps import CpuCaps, compute_threads

    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("Linux scheduling policies")
    with CpuCaps(0.2, shares=None) as caps:
        if caps.unavailable:
            pytest.skip(caps.unavailable)
        spin = subprocess.Popen([sys.executable, "-c", SPIN_TWO_THREADS], cwd=Path(__file__).resolve().parents[1])
        try:
            deadline = time.monotonic() + 10
            while not compute_threads(spin.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            (batch,) = compute_threads(spin.pid)
            assert caps.cap(spin.pid), caps.unavailable
            assert caps.scope == "compute threads"
            time.sleep(0.3)
            before, wall0 = {t: _thread_cpu_s(spin.pid, t) for t in (spin.pid, batch)}, time.monotonic()
            time.sleep(1.5)
            wall = time.monotonic() - wall0
            share = {t: (_thread_cpu_s(spin.pid, t) - cpu) / wall for t, cpu in before.items()}
        finally:
            spin.kill()
            spin.wait()
        groups = caps.groups
    assert 0.05 < share[batch] < 0.3, share
    assert share[spin.pid] > 0.3, share  # the normal thread is not held to the cap (0.43 beside the suite)
    assert groups and not any(g.exists() for g in groups)


def test_lone_stages_finds_every_stage_of_the_gateways_hot_path():
    """bench.lone_stages wraps the hot path's methods by name in a real gateway: each step it
    names must show up between a request's send and its first byte (a renamed method would
    leave a step out, and the bench would silently measure less)."""
    import re
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "bench.lone_stages", "--requests", "30", "--gap-ms", "1"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"TTFB p50: direct \d+ us, through kvgate \d+ us", out), out
    for step in ("client sends -> read", "read -> serve", "serve -> up_write", "up_write -> up_written"):
        assert step in out, out
    assert "-> out" in out and "out -> client's first byte" in out, out
    assert re.search(r"events in the replica's first read: \d+: \d+", out), out
