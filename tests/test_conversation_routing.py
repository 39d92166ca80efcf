"""Chat traffic through the real gateway and real tiny replicas: streamed requests (what chat
clients send) teach approximate mode and count as decoding once their first token arrives, and a
system prompt that every conversation shares neither piles conversations onto one replica nor
scatters a conversation's turns, in approximate and in precise mode."""
from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from tests.test_cache_routing import cluster, gateway_metric, poll
from tests.test_gateway import http

# Shared by every conversation: ~145 tokens with the tiny tokenizer, a third of a first turn (as in
# real chat traces, where the system prompt is ~30% of the first request).
SYSTEM = "You are a careful assistant for the quick brown fox company. " * 4


def stream_chat(gateway, messages: list[dict], request_id: str) -> dict:
    """A streamed chat completion, read to its end the way an SSE client reads it; the record."""
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(gateway.url + "/v1/chat/completions", body,
                                     {"content-type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    return gateway.record(request_id)


def test_approximate_mode_learns_from_streamed_requests(tmp_path):
    with cluster(tmp_path, "  policy: cache_aware\n") as gateway:
        question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about foxes."}]
        first = stream_chat(gateway, question, "stream-0")
        assert first["routing"]["mode"] == "approximate" and first["status"] == 200
        for i in range(1, 4):
            record = stream_chat(gateway, question + [{"role": "assistant", "content": "Foxes are quick."},
                                                      {"role": "user", "content": f"And {i} more?"}], f"stream-{i}")
            # The first stream's guess survived its end (it was prefilled): the next turns follow it.
            assert record["replica"] == first["replica"], record["routing"]
            assert record["routing"]["predicted_cached_tokens"] >= first["prompt_tokens"] // 16 * 16 - 16
            assert record["cached_tokens"] > 0
        # Every stream was counted out of the load tracker once it ended: nothing left in flight.
        health = http("GET", gateway.url + "/admin/health")[2]
        assert all(entry["in_flight"] == 0 for entry in health["replicas"].values()), health
        assert gateway_metric(gateway, "kvgate_requests_in_flight") == 0


@pytest.mark.parametrize("mode", ["approximate", "precise"])
def test_a_shared_system_prompt_neither_piles_conversations_nor_scatters_turns(tmp_path, mode):
    routing = "  policy: cache_aware\n" + ("  cache_aware: {learn_from_routing: false}\n" if mode == "precise" else "")
    with cluster(tmp_path, routing, replicas=3, kv_events=mode == "precise") as gateway:
        if mode == "precise":
            for name in ("r0", "r1", "r2"):
                poll(lambda: gateway_metric(gateway, "kvgate_routing_mode", replica=name) == 1,
                     f"{name} precise", gateway.server)
        rng = random.Random(5)
        conversations = {c: [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Conversation {c}: " + " ".join(
                                 rng.choice(["fox", "dog", "cache", "block", "robot", "paint"]) for _ in range(120))}]
                         for c in range(9)}
        first_replica = {}
        sent_away = 0  # first turns placed away from a replica holding the system prompt
        for turn in range(3):
            for c, messages in conversations.items():
                record = stream_chat(gateway, messages, f"{mode}-{c}-{turn}")
                if turn == 0:
                    first_replica[c] = record["replica"]
                    routing = record["routing"]
                    if max(routing["matched_blocks"].values()) > routing["matched_blocks"][record["replica"]]:
                        # Sent away from the system prompt's cache: the log says why, and not as queueing.
                        assert routing["reason"].startswith("new content: the "), routing
                        sent_away += 1
                else:
                    assert record["replica"] == first_replica[c], (c, turn, record["routing"])
                    assert record["cached_tokens"] >= record["prompt_tokens"] // 2
                messages += [{"role": "assistant", "content": "Noted: " + " ".join(["fox"] * 20)},
                             {"role": "user", "content": f"Turn {turn + 1}: go on about blocks and caches."}]
        per_replica = [list(first_replica.values()).count(name) for name in ("r0", "r1", "r2")]
        assert max(per_replica) <= 4, per_replica  # 9 conversations over 3 replicas: none takes most
        assert sent_away >= 1


def test_a_conversation_sent_as_growing_completions_prompts_keeps_its_replica_in_precise_mode(tmp_path):
    # How trace replays and many agents send a conversation: one text prompt per turn, each the
    # last one plus new text. The gateway tokenizes such a prompt in cached chunks; the IDs it
    # routes on must be the replica's own, or the prefix it holds would stop matching.
    routing = "  policy: cache_aware\n  cache_aware: {learn_from_routing: false}\n"
    with cluster(tmp_path, routing, replicas=2, kv_events=True) as gateway:
        for name in ("r0", "r1"):
            poll(lambda: gateway_metric(gateway, "kvgate_routing_mode", replica=name) == 1, f"{name} precise",
                 gateway.server)
        rng = random.Random(3)
        words = ["fox", "dog", "cache", "block", "robot", "paint", "it's", "2024,", "naïve", "(prefix)"]
        prompt = SYSTEM
        first = None
        for turn in range(4):
            prompt += " " + " ".join(rng.choice(words) for _ in range(90)) + "."
            request_id = f"text-turn-{turn}"
            applied = {name: gateway_metric(gateway, "kvgate_kv_event_batches_total", replica=name)
                       for name in ("r0", "r1")}
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": turn % 2 == 1}
            status, _, _ = http("POST", gateway.url + "/v1/completions", body, {"x-request-id": request_id})
            assert status == 200
            record = gateway.record(request_id)
            # The next turn must find this prompt's blocks: wait until its replica's KV events
            # reached the gateway and stopped coming (a long prompt is prefilled in a few steps).
            name = record["replica"]
            poll(lambda: gateway_metric(gateway, "kvgate_kv_event_batches_total", replica=name) > applied[name],
                 f"{name}'s KV events for {request_id}", gateway.server)
            settled = None
            for _ in range(50):  # another process's events: poll, bounded (a prefill takes a few steps)
                if settled == (settled := gateway_metric(gateway, "kvgate_kv_event_batches_total", replica=name)):
                    break
                time.sleep(0.2)
            if first is None:
                first = record
            else:
                assert record["replica"] == first["replica"], record["routing"]
                # The last turn's prompt was prefilled there: its full blocks match, bar the last one.
                assert record["routing"]["predicted_cached_tokens"] >= previous_tokens // 16 * 16 - 16, record
            previous_tokens = record["prompt_tokens"]
        assert "prompt_ids_mismatch" not in gateway.server.logs()
