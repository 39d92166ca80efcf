"""Hot reload of the routing YAML against a real gateway process and real tiny replicas: a good
edit swaps policy and replicas while a stream is in flight, a removed replica gets no new request,
a bad edit is rejected with its line and the old config keeps serving."""
from __future__ import annotations

import contextlib
import json
import os
import time

import openai

from tests.servers import free_port, run_gateway, run_replica
from tests.test_cache_routing import poll
from tests.test_gateway import Gateway, http


def log_events(gateway: Gateway, name: str) -> list[dict]:
    out = []
    for line in gateway.server.logs().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                item = json.loads(line)
                if item.get("event") == name:
                    out.append(item)
    return out


def write_config(path, port: int, replicas: dict, policy: str, extra: str = "") -> None:
    """Write atomically (as editors do) and make sure the mtime moves even within one tick."""
    text = (f"gateway: {{host: 127.0.0.1, port: {port}, connect_timeout_s: 2}}\nlogging: {{format: json}}\n"
            f"routing:\n  policy: {policy}\n{extra}replicas:\n"
            + "".join(f"  - {{name: {name}, url: '{url}', model: tiny}}\n" for name, url in replicas.items()))
    before = path.stat().st_mtime_ns if path.exists() else 0
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def test_reload_swaps_policy_and_replicas_without_dropping_a_stream_and_rejects_a_bad_edit(tmp_path):
    with contextlib.ExitStack() as stack:
        r0, r1 = (stack.enter_context(run_replica("tiny")) for _ in range(2))
        port = free_port()
        config = tmp_path / "gateway.yaml"
        write_config(config, port, {"r0": r0.url, "r1": r1.url}, "round_robin")
        server = stack.enter_context(run_gateway(config, port))
        gateway = Gateway(server, [r0, r1])
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        # A long stream on r1 (round robin's second turn), still running while the file changes.
        client.completions.create(model="tiny", prompt="warm", max_tokens=1,
                                  extra_headers={"x-request-id": "turn-0"})
        stream = client.completions.create(model="tiny", prompt="keep going", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True},
                                           extra_headers={"x-request-id": "in-flight"})
        chunks = iter(stream)
        next(chunks)  # the replica is generating
        assert gateway.record("turn-0")["replica"] == "r0"
        write_config(config, port, {"r0": r0.url}, "least_load")
        poll(lambda: log_events(gateway, "config_reloaded"), "config_reloaded", server)
        reloaded = log_events(gateway, "config_reloaded")[0]
        assert reloaded["policy"] == "least_load" and reloaded["removed"] == ["r1"]
        received = 1 + sum(1 for _ in chunks)  # the stream on the removed replica runs to its end
        record = gateway.record("in-flight")
        assert record["replica"] == "r1" and record["status"] == 200 and "error" not in record
        assert len(record["output_token_ids"]) == 400 and received >= 400

        ids = [f"after-{i}" for i in range(4)]
        for request_id in ids:
            client.completions.create(model="tiny", prompt="who serves?", max_tokens=1,
                                      extra_headers={"x-request-id": request_id})
        records = [gateway.record(request_id) for request_id in ids]
        assert [r["replica"] for r in records] == ["r0"] * 4
        assert all(r["routing"]["policy"] == "least_load" for r in records)

        # A bad edit: rejected with the key and line, the live config keeps serving.
        config.write_text(config.read_text().replace("policy: least_load", "policy: least_load\n  wieght: 3"))
        os.utime(config, ns=(time.time_ns(), time.time_ns()))
        poll(lambda: log_events(gateway, "config_rejected"), "config_rejected", server)
        rejected = log_events(gateway, "config_rejected")[0]
        assert f"{config}:5: routing.wieght: unknown key" in rejected["error"]
        client.completions.create(model="tiny", prompt="still?", max_tokens=1,
                                  extra_headers={"x-request-id": "after-bad"})
        still = gateway.record("after-bad")
        assert still["replica"] == "r0" and still["routing"]["policy"] == "least_load"

        # Adding a replica back: it is probed, then takes traffic.
        write_config(config, port, {"r0": r0.url, "r1": r1.url}, "round_robin")
        poll(lambda: len(log_events(gateway, "config_reloaded")) == 2, "second reload", server)
        poll(lambda: http("GET", server.url + "/health")[2].get("all_ready"), "r1 ready again", server)
        served = set()
        for i in range(2):
            client.completions.create(model="tiny", prompt="both?", max_tokens=1,
                                      extra_headers={"x-request-id": f"both-{i}"})
            served.add(gateway.record(f"both-{i}")["replica"])
        assert served == {"r0", "r1"}
