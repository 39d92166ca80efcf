"""bench.workloads builds the same traffic for every router: text whose sharing is exact in tokens,
seeded, shaped like chat, agent loops and Mooncake traces. Pure: no servers, no timing."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from bench import workloads as W


@pytest.fixture(scope="module")
def bundle():
    return W.tiny_bundle()


@pytest.fixture(scope="module")
def chat():
    return W.chat()


def test_every_word_is_one_token_with_its_leading_space(bundle):
    assert len(set(W.WORDS)) == len(W.WORDS)
    for word in W.WORDS:
        assert len(bundle.encode(" " + word)) == 1, word


def test_a_unit_is_sixteen_tokens_whatever_precedes_it(bundle):
    rng = random.Random(5)
    before = ["", " the", "hello", "<|im_start|>user\n", "x.", W.unit_text(7, 3)]
    for unit in [0, 1, 12345, 1 << 40, -3]:
        text = W.unit_text(unit)
        assert len(bundle.encode(text)) == W.UNIT_TOKENS
        for prefix in before + [W.unit_text(rng.randrange(1 << 30))]:
            assert bundle.encode(prefix + text) == bundle.encode(prefix) + bundle.encode(text), (prefix, unit)


def test_equal_hash_id_prefixes_give_equal_token_id_prefixes(bundle, tmp_path):
    path = tmp_path / "trace.jsonl"
    records = [{"timestamp": 0, "input_length": 2000, "output_length": 40, "hash_ids": [5, 6, 7, 8]},
               {"timestamp": 10, "input_length": 1100, "output_length": 40, "hash_ids": [5, 6, 9]},
               {"timestamp": 20, "input_length": 600, "output_length": 40, "hash_ids": [4, 6]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    first, second, third = W.trace(W.TraceSettings(path=str(path), duration_s=None)).requests
    ids = [W.prompt_token_ids(r, bundle) for r in (first, second, third)]
    assert ids[0][:2 * W.UNIT_TOKENS] == ids[1][:2 * W.UNIT_TOKENS]
    assert ids[0][2 * W.UNIT_TOKENS] != ids[1][2 * W.UNIT_TOKENS]
    assert ids[0][:W.UNIT_TOKENS] != ids[2][:W.UNIT_TOKENS]
    # 2,000 tokens over 512-token hash ids: 3 full + 464 -> 15 of 16 words of the last unit (x1/32)
    assert len(ids[0]) == 3 * W.UNIT_TOKENS + 15 and first.units == (5, 6, 7, 8)
    assert (first.arrival_s, second.arrival_s, third.arrival_s) == (0.0, 0.01, 0.02)


def test_workloads_are_deterministic_with_a_seed():
    for key in "abcd":
        one, two = W.Selection(), W.Selection()
        assert one.build(key).requests == two.build(key).requests, key
    other = W.Selection()
    other.seed(1)
    assert other.build("a").requests != W.Selection().build("a").requests


def test_chat_shares_a_system_prompt_of_about_30_percent_of_the_first_turn(chat, bundle):
    firsts = {}
    for r in chat.requests:
        firsts.setdefault(r.session, r)
    assert len(firsts) == W.ChatSettings().conversations
    systems = {r.messages[0]["content"] for r in chat.requests}
    assert len(systems) == 1 and all(r.messages[0]["role"] == "system" for r in chat.requests)
    system_tokens = len(bundle.encode(systems.pop()))
    shares = [system_tokens / len(W.prompt_token_ids(r, bundle)) for r in firsts.values()]
    assert 0.25 <= statistics.mean(shares) <= 0.35


def test_chat_turns_extend_their_conversation_after_a_think_time(chat, bundle):
    by_session: dict[int, list[W.Request]] = {}
    for r in chat.requests:
        by_session.setdefault(r.session, []).append(r)
    turns = sorted(len(v) for v in by_session.values())
    # most conversations are short, and a long tail is long (Pareto, cut by the context and the run)
    assert statistics.median(turns) <= 2 and turns[-1] >= 8 and sum(t >= 5 for t in turns) >= 0.1 * len(turns)
    for session in list(by_session.values())[:40]:
        for previous, current in zip(session, session[1:]):
            assert current.arrival_s > previous.arrival_s
            assert current.messages[:len(previous.messages)] == previous.messages
            assert [m["role"] for m in current.messages[len(previous.messages):]] == ["assistant", "user"]
            assert current.units[:len(previous.units)] == previous.units
            before, after = W.prompt_token_ids(previous, bundle), W.prompt_token_ids(current, bundle)
            assert after[:len(before) - 3] == before[:-3]  # all but the generation prompt
    assert all(len(W.prompt_token_ids(r, bundle)) + r.max_tokens <= W.MODEL_CONTEXT_TOKENS for r in chat.requests)
    assert all(r.body("tiny")["stream"] and r.body("tiny")["stream_options"] == {"include_usage": True}
               for r in chat.requests[:5])
    assert "stream_options" not in chat.requests[0].body("tiny", stream=False)


def test_agent_context_grows_by_tool_outputs_of_a_few_hundred_tokens(bundle):
    workload = W.agent()
    systems = {r.messages[0]["content"] for r in workload.requests}
    assert len(systems) == 1
    longest = max(workload.requests, key=lambda r: len(r.messages))
    tools = [m for m in longest.messages if m["role"] == "tool"]
    assert len(tools) >= 3 and all(m["tool_call_id"] for m in tools)
    sizes = [len(bundle.encode(m["content"])) for m in tools]
    assert all(128 <= n <= 384 for n in sizes)
    assert all(len(W.prompt_token_ids(r, bundle)) + r.max_tokens <= W.MODEL_CONTEXT_TOKENS for r in workload.requests)


def test_mooncake_loader_reads_the_shipped_trace():
    records = W.load_mooncake(W.SHIPPED_TRACE, limit=50)
    assert len(records) == 50 and records[0].timestamp_ms == 0
    assert all(r.hash_ids and r.input_length > W.MOONCAKE_BLOCK_TOKENS * (len(r.hash_ids) - 1) for r in records)
    workload = W.trace(W.TraceSettings(requests=50, duration_s=10.0))
    assert len(workload.requests) == 50 and workload.requests[-1].arrival_s == pytest.approx(10.0)
    assert all(r.messages is None and r.prompt and r.max_tokens >= 1 for r in workload.requests)
    max_units = W.TraceSettings().max_prompt_tokens // W.UNIT_TOKENS
    assert [r.units for r in workload.requests] == [rec.hash_ids[:max_units] for rec in records]


def test_a_bad_trace_line_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        W.load_mooncake(path)


def test_chat_written_as_a_mooncake_trace_replays_its_units(chat, tmp_path):
    path = tmp_path / "chat.jsonl"
    W.write_mooncake(chat, path)
    replayed = W.trace(W.TraceSettings(path=str(path), requests=10_000, duration_s=None))
    assert [r.units for r in replayed.requests] == [r.units for r in chat.requests]
    assert [r.max_tokens for r in replayed.requests] == [r.max_tokens for r in chat.requests]


def test_oracle_counts_hits_as_the_replicas_do():
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks; the one holding the last token is never a hit
    assert W.simulate_lru([prompt, prompt], 100).hit_rate == pytest.approx(32 / 80)
    other = list(range(100, 148))  # 3 blocks; with room for 3 blocks it evicts `prompt`'s
    assert W.simulate_lru([prompt, other, prompt], 3).hit_rate == 0.0
    spread = W.simulate_lru([prompt, prompt], 100, replica_of=lambda i: i)  # one cache each: no hit
    assert spread.hit_rate == 0.0 and spread.unbounded_hit_rate == pytest.approx(32 / 80)
