"""Several gateway processes on one port (`gateway.workers`), and several gateways in front of one
pool, behaving as one gateway: real workers and tiny replicas on loopback.

A worker is reached on purpose through a keep-alive connection that it accepted (SO_REUSEPORT
keeps a connection on the worker that took it; the `x-kvgate-worker` header says which). Precise
mode is proven with `learn_from_routing: false`: a worker's table then learns only from the
replicas' KV events, so a matched prefix in its decision can only come from them."""
from __future__ import annotations

import contextlib
from http.client import HTTPConnection
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gateway.config import parse_config
from gateway.router import Router
from gateway.scraper import Scraper
from gateway.worker_metrics import MetricsSnapshots, collect, render_merged
from observability.metrics import GatewayMetrics
from routing.hashing import block_hashes
from routing.load import ScrapedLoad
from routing.peer_decisions import adopt, shareable
from routing.policies import CacheAware, SessionAffinity
from routing.policy import RouteRequest, RoutingState
from tests.servers import REPO_ROOT, free_port, run_process, run_replica
from tests.test_cache_routing import poll
from tests.test_engine_launch import FAKE, FAST_HEALTH, gone, records, tiny_dir  # noqa: F401 (fixture)
from tests.test_gateway import http, metric

BLOCK = 16


# ---- in one process: what the workers share, and how ---------------------------------------------

def two_replica_state() -> RoutingState:
    state = RoutingState(block_size=BLOCK)
    for name in ("r0", "r1"):
        state.add_replica(name, "m", 1000)
    return state


def request(tokens: list[int], session: str | None = None) -> RouteRequest:
    return RouteRequest(model="m", prompt_token_ids=tokens, block_hashes=np.asarray(block_hashes(tokens, BLOCK),
                                                                                   dtype=np.uint64),
                        session_key=session)


def test_an_adopted_decision_teaches_the_other_workers_table_what_its_own_commit_would():
    here, there = two_replica_state(), two_replica_state()
    policy_here, policy_there = CacheAware(here), CacheAware(there)
    prompt = list(range(10, 10 + 6 * BLOCK))
    decision = policy_here.choose(["r0", "r1"], request(prompt))
    policy_here.commit(decision)
    shared = shareable(policy_here, decision)
    adopt(policy_there, there, "m", shared)
    follow_up = request(prompt + [7] * BLOCK)
    assert here.table("m").match(follow_up.block_hashes, 0.0) == there.table("m").match(follow_up.block_hashes, 0.0)
    assert policy_there.choose(["r0", "r1"], follow_up).replica == decision.replica
    assert policy_there.choose(["r0", "r1"], follow_up).matched_blocks[decision.replica] == 6


def test_a_session_and_its_fallbacks_prefix_are_adopted_and_a_sessionless_commit_reaches_the_fallback():
    here, there = two_replica_state(), two_replica_state()
    policy_here, policy_there = SessionAffinity(here, CacheAware(here)), SessionAffinity(there, CacheAware(there))
    prompt = list(range(20, 20 + 4 * BLOCK))
    with_session = policy_here.choose(["r0", "r1"], request(prompt, "alice"))
    policy_here.commit(with_session)
    adopt(policy_there, there, "m", shareable(policy_here, with_session, "alice"))
    assert policy_there.choose(["r0", "r1"], request([1, 2, 3], "alice")).reason == "session affinity"
    assert policy_there.sticky["alice"][0] == with_session.replica
    # No session: session_affinity hands back its fallback's own decision, whose commit must still
    # reach the fallback (it used to raise, and the guess was lost).
    other = list(range(300, 300 + 4 * BLOCK))
    sessionless = policy_here.choose(["r0", "r1"], request(other))
    policy_here.commit(sessionless)
    assert here.table("m").match(request(other).block_hashes, 0.0)[sessionless.replica] == 4
    adopt(policy_there, there, "m", shareable(policy_here, sessionless))
    assert there.table("m").match(request(other).block_hashes, 0.0)[sessionless.replica] == 4


DETERMINISM = textwrap.dedent("""
    import random, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from routing.hashing import block_hashes
    from routing.policies import CacheAware
    from routing.policy import RouteRequest, RoutingState

    def request(tokens):
        return RouteRequest(model="m", prompt_token_ids=tokens,
                            block_hashes=np.asarray(block_hashes(tokens, 16), dtype=np.uint64))

    now = [0.0]  # the same arrival times in every process: what two gateways in front of one pool see
    state = RoutingState(block_size=16, clock=lambda: now[0])
    names = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    for name in names:
        state.add_replica(name, "m", 500)
    policy, rng, system = CacheAware(state), random.Random(5), list(range(40, 40 + 64))
    choices = []
    for i in range(60):  # new prompts, prompts behind a shared system prompt, and their next turns
        now[0] = i * 0.25
        tokens = (system if i % 3 else []) + [rng.randrange(10, 250) for _ in range(rng.randrange(1, 90))]
        decision = policy.choose(names, request(tokens))
        policy.commit(decision)
        state.table("m").insert(decision.replica, request(tokens).block_hashes, guessed=False, now=now[0])
        choices.append(decision.replica)
    print(",".join(choices))
""")


def test_cache_aware_choices_do_not_depend_on_the_process():
    """Two gateways agree only if nothing per process (hash seeds, dict order, start time) enters a
    choice: the same table, loads and arrival times give the same replica in processes with other
    hash seeds (the cache-turnover tie-break decays with time, so the times are the test's own)."""
    outputs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", DETERMINISM, str(REPO_ROOT)], cwd=REPO_ROOT, env=env,
                                capture_output=True, text=True, timeout=60, check=True)
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1 and len(set(outputs.pop().split(","))) == 4  # one answer, spread over the replicas


def test_merged_metrics_sum_counters_keep_gauges_per_worker_and_a_restart_continues_its_counters(tmp_path):
    workers = [GatewayMetrics(), GatewayMetrics()]
    for count, metrics in zip((3, 4), workers):
        metrics.requests.labels(replica="r0", status="200").inc(count)
        metrics.in_flight.source = lambda count=count: [("r0", count)]  # what its load tracker holds
        metrics.ttft.observe(0.2)
    text = render_merged([("0", collect(workers[0].registry)), ("1", collect(workers[1].registry))]).decode()
    assert metric(text, "kvgate_requests_total", replica="r0", status="200") == 7
    assert metric(text, "kvgate_time_to_first_token_seconds_count") == 2
    assert metric(text, "kvgate_requests_in_flight", replica="r0", worker="0") == 3
    assert metric(text, "kvgate_requests_in_flight", replica="r0", worker="1") == 4
    workers[1].requests.labels(replica="r1", status="500").inc(2)
    MetricsSnapshots(tmp_path, "1", workers[1].registry).write()
    successor = GatewayMetrics()  # worker 1, restarted: its own counters start at 0 ...
    successor.in_flight.source = lambda: [("r0", 0)]
    successor.requests.labels(replica="r0", status="200").inc()
    merged = MetricsSnapshots(tmp_path, "1", successor.registry)
    MetricsSnapshots(tmp_path, "0", workers[0].registry).write()
    merged.write()
    text = merged.render().decode()  # ... on top of its predecessor's, so the sum never goes back
    assert metric(text, "kvgate_requests_total", replica="r0", status="200") == 3 + 4 + 1
    assert metric(text, "kvgate_requests_total", replica="r1", status="500") == 2  # not touched since
    assert metric(text, "kvgate_requests_in_flight", replica="r0", worker="1") == 0  # gauges do not carry over


def test_other_workers_requests_count_now_and_a_scrape_adds_only_traffic_from_outside():
    config = parse_config("replicas:\n  - {name: r0, url: 'http://127.0.0.1:1', model: m}\n")
    router = Router(config, GatewayMetrics())
    peers = {"r0": (0, 0)}
    scraper = Scraper(None, router, router.metrics, peers=lambda name: peers[name])
    tracker, now = router.state.tracker, router.state.clock()
    tracker.on_routed("r0", 100)                 # this worker: 1 waiting
    peers["r0"] = (2, 5)                         # the others: 5 in flight, 2 of them waiting
    scraper.refresh()
    assert tracker.in_flight("r0", now) == 1 + 5
    # The replica runs 9: ours (1), the others' (5), and 3 from outside this gateway.
    scraper._scraped_with_peers("r0", ScrapedLoad(waiting=4, running=5), now)
    assert tracker.in_flight("r0", now) == 9
    peers["r0"] = (0, 1)                         # the others finished 4 since: seen at once
    scraper.refresh()
    assert tracker.in_flight("r0", now) == 1 + 1 + 3


# ---- real workers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two tiny replicas publishing KV events (each gateway below decides whether it listens)."""
    with contextlib.ExitStack() as stack:
        started = []
        for _ in range(2):
            pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            server = stack.enter_context(run_replica("tiny", extra_args=[
                "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]))
            started.append((server, pub, replay))
        yield started


class Gateway:
    def __init__(self, server, config: Path, log_path: Path) -> None:
        self.server, self.config, self.log_path = server, config, log_path
        self.url, self.port = server.url, server.port

    def lines(self) -> list[dict]:
        """Every whole line of the JSON log file (the parent is its only writer). A line still being
        written when the file is read is left for the next read (CI once read '{"event":"r')."""
        text = self.log_path.read_text() if self.log_path.exists() else ""
        return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]

    def events(self, name: str) -> list[dict]:
        return [line for line in self.lines() if line["event"] == name]

    def record(self, request_id: str) -> dict:
        found = poll(lambda: [r for r in self.events("request") if r["request_id"] == request_id],
                     f"the record of {request_id}", self.server)
        assert len(found) == 1, found
        return found[0]

    def connections(self, workers: int = 2) -> dict[int, HTTPConnection]:
        """One keep-alive connection per worker: new connections until every worker took one."""
        found: dict[int, HTTPConnection] = {}
        for _ in range(200):
            conn = HTTPConnection("127.0.0.1", self.port, timeout=30)
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            worker = int(response.getheader("x-kvgate-worker", "0"))
            if worker in found:
                conn.close()
            else:
                found[worker] = conn
            if len(found) == workers:
                return found
        raise AssertionError(f"200 connections reached only workers {sorted(found)}")


def call(conn: HTTPConnection, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, int, dict]:
    """(status, worker that answered, JSON) over `conn` (which stays open)."""
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, int(response.getheader("x-kvgate-worker", "-1")), json.loads(response.read())


def replicas_seen(conn: HTTPConnection) -> dict[str, dict]:
    """GET /admin/replicas from the worker behind `conn`: what it believes of each replica."""
    return {r["name"]: r for r in call(conn, "GET", "/admin/replicas")[2]["replicas"]}


def prefix_blocks(conn: HTTPConnection, replica: str) -> int:
    """Blocks the worker behind `conn` believes `replica` caches (its prefix table)."""
    return replicas_seen(conn)[replica]["prefix_blocks"]


def learned(gateway: Gateway, conn: HTTPConnection, before: dict[str, int], replica: str, blocks: int) -> None:
    """Wait, without routing anything, until the worker behind `conn` holds `blocks` more blocks
    on `replica` than `before`, and counts no request in flight anywhere (the one another worker
    or gateway just finished was reported over; a decision then sees an idle pool)."""
    def done() -> bool:
        seen = replicas_seen(conn)
        return (seen[replica]["prefix_blocks"] >= before[replica] + blocks
                and all(entry["load_in_flight"] == 0 for entry in seen.values()))
    poll(done, f"{blocks} blocks on {replica} and an idle pool", gateway.server)


def complete(gateway: Gateway, conn, prompt: list[int], request_id: str, **extra) -> dict:
    """A completion over `conn`; its record, which says which worker and replica served it."""
    status, worker, answer = call(conn, "POST", "/v1/completions",
                                  {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
                                  {"x-request-id": request_id})
    assert status == 200, answer
    record = gateway.record(request_id)
    assert record.get("worker", -1) == worker  # (no header and no field from a one-process gateway)
    return record


@contextlib.contextmanager
def gateway(tmp_path: Path, replicas, *, workers: int = 2, routing: str = "  policy: cache_aware\n",
            kv_events: bool = False, name: str = "gateway"):
    port = free_port()
    log_path = tmp_path / f"{name}.jsonl"
    entries = ""
    for i, (replica, pub, replay) in enumerate(replicas):
        entries += f"  - name: r{i}\n    url: {replica.url}\n    model: tiny\n"
        if kv_events:
            entries += f"    kv_events: {{endpoint: '{pub}', replay_endpoint: '{replay}'}}\n"
    config = tmp_path / f"{name}.yaml"
    config.write_text(f"gateway: {{host: 127.0.0.1, port: {port}, workers: {workers}, connect_timeout_s: 2}}\n"
                      f"logging: {{format: json, file: '{log_path}'}}\nrouting:\n{routing}replicas:\n{entries}")
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name=name) as server:
        poll(lambda: "kvgate ready:" in server.logs(), "the ready line (every worker ready)", server)
        yield Gateway(server, config, log_path)


def prompt_of(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(tokens)]


def session_on_both_workers(gw: Gateway, conns, rng: random.Random, i: int, session: str,
                            request_id: str) -> tuple[dict, dict]:
    """A request of `session` on worker i % 2, then one on the other worker once it saw the first
    end: their records."""
    placed = complete(gw, conns[i % 2], prompt_of(rng, 8), f"{request_id}-first", user=session)
    learned(gw, conns[1 - i % 2], {"r0": 0}, "r0", 0)  # the other worker saw that request end
    again = complete(gw, conns[1 - i % 2], prompt_of(rng, 8), f"{request_id}-then", user=session)
    return placed, again


def test_workers_share_the_port_and_every_request_gets_one_record_with_its_token_ids(tmp_path, replicas):
    with gateway(tmp_path, replicas, routing="  policy: round_robin\n") as gw:
        rng = random.Random(1)
        sent = {}
        for i in range(16):  # a new connection each: the kernel spreads them over the workers
            # Prompts of 1,500 IDs make record lines of ~8 kB, past a pipe's atomic 4 kB.
            prompt = prompt_of(rng, 1500 if i % 4 == 0 else 20)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": i % 2 == 1}
            status, headers, _ = http("POST", gw.url + "/v1/completions", body, {"x-request-id": f"one-{i}"})
            assert status == 200
            sent[f"one-{i}"] = (prompt, int(headers["x-kvgate-worker"]))
        for request_id, (prompt, worker) in sent.items():
            record = gw.record(request_id)  # exactly one, or this fails
            assert record["worker"] == worker and record["prompt_token_ids"] == prompt
            assert len(record["output_token_ids"]) == record["completion_tokens"] >= 1, record  # 3, or fewer and EOS
        assert {worker for _, worker in sent.values()} == {0, 1}
        # The terminal stream has them too, each line whole (every JSON line parses).
        stdout = [json.loads(line) for line in gw.server.logs().splitlines() if line.startswith("{")]
        assert sorted(r["request_id"] for r in stdout if r["event"] == "request") == sorted(sent)
        # `kvgate tail` reads the file as it reads a one-process gateway's: every line whole.
        tail = subprocess.run([sys.executable, "-m", "gateway.cli", "tail", str(gw.log_path), "--no-follow"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert "16 requests" in tail.stdout and "0 non-JSON lines" in tail.stdout, tail.stdout[-2000:]
        # One /metrics for the gateway, whichever worker answers: counters summed over the workers.
        poll(lambda: metric(http("GET", gw.url + "/metrics")[2], "kvgate_requests_total") == 16,
             "both workers' requests counted in /metrics", gw.server)


def test_precise_mode_a_prefix_routed_by_one_worker_goes_to_the_same_replica_from_another(tmp_path, replicas):
    routing = "  policy: cache_aware\n  cache_aware: {learn_from_routing: false}\n"
    with gateway(tmp_path, replicas, routing=routing, kv_events=True) as gw:
        poll(lambda: sum(metric(http("GET", gw.url + "/metrics")[2], "kvgate_routing_mode", replica=r, worker=w)
                         for r in ("r0", "r1") for w in ("0", "1")) == 4,
             "every worker subscribed to both replicas' KV events", gw.server)
        conns = gw.connections()
        rng = random.Random(21)
        for i in range(4):
            first, then = i % 2, 1 - i % 2
            before = {name: entry["prefix_blocks"] for name, entry in replicas_seen(conns[then]).items()}
            prefix = prompt_of(rng, 96)  # 6 blocks
            routed = complete(gw, conns[first], prefix + prompt_of(rng, 8), f"p{i}-first")
            holder = routed["replica"]
            # The other worker never routed this prefix: only the replica's events can tell it.
            learned(gw, conns[then], before, holder, 6)
            follow = complete(gw, conns[then], prefix + prompt_of(rng, 8), f"p{i}-then")
            assert follow["replica"] == holder and follow["routing"]["matched_blocks"][holder] == 6, follow["routing"]
            assert follow["routing"]["mode"] == "precise"
        # A prefix cached behind the gateway's back (sent to a replica directly) is found there by
        # both workers, whichever replica a cold prompt would have gone to.
        for i, (replica, _pub, _replay) in enumerate(replicas):
            before = {w: {f"r{i}": prefix_blocks(conns[w], f"r{i}")} for w in (0, 1)}
            prefix = prompt_of(rng, 96)
            status, _, answer = http("POST", replica.url + "/v1/completions", {"model": "tiny", "prompt": prefix,
                                                                             "max_tokens": 1})
            assert status == 200, answer
            for worker in (0, 1):  # its BlockStored events reach each worker's table (and the pool is idle)
                learned(gw, conns[worker], before[worker], f"r{i}", 6)
                routed = complete(gw, conns[worker], prefix + prompt_of(rng, 8), f"seed-{i}-{worker}")
                assert routed["replica"] == f"r{i}", routed["routing"]
                assert routed["routing"]["matched_blocks"][f"r{i}"] == 6


def test_approximate_mode_workers_adopt_each_others_decisions_and_sessions(tmp_path, replicas):
    routing = "  policy: session_affinity\n  session_affinity: {fallback: cache_aware}\n"
    with gateway(tmp_path, replicas, routing=routing) as gw:
        conns = gw.connections()
        rng = random.Random(33)
        for i in range(4):
            first, then = i % 2, 1 - i % 2
            before = {name: entry["prefix_blocks"] for name, entry in replicas_seen(conns[then]).items()}
            prefix = prompt_of(rng, 64)
            routed = complete(gw, conns[first], prefix + prompt_of(rng, 8), f"a{i}-first")
            assert routed["routing"]["mode"] == "approximate"
            # The other worker has never seen this prompt; its table has it from the bus.
            learned(gw, conns[then], before, routed["replica"], 4)
            follow = complete(gw, conns[then], prefix + prompt_of(rng, 8), f"a{i}-then")
            assert follow["replica"] == routed["replica"]
            assert follow["routing"]["matched_blocks"][routed["replica"]] == 4, follow["routing"]
        for i in range(4):  # a session placed by one worker sticks on the other
            placed, again = session_on_both_workers(gw, conns, rng, i, f"user-{i}", f"s{i}")
            assert again["replica"] == placed["replica"] and again["routing"]["reason"] == "session affinity"


def test_sessions_reach_the_other_worker_behind_a_fallback_that_learns_nothing(tmp_path, replicas):
    # round_robin's commit learns nothing, so the router skips it; a session's key must still be
    # published at commit (and the worker's pending sessions emptied).
    routing = "  policy: session_affinity\n  session_affinity: {fallback: round_robin}\n"
    with gateway(tmp_path, replicas, routing=routing) as gw:
        conns = gw.connections()
        rng = random.Random(35)
        for i in range(4):
            placed, again = session_on_both_workers(gw, conns, rng, i, f"rr-user-{i}", f"rr{i}")
            assert placed["routing"]["reason"].startswith("new session"), placed["routing"]
            assert again["replica"] == placed["replica"] and again["routing"]["reason"] == "session affinity"


def test_a_drain_a_config_edit_and_a_restarted_worker_reach_every_worker(tmp_path, replicas):
    with gateway(tmp_path, replicas, routing="  policy: round_robin\n") as gw:
        conns = gw.connections()
        status, worker, answer = call(conns[0], "POST", "/admin/replicas/r0/drain")
        assert status == 200 and worker == 0 and answer["state"] == "draining"

        def states(conn) -> dict:
            return {r["name"]: r["state"] for r in call(conn, "GET", "/admin/replicas")[2]["replicas"]}
        poll(lambda: states(conns[1])["r0"] == "draining", "the drain to reach worker 1", gw.server)
        rng = random.Random(44)
        assert {complete(gw, conns[1], prompt_of(rng, 8), f"d{i}")["replica"] for i in range(3)} == {"r1"}

        # The parent alone reads the YAML: a bad edit is rejected once, a good one reaches every worker.
        text = gw.config.read_text()
        gw.config.write_text(text.replace("policy: round_robin", "policy: nope"))
        poll(lambda: gw.events("config_rejected"), "the bad edit rejected", gw.server)
        gw.config.write_text(text.replace("policy: round_robin", "policy: least_load"))
        poll(lambda: len(gw.events("config_applied")) == 2, "the good edit applied by both workers", gw.server)
        assert len(gw.events("config_rejected")) == 1
        assert {(e["worker"], e["generation"], e["policy"]) for e in gw.events("config_applied")} == \
            {(0, 1, "least_load"), (1, 1, "least_load")}

        # A worker killed outright is restarted; it starts with the drain and the new config.
        counted = metric(http("GET", gw.url + "/metrics")[2], "kvgate_requests_total")
        [started] = [e for e in gw.events("worker_started") if e["worker"] == 1]
        conns[1].close()
        os.kill(started["pid"], signal.SIGKILL)
        poll(lambda: len([e for e in gw.events("worker_started") if e["worker"] == 1]) == 2,
             "worker 1 restarted", gw.server)

        def restarted_ready() -> bool:  # listening, r1 ready (r0 is drained: never "ready")
            lines = gw.lines()
            since = [i for i, e in enumerate(lines) if e["event"] == "worker_started" and e["worker"] == 1][-1]
            return {(e["event"], e.get("replica")) for e in lines[since:] if e.get("worker") == 1} >= \
                {("gateway_listening", None), ("replica_ready", "r1")}
        poll(restarted_ready, "the new worker 1 to listen with r1 ready", gw.server)
        conns = gw.connections()
        assert states(conns[1])["r0"] == "draining"
        record = complete(gw, conns[1], prompt_of(rng, 8), "after-restart")
        assert record["replica"] == "r1" and record["routing"]["policy"] == "least_load"
        poll(lambda: metric(http("GET", gw.url + "/metrics")[2], "kvgate_requests_total") >= counted + 1,
             "the counters to go on from where the killed worker left them", gw.server)
        status, _, _ = call(conns[1], "POST", "/admin/replicas/r0/undrain")
        assert status == 200
        poll(lambda: states(conns[0])["r0"] != "draining", "the undrain to reach worker 0", gw.server)
        assert [e["worker"] for e in gw.events("worker_exited")] == [1]


def test_two_gateways_in_front_of_the_same_replicas_make_the_same_choices(tmp_path, replicas):
    routing = "  policy: cache_aware\n  cache_aware: {learn_from_routing: false}\n"
    with gateway(tmp_path, replicas, workers=1, routing=routing, kv_events=True, name="east") as east, \
            gateway(tmp_path, replicas, workers=1, routing=routing, kv_events=True, name="west") as west:
        for gw in (east, west):
            poll(lambda: sum(metric(http("GET", gw.url + "/metrics")[2], "kvgate_routing_mode", replica=r)
                             for r in ("r0", "r1")) == 2, "precise mode", gw.server)
        conns = {gw: HTTPConnection("127.0.0.1", gw.port, timeout=30) for gw in (east, west)}
        rng = random.Random(55)
        for i in range(6):
            first, then = (east, west) if i % 2 == 0 else (west, east)
            before = {name: entry["prefix_blocks"] for name, entry in replicas_seen(conns[then]).items()}
            prefix = prompt_of(rng, 96)
            routed = complete(first, conns[first], prefix + prompt_of(rng, 8), f"g{i}-first")
            holder = routed["replica"]
            learned(then, conns[then], before, holder, 6)  # from the replica's KV events
            follow = complete(then, conns[then], prefix + prompt_of(rng, 8), f"g{i}-then")
            assert follow["replica"] == holder and follow["routing"]["matched_blocks"][holder] == 6
            assert follow["routing"]["mode"] == "precise"


def test_kvgate_up_with_workers_launches_each_replica_once_and_restarts_it_once(tmp_path, tiny_dir):  # noqa: F811
    port = free_port()
    record = tmp_path / "v0.jsonl"
    config = tmp_path / "up.yaml"
    config.write_text(
        f"gateway: {{host: 127.0.0.1, port: {port}, workers: 2}}\n" + FAST_HEALTH
        + "logging: {format: json}\nrouting: {policy: round_robin, block_size: 8}\nreplicas:\n"
        f"  - name: v0\n    url: http://127.0.0.1:{free_port()}\n    model: vllm-model\n    engine: vllm\n"
        f"    tokenizer: {tiny_dir}\n"
        f"    launch:\n      model: {tiny_dir}\n      executable: {json.dumps(FAKE)}\n"
        f"      env: {{FAKE_ENGINE_RECORD: '{record}'}}\n")
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(config), "--replica-logs",
            str(tmp_path / "replica-logs")]  # one is restarted: its logs are kept, in tmp_path
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up") as server:
        poll(lambda: "kvgate ready:" in server.logs(), "the ready line", server, timeout_s=60)
        gw = Gateway(server, config, tmp_path / "none")
        conns = gw.connections()
        [first] = records(record)  # one process for the replica, however many workers
        for conn in conns.values():  # both workers show the process the parent supervises
            entry = call(conn, "GET", "/admin/replicas")[2]["replicas"][0]
            assert entry["process"]["pid"] == first["pid"]
        os.kill(first["pid"], signal.SIGKILL)
        poll(lambda: len(records(record)) == 2, "the stand-in restarted", server, timeout_s=30)
        second = records(record)[1]
        poll(lambda: all((entry := call(c, "GET", "/admin/replicas")[2]["replicas"][0])["process"]["pid"]
                         == second["pid"] and entry["state"] == "healthy" for c in conns.values()),
             "both workers to see the new process, healthy", server)
        status, _, reply = http("POST", server.url + "/v1/completions",
                                {"model": "vllm-model", "prompt": "Paris is", "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply
        assert len(records(record)) == 2  # restarted by one owner, once
        pids = [first["child_pid"], second["pid"], second["child_pid"]]
        assert server.logs().count("kvgate ready:") == 1  # printed once, for all the workers
    for pid in pids:
        poll(lambda: gone(pid), f"process {pid} stopped", server, timeout_s=15)
