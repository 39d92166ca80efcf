"""Prefill/decode pools behind the real gateway: built-in replicas with `--role prefill` and
`--role decode`, the gateway driving vLLM's two-leg protocol, compared token for token with a
mixed replica; a shared prefix pulls only what the decode replica lacks; a prefill replica that
dies, or a decode replica that dies mid-stream, never costs the client its answer."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import time

import pytest

from tests.servers import free_port, run_gateway, run_replica
from tests.test_cache_routing import poll
from tests.test_failover import FAST_HEALTH, answer, body_for, stream
from tests.test_gateway import Gateway, http, metric


@contextlib.contextmanager
def pd_cluster(tmp_path, prefills: int = 1, decodes: int = 1, extra_routing: str = ""):
    with contextlib.ExitStack() as stack:
        mixed = stack.enter_context(run_replica("tiny"))
        replicas = {f"p{i}": stack.enter_context(run_replica("tiny", extra_args=["--role", "prefill"]))
                    for i in range(prefills)}
        replicas.update({f"d{i}": stack.enter_context(run_replica("tiny", extra_args=["--role", "decode"]))
                         for i in range(decodes)})
        port = free_port()
        config = tmp_path / "pd.yaml"
        config.write_text(
            f"gateway: {{host: 127.0.0.1, port: {port}, inter_token_timeout_s: 1.5}}\n" + FAST_HEALTH
            + f"logging: {{format: json}}\nrouting:\n  policy: cache_aware\n{extra_routing}replicas:\n"
            + "".join(f"  - {{name: {name}, url: '{r.url}', model: tiny, "
                      f"role: {'prefill' if name.startswith('p') else 'decode'}}}\n" for name, r in replicas.items()))
        server = stack.enter_context(run_gateway(config, port))
        cluster = Gateway(server, [])
        cluster.mixed, cluster.pd_replicas = mixed, replicas
        yield cluster


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with pd_cluster(tmp_path_factory.mktemp("pd")) as cluster:
        yield cluster


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_greedy_answers_through_prefill_and_decode_equal_a_mixed_replicas(pd, path):
    for n in range(6):
        body = body_for(path, n * 7 + len(path), max_tokens=24)
        reference = answer(pd.mixed.url, path, {**body, "stream": False}, f"pd-ref-{path}-{n}")
        streamed = stream(pd.url, path, body, f"pd-s-{path}-{n}")
        whole = answer(pd.url, path, {**body, "stream": False}, f"pd-j-{path}-{n}")
        assert streamed["error"] is None and streamed["ids"] == reference["ids"] == whole["ids"]
        assert streamed["text"] == reference["text"] == whole["text"]
        first, again = pd.record(f"pd-s-{path}-{n}"), pd.record(f"pd-j-{path}-{n}")
        assert first["replica"] == "d0" and first["pd"]["prefill"] == "p0" and first["pd"]["decode"] == "d0"
        assert first["pd"]["kv_blocks_pulled"] >= 1 and first["status"] == again["status"] == 200
        # The same prompt again: the decode replica holds it now, and prefills the rest itself.
        assert again["pd"].get("skipped_prefill") or again["pd"]["prefill"] == "p0"


def test_a_shared_prefix_pulls_only_the_blocks_the_decode_replica_lacks(pd):
    rng = random.Random(3)
    prefix = [rng.randrange(10, 400) for _ in range(8 * 16)]
    first = answer(pd.url, "/v1/completions", {"model": "tiny", "prompt": prefix + [7] * 40, "max_tokens": 4,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True}, "pull-1")
    second = answer(pd.url, "/v1/completions", {"model": "tiny", "prompt": prefix + [9] * 40, "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True}, "pull-2")
    assert len(first["ids"]) == len(second["ids"]) == 4
    one, two = pd.record("pull-1")["pd"], pd.record("pull-2")["pd"]
    block_bytes = one["kv_bytes"] // one["kv_blocks_pulled"]
    assert one["kv_blocks_pulled"] >= 10 and one["kv_blocks_local"] == 0
    # The decode replica holds the 8 prefix blocks now: only the new blocks move.
    assert two["kv_blocks_local"] >= 8 and two["kv_bytes"] == two["kv_blocks_pulled"] * block_bytes
    assert two["kv_blocks_pulled"] <= one["kv_blocks_pulled"] - 8
    text = http("GET", pd.url + "/metrics")[2]
    assert metric(text, "kvgate_kv_transfer_bytes_total") >= one["kv_bytes"] + two["kv_bytes"]
    assert metric(text, "kvgate_pd_requests_total", path="prefill_decode") >= 2


def test_the_prefill_leg_is_skipped_when_the_decode_replica_holds_the_prompt(tmp_path):
    with pd_cluster(tmp_path, extra_routing="  pd: {skip_prefill_fraction: 0.5}\n") as cluster:
        prompt = list(range(50, 50 + 12 * 16))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer(cluster.url, "/v1/completions", body, "skip-1")
        poll(lambda: cluster.record("skip-1"), "first record", cluster.server)
        time.sleep(0.5)  # the decode replica's KV events reach the gateway's table
        answer(cluster.url, "/v1/completions", {**body, "prompt": prompt + [3] * 20}, "skip-2")
        record = cluster.record("skip-2")["pd"]
        assert record.get("skipped_prefill") is True and record["prefill"] is None


def test_a_dead_prefill_pool_falls_back_and_a_decode_death_mid_stream_resumes(tmp_path):
    with pd_cluster(tmp_path, prefills=2, decodes=2) as cluster:
        bodies = [body_for("/v1/completions", n, max_tokens=120) for n in range(12)]
        reference = [answer(cluster.mixed.url, "/v1/completions", {**b, "stream": False}, f"dref-{i}")
                     for i, b in enumerate(bodies)]
        prefill_pids = [cluster.pd_replicas[name].proc.pid for name in ("p0", "p1")]
        killed = []

        def kill_a_streaming_decode(progress):
            if len(progress["ids"]) >= 30 and not killed:
                for name in ("d0", "d1"):
                    text = http("GET", cluster.pd_replicas[name].url + "/metrics")[2]
                    if metric(text, "vllm:num_requests_running") > 0:
                        os.kill(cluster.pd_replicas[name].proc.pid, signal.SIGKILL)
                        killed.append(name)
                        return

        def run(i):
            if i == 0:
                return stream(cluster.url, "/v1/completions", bodies[i], f"dpd-{i}", kill_a_streaming_decode)
            if i == 3:  # both prefill replicas die while requests are in their legs
                for pid in prefill_pids:
                    os.kill(pid, signal.SIGKILL)
            return stream(cluster.url, "/v1/completions", bodies[i], f"dpd-{i}")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, range(len(bodies))))
        assert killed
        for i, got in enumerate(results):
            assert got["error"] is None and got["ids"] == reference[i]["ids"], i
        records = [cluster.record(f"dpd-{i}") for i in range(len(bodies))]
        assert all(r["status"] == 200 for r in records)
        resumed = [f for r in records for f in r.get("failover") or [] if f["replica"] == killed[0]]
        assert resumed and all(f.get("resumed_on") for f in resumed)  # its streams went on elsewhere
        assert any((r["pd"] or {}).get("fallback") for r in records[3:])  # no prefill replica left: decode prefilled
