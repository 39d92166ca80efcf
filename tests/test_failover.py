"""Failover that loses nothing, against real processes on loopback: `kvgate up` with tiny replicas
that the tests kill (SIGKILL), freeze (SIGSTOP) or make fail, and the answers compared token for
token with what the same requests get when nothing fails."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from datetime import datetime

import httpx2 as httpx
import pytest

from bench.stub_backend import StubProcess
from tests.servers import free_port, run_gateway, run_process, run_replica
from tests.test_cache_routing import poll
from tests.test_gateway import Gateway, http, metric

FAST_HEALTH = ("health: {probe_interval_s: 0.3, probe_timeout_s: 0.5, healthy_threshold: 2, unhealthy_threshold: 2,\n"
               "         eject_base_s: 1, restart_backoff_s: 0.5}\n")
TIMEOUT = httpx.Timeout(60.0)


class Up:
    """`kvgate up` over N launched tiny replicas (names r0..), with short timeouts for failure tests."""

    def __init__(self, server, names: list[str]) -> None:
        self.server = server
        self.url = server.url
        self.names = names
        self.gateway = Gateway(server, [])

    def admin(self) -> dict:
        return {entry["name"]: entry for entry in http("GET", self.url + "/admin/replicas")[2]["replicas"]}

    def pid(self, name: str) -> int:
        return self.admin()[name]["process"]["pid"]

    def replica_url(self, name: str) -> str:
        return self.admin()[name]["url"]

    def serving(self, within_s: float | None = None) -> str | None:
        """The replica that runs a request now: the gateway has it in flight there and the
        replica's engine is running it (a replica that has just finished another request can
        still read running for a moment; the gateway's count alone comes before the prefill).
        `within_s`: None when no replica runs it within that time (the request may be done
        already) instead of failing after 20 s."""
        def busy():
            admin = self.admin()
            for name in self.names:
                if admin[name]["in_flight"] < 1:
                    continue
                with contextlib.suppress(Exception):
                    text = http("GET", self.replica_url(name) + "/metrics")[2]
                    if metric(text, "vllm:num_requests_running") > 0:
                        return name
            return None
        if within_s is None:
            return poll(busy, "a replica running the request", self.server, timeout_s=20)
        deadline = time.monotonic() + within_s
        while (name := busy()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return name

    def wait_all_healthy(self) -> None:
        """Every replica healthy in the gateway's eyes and alive in fact: a replica an earlier test
        killed can still read healthy until the next probe, while its pid is already gone."""
        def alive(entry) -> bool:
            if not entry.get("process", {}).get("running", True):
                return False
            with contextlib.suppress(Exception):
                return http("GET", entry["url"] + "/health")[0] == 200
            return False
        poll(lambda: all(e["state"] == "healthy" and e["ready"] and alive(e) for e in self.admin().values()),
             "every replica healthy", self.server, timeout_s=60)


def up_config(port: int, names: list[str], policy: str = "round_robin") -> str:
    return (f"gateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 1, ttft_timeout_s: 3,\n"
            f"          inter_token_timeout_s: 1, drain_grace_s: 20}}\n" + FAST_HEALTH
            + f"logging: {{format: json}}\nrouting: {{policy: {policy}}}\nreplicas:\n"
            + "".join(f"  - {{name: {name}, url: 'http://127.0.0.1:{free_port()}', model: tiny, "
                      f"launch: {{model: tiny}}}}\n" for name in names))


@contextlib.contextmanager
def kvgate_up(tmp_path, replicas: int = 2, policy: str = "round_robin"):
    port = free_port()
    names = [f"r{i}" for i in range(replicas)]
    config = tmp_path / "up.yaml"
    config.write_text(up_config(port, names, policy))
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(config), "--replica-logs",
            str(tmp_path / "replica-logs")]  # replicas die here: their logs are kept, in tmp_path
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up",
                     startup_timeout_s=120) as server:
        up = Up(server, names)
        up.config_path = config
        up.wait_all_healthy()
        yield up


def stream(url: str, path: str, body: dict, request_id: str, on_chunk=None) -> dict:
    """Read a streamed answer as an SSE client does: text, token IDs, usage, in-band error, [DONE]s."""
    out = {"text": "", "ids": [], "usage": None, "error": None, "done": 0, "roles": 0, "events": 0}
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", url + path, json={**body, "stream": True},
                           headers={"x-request-id": request_id}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] += 1
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                out["usage"] = chunk.get("usage") or out["usage"]
                for choice in chunk.get("choices") or []:
                    out["events"] += 1
                    delta = choice.get("delta") or {}
                    out["roles"] += "role" in delta
                    out["text"] += delta.get("content") or choice.get("text") or ""
                    out["ids"] += choice.get("token_ids") or []
                if on_chunk is not None:
                    on_chunk(out)
    return out


def answer(url: str, path: str, body: dict, request_id: str) -> dict:
    status, _, reply = http("POST", url + path, body, {"x-request-id": request_id})
    assert status == 200, reply
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {"text": text, "ids": choice.get("token_ids"), "usage": reply["usage"]}


def body_for(path: str, n: int, max_tokens: int = 160) -> dict:
    common = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True, "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        return {**common, "messages": [{"role": "user", "content": f"Tell me story number {n} about a fox."}]}
    return {**common, "prompt": f"Story number {n}: the quick brown fox"}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with kvgate_up(tmp_path_factory.mktemp("failover")) as cluster:
        yield cluster


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_stream_resumes_token_exactly_when_its_replica_dies_or_stalls(up, path, fault):
    # The fault lands once the client has 20 of 160 tokens. On a loaded host the client can lag so far
    # behind that the replica has written all 160 by then: the answer then completes without a try
    # to resume (or no replica runs it any more to fault), which proves nothing about resuming. Such
    # a run is checked and tried again (3 at most).
    record, frozen = _resumed(lambda: _stream_with_fault(up, path, fault))
    failover = record["failover"][0]
    assert failover["replica"] == frozen[0][0] and failover["after_tokens"] >= 20
    assert failover["resumed_on"] != frozen[0][0] and failover["resume_ms"] > 0
    assert failover["reason"] == "stalled" if fault == "stop" else failover["reason"].startswith("disconnected")


def test_a_stream_that_asks_for_no_token_ids_or_usage_resumes_token_exactly(up):
    # a client far behind its replica sees no fault to resume from: again (see above)
    record, frozen = _resumed(lambda: _stream_with_fault(up, "/v1/completions", "kill", plain=True))
    assert record["failover"][0]["replica"] == frozen[0][0]
    assert record["completion_tokens"] == 160 and record["cached_tokens"] is not None  # the usage it did not ask for


def _resumed(attempt) -> tuple[dict, list]:
    """The first of 3 faulted streams whose fault landed while the replica was still answering."""
    for _ in range(3):
        record, frozen = attempt()
        if frozen and "failover" in record:
            return record, frozen
    raise AssertionError(f"3 streams finished before their fault could land; the last: {record}")


def _stream_with_fault(up, path: str, fault: str, plain: bool = False) -> tuple[dict, list]:
    """One streamed request whose replica is killed or stopped after 20 tokens: the client's answer
    is checked against a reference; returns its record and the (replica, pid) faulted, none when
    no replica was running it any more once the client had 20 tokens. `plain`: the
    client asks for neither token IDs nor usage (the gateway then sends the replica the client's
    bytes with its own two fields spliced in, and builds the resumed try's body from them)."""
    up.wait_all_healthy()
    n = random.randrange(10**6)
    reference = answer(up.url, path, {**body_for(path, n), "stream": False}, f"ref-{fault}-{n}")
    frozen, tried = [], []
    body = body_for(path, n)
    if plain:
        del body["return_token_ids"], body["stream_options"]

    def inject(progress):
        # A plain client gets no token IDs: its events count them (completions: one a token).
        if (progress["events"] if plain else len(progress["ids"])) >= 20 and not tried:
            tried.append(True)
            if (name := up.serving(within_s=3)) is None:
                return  # the replica has finished: nothing to fault
            pid = up.pid(name)
            os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            frozen.append((name, pid))

    request_id = f"resume-{fault}-{n}"
    try:
        got = stream(up.url, path, body, request_id, inject)
    finally:
        if fault == "stop" and frozen:
            os.kill(frozen[0][1], signal.SIGCONT)
    assert tried, "the stream never reached 20 tokens"
    assert got["error"] is None and got["done"] == 1 and got["roles"] <= 1
    assert got["text"] == reference["text"]  # nothing lost, nothing twice
    if plain:  # what it did not ask for, it does not get
        assert got["ids"] == [] and got["usage"] is None
    else:
        assert got["ids"] == reference["ids"] and got["usage"]["completion_tokens"] == 160 == len(got["ids"])
    record = up.gateway.record(request_id)
    assert record["status"] == 200 and record["output_token_ids"] == reference["ids"]
    return record, frozen


def set_resume_non_stream(up: Up, on: bool) -> None:
    """gateway.resume_non_stream in the cluster's YAML, hot-reloaded: returns once it is live."""
    text = up.config_path.read_text()
    head, _, rest = text.partition("drain_grace_s: 20")
    rest = rest.split("}", 1)[1]
    applied = lambda: metric(http("GET", up.url + "/metrics")[2], "kvgate_config_reloads_total",
                             result="applied")
    before = applied()
    tmp = up.config_path.with_suffix(".tmp")
    tmp.write_text(f"{head}drain_grace_s: 20, resume_non_stream: {str(on).lower()}}}{rest}")
    os.replace(tmp, up.config_path)
    poll(lambda: applied() > before, "the reload applied", up.server, timeout_s=20)


@pytest.mark.parametrize("path, resume", [("/v1/completions", True), ("/v1/chat/completions", True),
                                          ("/v1/completions", False)])
def test_a_non_streamed_answer_resumes_or_starts_over(up, path, resume):
    """gateway.resume_non_stream: true collects a non-streamed answer from a streamed replica, so a
    kill mid-answer resumes it from the tokens made; false (the default) passes the replica's JSON
    through and tries it again from scratch. Either way the client gets the whole, same answer."""
    set_resume_non_stream(up, resume)
    up.wait_all_healthy()
    n = random.randrange(10**6)
    body = {**body_for(path, n, max_tokens=1200), "stream": False}  # ~0.7 s idle: the kill lands mid-answer
    reference = answer(up.url, path, body, f"ref-json-{n}")
    killed = []

    def kill_when_busy():
        name = up.serving()
        time.sleep(0.05)  # some tokens out (an idle tiny replica makes ~2 a ms)
        os.kill(up.pid(name), signal.SIGKILL)
        killed.append(name)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    got = answer(up.url, path, body, f"json-kill-{n}")
    killer.join()
    assert got["ids"] == reference["ids"] and got["text"] == reference["text"]
    assert got["usage"]["completion_tokens"] == 1200
    record = up.gateway.record(f"json-kill-{n}")
    assert record["failover"][0]["replica"] == killed[0]
    if resume:
        assert record["failover"][0]["after_tokens"] > 0
    else:
        assert record["failover"][0]["after_tokens"] == 0 and record["output_token_ids"] == got["ids"]
    set_resume_non_stream(up, False)


def test_a_replica_that_hangs_before_answering_is_tried_elsewhere(up):
    up.wait_all_healthy()
    frozen = up.pid("r0")
    os.kill(frozen, signal.SIGSTOP)
    try:
        ids = [f"hang-{random.randrange(10**9)}-{i}" for i in range(4)]
        for request_id in ids:  # round robin sends one of them to r0 before probes eject it
            got = stream(up.url, "/v1/completions", body_for("/v1/completions", 1, max_tokens=8), request_id)
            assert got["error"] is None and len(got["ids"]) == 8
        records = [up.gateway.record(request_id) for request_id in ids]
        assert all(r["status"] == 200 and r["replica"] == "r1" for r in records)
        reasons = [f["reason"] for r in records for f in r.get("failover") or []]
        assert "no first token within ttft_timeout_s" in reasons or up.admin()["r0"]["state"] == "ejected"
    finally:
        os.kill(frozen, signal.SIGCONT)


def test_chaos_kill_and_freeze_under_load_loses_nothing(tmp_path):
    """3 replicas under `kvgate up`, 300 requests (half streamed, greedy) at concurrency 32; one
    replica SIGKILLed mid-run (the supervisor restarts it), another SIGSTOPped for 3 s."""
    with kvgate_up(tmp_path, replicas=3) as cluster:
        requests = []
        for n in range(300):
            path = "/v1/chat/completions" if n % 3 == 0 else "/v1/completions"
            requests.append((n, path, n % 2 == 0, body_for(path, n, max_tokens=24 + n % 17)))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the no-fault answers (greedy: batch-invariant)
            reference = dict(pool.map(lambda item: (item[0], answer(cluster.url, item[1], {**item[3], "stream": False},
                                                                      f"chaos-ref-{item[0]}")), requests))

        started = threading.Event()

        def run(item):
            n, path, streamed, body = item
            started.set()
            if streamed:
                return n, stream(cluster.url, path, body, f"chaos-{n}")
            return n, {**answer(cluster.url, path, {**body, "stream": False}, f"chaos-{n}"), "error": None,
                       "done": 1, "roles": 0}

        def faults():
            started.wait(30)
            time.sleep(1.0)
            os.kill(cluster.pid("r0"), signal.SIGKILL)
            time.sleep(0.5)
            frozen = cluster.pid("r1")
            os.kill(frozen, signal.SIGSTOP)
            time.sleep(3.0)
            os.kill(frozen, signal.SIGCONT)

        fault_thread = threading.Thread(target=faults)
        fault_thread.start()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = dict(pool.map(run, requests))
        fault_thread.join()

        for n, path, streamed, _ in requests:
            got, want = results[n], reference[n]
            assert got["error"] is None and got["done"] == 1 and got["roles"] <= 1, (n, got)
            assert got["ids"] == want["ids"] and got["text"] == want["text"], n  # nothing lost or doubled
        records = {n: cluster.gateway.record(f"chaos-{n}") for n in results}
        assert all(r["status"] == 200 for r in records.values())
        assert any(r.get("failover") for r in records.values())  # the faults did hit requests
        # The killed replica is back (restarted by the supervisor) and serving.
        cluster.wait_all_healthy()
        assert cluster.admin()["r0"]["process"]["restarts_last_minute"] >= 1
        for n in range(6):
            stream(cluster.url, "/v1/completions", body_for("/v1/completions", n, max_tokens=4), f"after-{n}")
        assert "r0" in {cluster.gateway.record(f"after-{n}")["replica"] for n in range(6)}
        text = http("GET", cluster.url + "/metrics")[2]
        poll(lambda: metric(http("GET", cluster.url + "/metrics")[2], "kvgate_requests_in_flight") == 0,
             "in-flight gauges back to 0", cluster.server)
        assert metric(text, "kvgate_replica_restarts_total", replica="r0") >= 1


def test_retries_skip_a_failing_replica_then_stop_when_every_replica_fails(tmp_path):
    with contextlib.ExitStack() as stack:
        failing = [stack.enter_context(StubProcess(model="tiny", fail_status=500)) for _ in range(2)]
        good = stack.enter_context(run_replica("tiny"))
        port = free_port()
        config = tmp_path / "gw.yaml"

        def write(urls):
            config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, max_attempts: 3}}\n" + FAST_HEALTH
                              + "logging: {format: json}\nrouting: {policy: round_robin}\nreplicas:\n"
                              + "".join(f"  - {{name: {name}, url: '{url}', model: tiny}}\n" for name, url in urls))
        write([("bad0", failing[0].url), ("good", good.url)])
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            for i in range(4):
                got = answer(server.url, "/v1/completions", {**body_for("/v1/completions", i, 4), "stream": False},
                             f"skip-{i}")
                assert len(got["ids"]) == 4
            records = [gateway.record(f"skip-{i}") for i in range(4)]
            assert all(r["replica"] == "good" for r in records)
            assert records[0]["failover"][0]["reason"].startswith("HTTP 500 from bad0")
        write([("bad0", failing[0].url), ("bad1", failing[1].url)])
        with run_gateway(config, port) as server:
            gateway = Gateway(server, [])
            status, headers, reply = http("POST", server.url + "/v1/completions",
                                          {**body_for("/v1/completions", 0, 4), "stream": False},
                                          {"x-request-id": "exhausted"})
            assert status == 500 and reply["error"]["message"] == "stub configured to fail with 500"
            record = gateway.record("exhausted")
            assert record["status"] == 500 and len(record["failover"]) == 3  # bounded: max_attempts


def one_slot_gateway(tmp_path, replica, queue_size: int):
    """A gateway over `replica` (as r0) that lets one request at a time run there and queues
    `queue_size` more."""
    port = free_port()
    config = tmp_path / "gw.yaml"
    config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, max_in_flight_per_replica: 1, "
                      f"queue_size: {queue_size}}}\n" + FAST_HEALTH + "logging: {format: json}\nreplicas:\n"
                      f"  - {{name: r0, url: '{replica.url}', model: tiny}}\n")
    return run_gateway(config, port)


def test_no_healthy_replica_is_a_503_and_a_full_queue_a_429(tmp_path):
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(run_replica("tiny"))
        server = stack.enter_context(one_slot_gateway(tmp_path, replica, queue_size=0))
        long = threading.Thread(target=stream, args=(server.url, "/v1/completions",
                                                     body_for("/v1/completions", 1, 1500), "long"))
        long.start()
        poll(lambda: http("GET", server.url + "/admin/replicas")[2]["replicas"][0]["in_flight"] == 1,
             "the long request in flight", server)
        status, headers, reply = http("POST", server.url + "/v1/completions",
                                      {**body_for("/v1/completions", 2, 4), "stream": False})
        assert status == 429 and headers["Retry-After"] == "1" and reply["error"]["type"] == "rate_limit_error"
        long.join()
        os.kill(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait()
        poll(lambda: http("GET", server.url + "/admin/replicas")[2]["replicas"][0]["state"] == "ejected",
             "r0 ejected", server)
        status, headers, reply = http("POST", server.url + "/v1/completions",
                                      {**body_for("/v1/completions", 3, 4), "stream": False})
        assert status == 503 and headers["Retry-After"] == "1" and "No healthy replica" in reply["error"]["message"]


def test_requests_queued_for_room_go_as_soon_as_a_try_ends(tmp_path):
    """At max_in_flight_per_replica, requests wait in the gateway's queue and each goes the moment
    the one ahead of it ends (not at the queue's next 0.5 s re-check), every one answered."""
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(run_replica("tiny"))
        server = stack.enter_context(one_slot_gateway(tmp_path, replica, queue_size=8))
        gateway = Gateway(server, [])
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda i: stream(server.url, "/v1/completions", body_for("/v1/completions", i, 24),
                                                     f"queued-{i}"), range(5)))
        assert all(a["done"] == 1 and len(a["ids"]) == 24 and a["error"] is None for a in answers)
        spans = []  # (routed, finished) in wall-clock seconds, from each record
        for i in range(5):
            record = gateway.record(f"queued-{i}")
            finished = datetime.fromisoformat(record["timestamp"]).timestamp()
            started = finished - record["e2e_ms"] / 1000
            spans.append((started + record["routed_ms"] / 1000, finished))
        spans.sort()
        waits = [routed - spans[n - 1][1] for n, (routed, _) in enumerate(spans) if n]
        assert max(waits) < 0.1, waits  # woken by the try's end; the 0.5 s re-check would leave gaps


def test_drain_takes_a_replica_out_without_dropping_its_requests_and_sigterm_drains_the_gateway(up):
    up.wait_all_healthy()
    results = {}

    def long_stream():
        results["long"] = stream(up.url, "/v1/completions", body_for("/v1/completions", 7, 600), "drain-long")
    runner = threading.Thread(target=long_stream)
    runner.start()
    busy = up.serving()
    status, _, reply = http("POST", up.url + f"/admin/replicas/{busy}/drain")
    assert status == 200 and reply["state"] == "draining" and reply["in_flight"] == 1
    for i in range(4):
        stream(up.url, "/v1/completions", body_for("/v1/completions", i, 4), f"while-draining-{i}")
        assert up.gateway.record(f"while-draining-{i}")["replica"] != busy
    runner.join()
    assert results["long"]["error"] is None and len(results["long"]["ids"]) == 600
    assert up.gateway.record("drain-long")["replica"] == busy and "failover" not in up.gateway.record("drain-long")
    status, _, reply = http("POST", up.url + f"/admin/replicas/{busy}/undrain")
    assert status == 200 and reply["state"] in ("healthy", "probing")
    status, _, reply = http("POST", up.url + "/admin/replicas/nobody/drain")
    assert status == 404 and reply["error"]["code"] == "replica_not_found"


def test_sigterm_finishes_requests_in_flight_before_the_replicas_stop(tmp_path):
    with kvgate_up(tmp_path) as cluster:
        results = {}
        runner = threading.Thread(target=lambda: results.update(
            long=stream(cluster.url, "/v1/completions", body_for("/v1/completions", 9, 500), "sigterm-long")))
        runner.start()
        cluster.serving()
        pids = [cluster.pid(name) for name in cluster.names]
        cluster.server.proc.send_signal(signal.SIGTERM)
        runner.join()
        assert results["long"]["error"] is None and len(results["long"]["ids"]) == 500 and results["long"]["done"] == 1
        assert cluster.server.proc.wait(timeout=30) == 0
        for pid in pids:  # stopped after the drain
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        logs = cluster.server.logs()
        assert '"gateway_draining"' in logs and '"gateway_stopped"' in logs


def test_a_reload_launches_added_replicas_and_stops_removed_ones_under_load(tmp_path):
    with kvgate_up(tmp_path) as cluster:
        removed_pid = cluster.pid("r1")
        results, stop = [], threading.Event()

        def load(worker: int):
            n = 0
            while not stop.is_set() and n < 200:
                results.append(stream(cluster.url, "/v1/completions", body_for("/v1/completions", n, 12),
                                      f"reload-{worker}-{n}"))
                n += 1
        workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
        for worker in workers:
            worker.start()
        time.sleep(1.0)
        text = cluster.config_path.read_text()
        r1_line = next(line for line in text.splitlines() if "name: r1," in line)
        r2_line = r1_line.replace("name: r1,", "name: r2,").replace(
            r1_line.split("'")[1], f"http://127.0.0.1:{free_port()}")
        tmp = cluster.config_path.with_suffix(".tmp")
        tmp.write_text(text.replace(r1_line, r2_line))
        os.replace(tmp, cluster.config_path)
        cluster.names = ["r0", "r2"]
        poll(lambda: set(cluster.admin()) == {"r0", "r2"} and cluster.admin()["r2"]["state"] == "healthy",
             "r2 launched and healthy", cluster.server, timeout_s=60)
        time.sleep(1.0)  # r2 takes its share of the load
        stop.set()
        for worker in workers:
            worker.join()
        assert results and all(r["error"] is None and len(r["ids"]) == 12 for r in results)
        poll(lambda: _gone(removed_pid), "r1's process stopped", cluster.server)
        served = {r["replica"] for r in cluster.gateway.records() if r["request_id"].startswith("reload-")}
        assert "r2" in served
        logs = cluster.server.logs()
        assert '"replica_launched"' in logs and '"replica_stopped"' in logs


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(ChildProcessError):  # a zombie until its parent reaps it
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    return open(f"/proc/{pid}/stat").read().split()[2] == "Z"


class Blackhole:
    """A TCP forwarder to a real replica that can stop answering: it stops accepting, drops the
    connections it carries, and fills its accept queue, so a new connection's SYN goes unanswered
    (what a partitioned or wedged host looks like: a connect timeout, not a refusal)."""

    def __init__(self, target_port: int) -> None:
        import socket
        self.socket_mod = socket
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.pairs: list = []
        self.open = True
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        socket = self.socket_mod
        while self.open:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(1)

    def cut(self) -> None:
        socket = self.socket_mod
        self.open = False
        for a, b in self.pairs:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    # shutdown first: a bare close() leaves the socket open while its pipe thread
                    # is blocked in recv on it (no FIN), and a pooled connection through it would
                    # look alive to the gateway
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
        # Stop accepting for good (the thread takes one last connection, closes it and ends), then
        # fill the accept queue until a connect goes unanswered: from then on every SYN is dropped.
        # (Filling it while the thread still accepted could leave a slot free: a CI run saw the
        # gateway's connect land there, its request never read, waiting 30 s for a first token.)
        self.fillers = [socket.create_connection(("127.0.0.1", self.port), timeout=5)]
        self.thread.join(5)
        for _ in range(16):
            filler = socket.socket()
            filler.settimeout(0.3)
            self.fillers.append(filler)
            try:
                filler.connect(("127.0.0.1", self.port))
            except OSError:  # unanswered: the queue is full
                return
        raise AssertionError("the blackhole's accept queue never filled")

    def close(self) -> None:
        self.open = False
        for sock in [self.listener, *getattr(self, "fillers", [])]:
            with contextlib.suppress(OSError):
                sock.close()


def test_a_connect_timeout_is_tried_on_another_replica(tmp_path):
    with contextlib.ExitStack() as stack:
        first, second = (stack.enter_context(run_replica("tiny")) for _ in range(2))
        hole = Blackhole(first.port)
        stack.callback(hole.close)
        port = free_port()
        config = tmp_path / "gw.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 0.5}}\n"
                          "health: {probe_interval_s: 30}\nlogging: {format: json}\nrouting: {policy: round_robin}\n"
                          f"replicas:\n  - {{name: walled, url: 'http://127.0.0.1:{hole.port}', model: tiny}}\n"
                          f"  - {{name: open, url: '{second.url}', model: tiny}}\n")
        server = stack.enter_context(run_gateway(config, port))
        gateway = Gateway(server, [])
        hole.cut()
        time.sleep(0.2)  # the gateway's pooled connections to it see their end
        for i in range(2):
            got = answer(server.url, "/v1/completions", {**body_for("/v1/completions", i, 4), "stream": False},
                         f"walled-{i}")
            assert len(got["ids"]) == 4
        records = [gateway.record(f"walled-{i}") for i in range(2)]
        assert all(r["replica"] == "open" and r["status"] == 200 for r in records)
        reasons = [f["reason"] for r in records for f in r.get("failover") or []]
        assert any(reason.startswith("connect:") and "imeout" in reason for reason in reasons), reasons


@pytest.mark.parametrize("fault", ["crash", "stall"])
def test_an_engine_that_dies_or_stalls_is_ejected_and_its_stream_resumes(tmp_path, fault):
    """The replica process stays up (or exits only after answering) while its engine thread is
    gone or hung: /health says so (503, the reason), the gateway ejects it, and the stream it was
    serving continues on the other replica, token for token."""
    with contextlib.ExitStack() as stack:
        faulty = stack.enter_context(run_replica("tiny", extra_args=[
            "--debug-fault", f"{fault}-after-steps=40", "--health-stall-s", "1"]))
        good = stack.enter_context(run_replica("tiny"))
        port = free_port()
        config = tmp_path / "gw.yaml"
        config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, inter_token_timeout_s: 1.5}}\n" + FAST_HEALTH
                          + "logging: {format: json}\nrouting: {policy: round_robin}\nreplicas:\n"
                          f"  - {{name: faulty, url: '{faulty.url}', model: tiny}}\n"
                          f"  - {{name: good, url: '{good.url}', model: tiny}}\n")
        server = stack.enter_context(run_gateway(config, port))
        gateway = Gateway(server, [])
        body = body_for("/v1/completions", 5, 200)
        reference = answer(good.url, "/v1/completions", {**body, "stream": False}, "engine-ref")
        got = stream(server.url, "/v1/completions", body, f"engine-{fault}")
        assert got["error"] is None and got["ids"] == reference["ids"]
        record = gateway.record(f"engine-{fault}")
        assert record["failover"][0]["replica"] == "faulty" and record["failover"][0]["resumed_on"] == "good"
        if fault == "stall":
            status, _, health = http("GET", faulty.url + "/health")
            assert status == 503 and health["error"]["message"].startswith("engine stalled")
        else:
            assert faulty.proc.wait(timeout=20) == 3  # the process ends so a supervisor restarts it
            assert "engine_died" in faulty.logs()
        poll(lambda: http("GET", server.url + "/admin/replicas")[2]["replicas"][0]["state"] == "ejected",
             "the faulty replica ejected", server)


def ejected_pool(stack, tmp_path, stubs: int, frozen: int, health: str = "") -> tuple:
    """`stubs` stub replicas behind a gateway, the last `frozen` of them stopped until their probes
    time out and they are ejected (for the whole test: eject_base_s 120), then running again:
    (stubs, server, Gateway, states())."""
    procs = [stack.enter_context(StubProcess(model="tiny")) for _ in range(stubs)]
    port = free_port()
    config = tmp_path / "gw.yaml"
    config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\n"
                      "health: {probe_interval_s: 0.2, probe_timeout_s: 0.3, unhealthy_threshold: 2,\n"
                      f"         eject_base_s: 120{health}}}\n"
                      "logging: {format: json}\nrouting: {policy: round_robin}\nreplicas:\n"
                      + "".join(f"  - {{name: s{i}, url: '{stub.url}', model: tiny}}\n" for i, stub in enumerate(procs)))
    server = stack.enter_context(run_gateway(config, port))
    states = lambda: {e["name"]: e["state"] for e in http("GET", server.url + "/admin/replicas")[2]["replicas"]}
    poll(lambda: set(states().values()) == {"healthy"}, "all stubs healthy", server)
    stopped = procs[stubs - frozen:]
    for stub in stopped:
        os.kill(stub.pid, signal.SIGSTOP)
    try:
        poll(lambda: [states()[f"s{i}"] for i in range(stubs - frozen, stubs)] == ["ejected"] * frozen,
             "the stopped stubs ejected", server)
    finally:
        for stub in stopped:
            os.kill(stub.pid, signal.SIGCONT)
    return procs, server, Gateway(server, []), states


def test_with_every_replica_out_of_rotation_requests_go_to_those_not_known_gone(tmp_path):
    """Panic routing: both replicas ejected at once (their probes timed out while frozen, as on a
    host too loaded to answer /health in time) still get the model's requests, streamed and not,
    instead of a 503 for everyone; a replica whose port refuses connections is left out."""
    with contextlib.ExitStack() as stack:
        stubs, server, gateway, states = ejected_pool(stack, tmp_path, 2, 2)
        served = set()
        for n in range(4):
            streamed = n % 2 == 1
            if streamed:
                got = stream(server.url, "/v1/completions", body_for("/v1/completions", n, 8), f"panic-{n}")
                assert got["error"] is None and got["done"] == 1
            else:
                got = answer(server.url, "/v1/completions", {**body_for("/v1/completions", n, 8), "stream": False},
                             f"panic-{n}")
            assert len(got["ids"]) == 8
            record = gateway.record(f"panic-{n}")
            assert record["status"] == 200 and record["panic_routing"] is True
            served.add(record["replica"])
        assert served == {"s0", "s1"}  # spread as usual
        assert set(states().values()) == {"ejected"}  # still out of rotation: answering is not a probe
        text = http("GET", server.url + "/metrics")[2]
        assert metric(text, "kvgate_panic_routed_requests_total", model="tiny") == 4
        # s1's process is gone: a refused connection takes it out of the panic set too.
        stubs[1].process.kill()
        stubs[1].process.wait()
        for n in range(4, 10):
            got = answer(server.url, "/v1/completions", {**body_for("/v1/completions", n, 8), "stream": False},
                         f"panic-{n}")
            assert len(got["ids"]) == 8
        assert {gateway.record(f"panic-{n}")["replica"] for n in range(6, 10)} == {"s0"}
        admin = {e["name"]: e for e in http("GET", server.url + "/admin/replicas")[2]["replicas"]}
        assert admin["s1"].get("gone") is True and "gone" not in admin["s0"]


def test_under_the_panic_threshold_requests_spread_over_the_replicas_out_of_rotation_too(tmp_path):
    """health.panic_threshold 0.5: two of three replicas ejected (1 of 3 in rotation) sends the
    model's requests, streamed and not, to all three (not only to the one left, which would take
    everyone's load), each record marked; with one of the ejected drained (1 of the 2 counted in
    rotation: not under half) only the replica in rotation gets them."""
    with contextlib.ExitStack() as stack:
        stubs, server, gateway, states = ejected_pool(stack, tmp_path, 3, 2, ", panic_threshold: 0.5")
        assert states() == {"s0": "healthy", "s1": "ejected", "s2": "ejected"}

        def send(n: int) -> dict:
            body = body_for("/v1/completions", n, 8)
            got = (stream(server.url, "/v1/completions", body, f"th-{n}") if n % 2 else
                   answer(server.url, "/v1/completions", {**body, "stream": False}, f"th-{n}"))
            assert len(got["ids"]) == 8
            record = gateway.record(f"th-{n}")
            assert record["status"] == 200
            return record

        records = [send(n) for n in range(6)]
        assert all(r["panic_routing"] is True for r in records)
        assert {r["replica"] for r in records} == {"s0", "s1", "s2"}
        text = http("GET", server.url + "/metrics")[2]
        assert metric(text, "kvgate_panic_routed_requests_total", model="tiny") == 6
        assert "under health.panic_threshold 0.5" in server.logs()
        assert http("POST", server.url + "/admin/replicas/s2/drain")[0] == 200
        records = [send(n) for n in range(6, 10)]
        assert {r["replica"] for r in records} == {"s0"} and not any(r.get("panic_routing") for r in records)


def test_a_replica_is_known_gone_only_while_its_latest_failure_is_a_refused_connection():
    from gateway.health import HealthPolicy, ReplicaHealth
    health = ReplicaHealth(HealthPolicy(unhealthy_threshold=2, eject_base_s=10), now_s=0.0)
    health.on_probe(True, 0.0)
    assert health.state == "healthy" and not health.may_answer  # in rotation: no panic needed
    health.on_probe(False, 1.0, "health probe: timeout")
    health.on_probe(False, 2.0, "health probe: timeout")
    assert health.state == "ejected" and health.may_answer  # slow, maybe loaded: still worth a try
    health.on_request(False, 3.0, "connect: refused", fatal=True)
    assert health.gone and not health.may_answer
    health.on_probe(True, 4.0)  # it answers again (still ejected until 12 s)
    assert health.state == "ejected" and health.may_answer
    health.drain(5.0)
    assert not health.may_answer  # an operator took it out: never panic-routed


def test_a_replica_is_ejected_at_the_error_rate_over_its_window_and_not_for_older_outcomes():
    """The circuit opens when failures reach eject_error_rate of the requests in the last
    error_window_s (with at least error_min_requests), whatever came before the window."""
    from gateway.health import HealthPolicy, ReplicaHealth
    from gateway.window_counts import SLICES
    policy = HealthPolicy(eject_consecutive_failures=1000, eject_error_rate=0.5, error_window_s=10.0,
                          error_min_requests=10)

    def healthy() -> ReplicaHealth:
        health = ReplicaHealth(policy, now_s=0.0)
        health.on_probe(True, 0.0)
        return health

    health = healthy()
    for n in range(10):
        health.on_request(True, n * 0.1)
    for n in range(9):  # 9 of 19: under half
        assert health.on_request(False, 1.0 + n * 0.1, "HTTP 500") is None
    assert health.state == "healthy"
    health.on_request(False, 2.0, "HTTP 500")  # 10 of 20
    assert health.state == "ejected" and health.reason == "HTTP 500"

    health = healthy()
    for n in range(40):  # long past by the time the failures come
        health.on_request(True, n * 0.01)
    window_later = 0.4 + policy.error_window_s + policy.error_window_s / SLICES
    for n in range(5):
        health.on_request(True, window_later + n * 0.01)
    for n in range(4):
        health.on_request(False, window_later + 0.1 + n * 0.01, "HTTP 502")
    assert health.state == "healthy"  # 4 of 9 in the window; 4 of 49 counting the old ones
    health.on_request(False, window_later + 0.2, "HTTP 502")
    assert health.state == "ejected"  # 5 of 10 in the window


def test_the_retry_budget_allows_a_fraction_of_the_last_windows_requests_and_forgets_the_rest():
    """Retries are at most `fraction` of the requests in the last window (at least `minimum`);
    requests and retries past the window stop counting, and a gateway that never retries keeps
    no more than the window's slices, however many requests it serves."""
    from gateway.retry_budget import RetryBudget
    from gateway.window_counts import SLICES
    budget = RetryBudget(0.2, 3, window_s=10.0)
    for n in range(100):
        budget.on_request(n * 0.01)
    assert sum(budget.try_spend(2.0) for _ in range(30)) == 20  # 20% of 100
    assert sum(budget.try_spend(12.6) for _ in range(10)) == 3  # a window later: the minimum
    for n in range(200_000):  # 8,000 requests/s for 25 s, nothing retried
        budget.on_request(20.0 + n / 8000)
    assert len(budget._window._slices) <= SLICES + 1
