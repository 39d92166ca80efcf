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
def pd_cluster(tmp_path, prefills: int = 1, decodes: int = 1,
               extra_routing: str = "  pd: {min_prefill_tokens: 0}\n"):
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
    with pd_cluster(tmp_path, extra_routing="  pd: {skip_prefill_fraction: 0.5, min_prefill_tokens: 64}\n") as cluster:
        prompt = list(range(50, 50 + 12 * 16))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer(cluster.url, "/v1/completions", body, "skip-1")
        poll(lambda: cluster.record("skip-1"), "first record", cluster.server)
        time.sleep(0.5)  # the decode replica's KV events reach the gateway's table
        answer(cluster.url, "/v1/completions", {**body, "prompt": prompt + [3] * 20}, "skip-2")
        record = cluster.record("skip-2")["pd"]
        assert record.get("skipped_prefill") is True and record["prefill"] is None
        # A short prompt is prefilled by the decode replica: less than its wait in the prefill pool.
        answer(cluster.url, "/v1/completions", {**body, "prompt": list(range(400, 450))}, "skip-short")
        record = cluster.record("skip-short")["pd"]
        assert record.get("skipped_prefill") is True and record["decode_cached_tokens"] == 0


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


def test_the_gateway_speaks_vllm_and_sglang_pd_protocols_to_stand_ins(tmp_path):
    """vLLM and SGLang P/D pairs launched by `kvgate up` (tests/fake_engine.py plays each engine's
    side of the protocol): a vLLM pair gets the two legs with the prefill answer's
    kv_transfer_params passed on; an SGLang pair gets the same body on both servers with one
    bootstrap room pointing at the prefill server's bootstrap port."""
    import sys

    from replica.tiny import tiny_checkpoint_dir
    from tests.servers import run_process
    from tests.test_engine_launch import FAKE, records

    tiny = tiny_checkpoint_dir()
    port, bootstrap = free_port(), free_port()
    seen = {name: tmp_path / f"{name}.requests.jsonl" for name in ("vp", "vd", "sp", "sd")}

    def entry(name, engine, role, model, extra="", env=""):
        return (f"  - name: {name}\n    url: http://127.0.0.1:{free_port()}\n    model: {model}\n"
                f"    engine: {engine}\n    role: {role}\n    tokenizer: {tiny}\n{extra}"
                f"    launch:\n      model: {tiny}\n      executable: '{FAKE}'\n"
                f"      env: {{FAKE_ENGINE_REQUESTS: '{seen[name]}'{env}}}\n")

    config = tmp_path / "pd-engines.yaml"
    config.write_text(
        f"gateway: {{host: 127.0.0.1, port: {port}}}\n" + FAST_HEALTH + "logging: {format: json}\n"
        "routing: {policy: cache_aware, pd: {min_prefill_tokens: 0}}\nreplicas:\n"
        + entry("vp", "vllm", "prefill", "vllm-pd", env=f", VLLM_NIXL_SIDE_CHANNEL_PORT: '{free_port()}'")
        + entry("vd", "vllm", "decode", "vllm-pd", env=f", VLLM_NIXL_SIDE_CHANNEL_PORT: '{free_port()}'")
        + entry("sp", "sglang", "prefill", "sglang-pd", extra=f"    bootstrap_port: {bootstrap}\n")
        + entry("sd", "sglang", "decode", "sglang-pd"))
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(config)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up",
                     startup_timeout_s=120) as server:
        poll(lambda: all(e["state"] == "healthy" and e["ready"] for e in
                         http("GET", server.url + "/admin/replicas")[2]["replicas"]), "stand-ins ready", server)
        gateway = Gateway(server, [])
        for model in ("vllm-pd", "sglang-pd"):
            for streamed in (False, True):
                request_id = f"{model}-{streamed}"
                body = {"model": model, "prompt": f"Question {streamed}: the capital of France is", "max_tokens": 4}
                if streamed:
                    assert stream(server.url, "/v1/completions", body, request_id)["error"] is None
                else:
                    assert answer(server.url, "/v1/completions", body, request_id)["text"]
                assert gateway.record(request_id)["pd"]["prefill"] in ("vp", "sp")

        prefill_legs, decode_legs = ([r["body"] for r in records(seen[name])] for name in ("vp", "vd"))
        assert len(prefill_legs) == len(decode_legs) == 2
        for leg in prefill_legs:  # vLLM's prefill leg, as its toy proxy sends it
            assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
            assert leg["kv_transfer_params"]["do_remote_decode"] is True
        for leg, number in zip(decode_legs, (1, 2)):
            params = leg["kv_transfer_params"]  # what the prefill answered, passed on whole
            assert params["do_remote_prefill"] is True and params["remote_request_id"] == f"fake-req-{number}"
            assert params["remote_block_ids"] == [[1, 2, 3]] and leg["max_tokens"] == 4
        # The streaming client asked for neither token IDs nor usage: its decode leg asks for both.
        assert decode_legs[1]["return_token_ids"] is True and decode_legs[1]["stream"] is True
        assert decode_legs[1]["stream_options"] == {"include_usage": True}
        # SGLang's prefill leg runs beside the decode leg and may land a moment after the answer.
        poll(lambda: len(records(seen["sp"])) == 2, "both SGLang prefill legs", server)
        sglang_prefill, sglang_decode = ([r["body"] for r in records(seen[name])] for name in ("sp", "sd"))
        assert len(sglang_prefill) == len(sglang_decode) == 2
        for p_leg, d_leg in zip(sglang_prefill, sglang_decode):
            assert p_leg == d_leg  # SGLang: the same request to both, at once
            assert (p_leg["bootstrap_host"], p_leg["bootstrap_port"]) == ("127.0.0.1", bootstrap)
            assert 0 <= p_leg["bootstrap_room"] < 2**63
        assert sglang_decode[1]["return_token_ids"] is True and sglang_decode[1]["stream_options"] == {"include_usage": True}
        assert sglang_prefill[0]["bootstrap_room"] != sglang_prefill[1]["bootstrap_room"]
