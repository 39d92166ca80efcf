"""Workloads for the routing benches: who sends what, when, as text, the same for every router.

Every prompt is built from *units*. A unit id stands for one fixed run of 16 words, each a word the
tiny model's tokenizer holds as one token with its leading space (" the", " cache", ...). A word
never merges with its neighbours (the tokenizer's pre-split keeps " word" pieces apart), so a unit
is exactly 16 tokens = one KV block wherever it appears, and equal unit prefixes give equal text
prefixes and equal token-ID prefixes. Routers that match text (sglang-router) and routers that
match tokens (kvgate) see the same sharing.

    chat    N conversations on one shared system prompt (~30% of the first turn); each turn resends
            the conversation so far plus a reply and a new user message, after a think time;
            conversation lengths have a long tail. /v1/chat/completions with messages.
    agent   agent loops on one shared tool-use system prompt: each step resends the context plus
            the previous step's tool call and a tool output of a few hundred tokens.
    trace   a Mooncake-format JSONL trace replayed: each hash id (512 tokens in Mooncake) becomes
            one unit (16 tokens, 1/32 of the size), a partial last block a prefix of its unit in
            proportion, outputs scaled the same way; arrivals from the timestamps, time-scaled.
            /v1/completions with the text.
    groups  G prefix groups x R requests: a shared prefix plus a unique suffix (bench.cache_routing's
            original workload), Poisson arrivals. /v1/completions with the text.

Requests stream with `stream_options.include_usage`, as chat clients do, unless told otherwise.
`python -m bench.workloads --stats` prints each workload's size and oracle hit rates;
`--write-trace chat FILE` writes the chat workload as a Mooncake trace (hash ids = units).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

UNIT_TOKENS = 16             # tokens per unit = the replicas' KV block size
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in a Mooncake trace
TRACE_SCALE = MOONCAKE_BLOCK_TOKENS // UNIT_TOKENS  # 32: Mooncake tokens per replayed token
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MODEL_CONTEXT_TOKENS = 2048  # the tiny model's context: prompt + output must fit

# One token each with a leading space in the tiny tokenizer (tests/test_bench_workloads.py checks).
WORDS = (
    "a add already and are b block c ca capital cu equal f France g gateway has i in is it k l "
    "learn me o of one p paint pre prefix r re replica request ro robot s st t the to token w "
    "who you W Fran alrea blo equ gatew hashe lea pa prefi repli requ ret"
).split()


def unit_text(unit: int, words: int = UNIT_TOKENS) -> str:
    """The text of unit `unit` (its first `words` words): " w1 w2 ...", fixed by the id alone."""
    digest = hashlib.blake2b(unit.to_bytes(8, "little", signed=True), digest_size=UNIT_TOKENS).digest()
    return "".join(" " + WORDS[b % len(WORDS)] for b in digest[:words])


def units_text(units, last_words: int = UNIT_TOKENS) -> str:
    units = list(units)
    return "".join(unit_text(u) for u in units[:-1]) + (unit_text(units[-1], last_words) if units else "")


@dataclass(frozen=True)
class Request:
    arrival_s: float
    session: int                  # conversation, agent, trace chain (first hash id) or group
    units: tuple[int, ...]        # the prompt's content as unit ids, in order (a Mooncake record's hash_ids)
    max_tokens: int
    messages: tuple[dict, ...] | None = None  # chat; else `prompt`
    prompt: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str, stream: bool = True) -> dict:
        body: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.messages is not None:
            body["messages"] = [dict(m) for m in self.messages]
        else:
            body["prompt"] = self.prompt
        if stream:  # sglang-router refuses stream_options without stream
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Request]       # by arrival

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


class _Units:
    """Fresh unit ids: each piece of generated content gets its own."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, count: int) -> tuple[int, ...]:
        self.next += count
        return tuple(range(self.next - count, self.next))


def _prompt_tokens(units: int, messages: int) -> int:
    """A chat prompt's length, bounded above: the units plus ChatML's framing (<8 tokens a message)."""
    return units * UNIT_TOKENS + 8 * (messages + 1)


def _message(role: str, units: tuple[int, ...], **extra) -> dict:
    return {"role": role, "content": units_text(units), **extra}


# -- (a) chat -----------------------------------------------------------------------------------

@dataclass
class ChatSettings:
    conversations: int = 170
    system_units: int = 6                 # shared system prompt: 96 tokens
    first_user_units: tuple[int, int] = (10, 18)   # -> the system prompt is ~30% of the first turn
    user_units: tuple[int, int] = (1, 10)          # later user messages
    reply_units: tuple[int, int] = (2, 6)          # the assistant replies the client resends
    turns_alpha: float = 1.0              # turns ~ Pareto(alpha): a long tail, capped by the context
    max_turns: int = 12
    start_window_s: float = 34.0          # conversations start Poisson over this window
    duration_s: float = 40.0              # turns later than this are not sent (the conversation ends)
    think_mean_s: float = 4.0             # between a turn and the next (exponential, + think_min_s)
    think_min_s: float = 0.5
    max_tokens: int = 16
    max_prompt_tokens: int = 1900         # stop a conversation before its prompt outgrows the context
    seed: int = 0


def chat(s: ChatSettings = ChatSettings()) -> Workload:
    rng = random.Random(s.seed)
    ids = _Units(1 << 20)
    system = ids.take(s.system_units)
    requests: list[Request] = []
    start = 0.0
    for conversation in range(s.conversations):
        start += rng.expovariate(s.conversations / s.start_window_s)
        turns = min(s.max_turns, int(rng.paretovariate(s.turns_alpha)))
        user = ids.take(rng.randint(*s.first_user_units))
        messages = [_message("system", system), _message("user", user)]
        units = system + user
        t = start
        for turn in range(turns):
            if turn:
                reply, user = ids.take(rng.randint(*s.reply_units)), ids.take(rng.randint(*s.user_units))
                if _prompt_tokens(len(units) + len(reply) + len(user), len(messages) + 2) > s.max_prompt_tokens:
                    break
                t += s.think_min_s + rng.expovariate(1 / s.think_mean_s)
                if t > s.duration_s:
                    break
                messages += [_message("assistant", reply), _message("user", user)]
                units += reply + user
            requests.append(Request(t, conversation, units, s.max_tokens, messages=tuple(messages)))
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("chat", f"{s.conversations} conversations, shared {s.system_units * UNIT_TOKENS}-token system "
                            f"prompt, Pareto({s.turns_alpha}) turns, think {s.think_mean_s:g} s", requests)


# -- (b) agent ----------------------------------------------------------------------------------

@dataclass
class AgentSettings:
    agents: int = 75
    system_units: int = 16                # shared tool-use system prompt: 256 tokens
    task_units: tuple[int, int] = (2, 8)
    call_units: tuple[int, int] = (1, 2)  # the assistant's tool call the client resends
    tool_units: tuple[int, int] = (8, 24)  # tool output: 128-384 tokens
    max_steps: int = 8
    start_window_s: float = 34.0
    duration_s: float = 40.0              # steps later than this are not sent (the loop ends)
    tool_mean_s: float = 3.0              # tool run time between steps (exponential, + tool_min_s)
    tool_min_s: float = 0.2
    max_tokens: int = 16
    max_prompt_tokens: int = 1900
    seed: int = 0


def agent(s: AgentSettings = AgentSettings()) -> Workload:
    rng = random.Random(s.seed + 1)
    ids = _Units(2 << 20)
    system = ids.take(s.system_units)
    requests: list[Request] = []
    start = 0.0
    for loop in range(s.agents):
        start += rng.expovariate(s.agents / s.start_window_s)
        task = ids.take(rng.randint(*s.task_units))
        messages = [_message("system", system), _message("user", task)]
        units = system + task
        t = start
        for step in range(s.max_steps):
            if step:
                call, output = ids.take(rng.randint(*s.call_units)), ids.take(rng.randint(*s.tool_units))
                if _prompt_tokens(len(units) + len(call) + len(output), len(messages) + 2) > s.max_prompt_tokens:
                    break
                t += s.tool_min_s + rng.expovariate(1 / s.tool_mean_s)
                if t > s.duration_s:
                    break
                messages += [_message("assistant", call),
                             _message("tool", output, tool_call_id=f"call_{loop}_{step}")]
                units += call + output
            requests.append(Request(t, loop, units, s.max_tokens, messages=tuple(messages)))
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("agent", f"{s.agents} agent loops, shared {s.system_units * UNIT_TOKENS}-token system prompt, "
                             f"tool outputs {s.tool_units[0] * UNIT_TOKENS}-{s.tool_units[1] * UNIT_TOKENS} tokens",
                    requests)


# -- (c) Mooncake trace -------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path, limit: int | None = None) -> list[TraceRecord]:
    """A Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids), first `limit` lines."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                records.append(TraceRecord(float(raw["timestamp"]), int(raw["input_length"]),
                                           int(raw["output_length"]), tuple(int(h) for h in raw["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake record ({exc})") from None
    return records


def write_mooncake(workload: Workload, path) -> None:
    """The workload as a Mooncake trace at Mooncake's scale (one unit = one 512-token hash id)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in workload.requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": len(r.units) * MOONCAKE_BLOCK_TOKENS,
                                "output_length": r.max_tokens * TRACE_SCALE, "hash_ids": list(r.units)}) + "\n")


@dataclass
class TraceSettings:
    path: str = str(SHIPPED_TRACE)
    requests: int = 600                   # the first N records
    duration_s: float | None = 40.0       # time-scale the arrivals to span this; None: as recorded
    max_tokens_cap: int = 32
    max_prompt_tokens: int = 1900         # longer prompts keep their first units (prefixes stay equal)


def trace(s: TraceSettings = TraceSettings()) -> Workload:
    records = load_mooncake(s.path, s.requests)
    if not records:
        raise ValueError(f"{s.path}: no records")
    t0 = records[0].timestamp_ms
    span_s = (records[-1].timestamp_ms - t0) / 1000
    time_scale = s.duration_s / span_s if s.duration_s and span_s > 0 else 1.0
    max_units = s.max_prompt_tokens // UNIT_TOKENS
    requests = []
    for r in records:
        if not r.hash_ids:
            continue
        units = r.hash_ids[:max_units]
        last_words = UNIT_TOKENS
        if len(units) == len(r.hash_ids):  # the last block of the record may be partial
            partial = r.input_length - MOONCAKE_BLOCK_TOKENS * (len(units) - 1)
            last_words = min(UNIT_TOKENS, max(1, math.ceil(partial / TRACE_SCALE)))
        max_tokens = min(s.max_tokens_cap, max(1, round(r.output_length / TRACE_SCALE)))
        requests.append(Request((r.timestamp_ms - t0) / 1000 * time_scale, units[0], units, max_tokens,
                                prompt=units_text(units, last_words)))
    requests.sort(key=lambda r: r.arrival_s)
    name = Path(s.path).name
    return Workload(f"trace:{name}", f"{name}, first {len(requests)} records, arrivals x{time_scale:.2f} "
                                     f"(one 512-token hash id -> {UNIT_TOKENS} tokens)", requests)


# -- (d) groups ---------------------------------------------------------------------------------

@dataclass
class GroupsSettings:
    groups: int = 32
    per_group: int = 12
    prefix_units: int = 64                # 1,024-token shared prefix
    suffix_units: int = 4                 # 64-token unique suffix
    max_tokens: int = 8
    rate_rps: float = 10.0
    seed: int = 0


def groups(s: GroupsSettings = GroupsSettings()) -> Workload:
    rng = random.Random(s.seed + 3)
    ids = _Units(3 << 20)
    prefixes = [ids.take(s.prefix_units) for _ in range(s.groups)]
    order = [g for g in range(s.groups) for _ in range(s.per_group)]
    rng.shuffle(order)
    t, requests = 0.0, []
    for g in order:
        t += rng.expovariate(s.rate_rps)
        units = prefixes[g] + ids.take(s.suffix_units)
        requests.append(Request(t, g, units, s.max_tokens, prompt=units_text(units)))
    return Workload("groups", f"{s.groups} groups x {s.per_group}, {s.prefix_units * UNIT_TOKENS}-token prefix + "
                              f"{s.suffix_units * UNIT_TOKENS}-token suffix, Poisson {s.rate_rps:g} req/s", requests)


# -- token IDs and the oracle -------------------------------------------------------------------

def prompt_token_ids(request: Request, bundle) -> list[int]:
    """The IDs a replica computes for this request: the gateway's own rule (gateway.prompts)."""
    from gateway.prompts import tokenize_request
    from protocol.requests import decode_chat, decode_completion
    raw = json.dumps(request.body("m", stream=False)).encode()
    decoded = decode_chat(raw) if request.messages is not None else decode_completion(raw)
    return tokenize_request(decoded, bundle)


def tiny_bundle():
    from replica.tiny import tiny_checkpoint_dir
    from tokenization import TokenizerBundle
    return TokenizerBundle.from_hf_dir(tiny_checkpoint_dir())


@dataclass
class CacheSim:
    hit_rate: float               # LRU caches of the given capacity
    unbounded_hit_rate: float     # the same with no eviction at all
    unique_blocks: int


def simulate_lru(token_lists, capacity_blocks: int, replica_of=None, block_size: int = UNIT_TOKENS) -> CacheSim:
    """LRU prefix caches replaying the arrival order: per request, the longest cached prefix of its
    full blocks, never the block holding the last token (as the replicas and vLLM count), then every
    full block inserted as most recent. One cache of `capacity_blocks` (the oracle: the replicas'
    summed capacity), or one per replica of that size each when `replica_of(index)` places request
    `index` (a fixed placement, for sizing a workload)."""
    from routing.hashing import block_hashes
    caches: dict[int, OrderedDict[int, None]] = {}
    seen: set[int] = set()
    hit_tokens = unbounded_tokens = query_tokens = 0
    for index, tokens in enumerate(token_lists):
        cache = caches.setdefault(replica_of(index) if replica_of else 0, OrderedDict())
        hashes = block_hashes(tokens, block_size)
        reusable = hashes[:(len(tokens) - 1) // block_size]
        hit_tokens += block_size * next((i for i, h in enumerate(reusable) if h not in cache), len(reusable))
        unbounded_tokens += block_size * next((i for i, h in enumerate(reusable) if h not in seen), len(reusable))
        query_tokens += len(tokens)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        seen.update(hashes)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return CacheSim(hit_tokens / query_tokens if query_tokens else 0.0,
                    unbounded_tokens / query_tokens if query_tokens else 0.0, len(seen))


# -- selection ----------------------------------------------------------------------------------

WORKLOADS = {"a": "chat", "b": "agent", "c": "trace", "d": "groups"}


@dataclass
class Selection:
    """Which workloads, at which size: the benches' flags land here."""
    chat: ChatSettings = field(default_factory=ChatSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    trace: TraceSettings = field(default_factory=TraceSettings)
    groups: GroupsSettings = field(default_factory=GroupsSettings)

    def quick(self) -> None:
        """About a quarter of the traffic: for trying the machinery, not for figures."""
        self.chat.conversations, self.chat.start_window_s, self.chat.duration_s, self.chat.think_mean_s = 24, 3.0, 5.0, 1.0
        self.agent.agents, self.agent.start_window_s, self.agent.duration_s, self.agent.tool_mean_s = 12, 3.0, 5.0, 0.5
        self.trace.requests, self.trace.duration_s = 60, 5.0
        self.groups.groups, self.groups.per_group = 8, 6

    def seed(self, seed: int) -> None:
        self.chat.seed = self.agent.seed = self.groups.seed = seed

    @classmethod
    def from_args(cls, args) -> "Selection":
        """From a bench's flags: --quick, --seed, --trace (and --trace-requests, --trace-duration-s
        where the bench has them)."""
        selection = cls()
        if args.quick:
            selection.quick()
        selection.seed(args.seed)
        if args.trace:
            selection.trace.path = args.trace
        if getattr(args, "trace_requests", None):
            selection.trace.requests = args.trace_requests
        if getattr(args, "trace_duration_s", None) is not None:
            selection.trace.duration_s = args.trace_duration_s or None
        return selection

    def build(self, key: str) -> Workload:
        name = WORKLOADS.get(key, key)
        if name == "chat":
            return chat(self.chat)
        if name == "agent":
            return agent(self.agent)
        if name == "trace":
            if self.trace.path == "chat":  # the chat workload through the trace path: text, not messages
                return _chat_as_trace(self)
            return trace(self.trace)
        if name == "groups":
            return groups(self.groups)
        raise ValueError(f"unknown workload {key!r} (choose from {', '.join(f'{k}={v}' for k, v in WORKLOADS.items())})")


def _chat_as_trace(selection: Selection) -> Workload:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="kvgate-chat-trace-") as tmp:
        path = Path(tmp) / "chat_trace.jsonl"
        write_mooncake(chat(selection.chat), path)
        settings = TraceSettings(**{**selection.trace.__dict__, "path": str(path), "duration_s": None})
        workload = trace(settings)
    workload.name = "trace:chat"
    return workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="a,b,c,d", help="a=chat, b=agent, c=trace, d=groups")
    parser.add_argument("--trace", default=None, help=f"Mooncake JSONL for (c), or 'chat' (default {SHIPPED_TRACE})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--capacity-blocks", type=int, default=768, help="KV blocks per replica")
    parser.add_argument("--stats", action="store_true", help="size and oracle hit rates of each workload")
    parser.add_argument("--write-trace", nargs=2, metavar=("WORKLOAD", "FILE"),
                        help="write a workload as a Mooncake JSONL trace")
    args = parser.parse_args(argv)
    selection = Selection.from_args(args)
    if args.write_trace:
        key, path = args.write_trace
        write_mooncake(selection.build(key), path)
        print(f"wrote {path}")
    if args.stats or not args.write_trace:
        bundle = tiny_bundle()
        for key in args.workloads.split(","):
            w = selection.build(key)
            tokens = [prompt_token_ids(r, bundle) for r in w.requests]
            pooled = args.replicas * args.capacity_blocks
            o = simulate_lru(tokens, pooled)
            sessions = [r.session for r in w.requests]
            sticky = simulate_lru(tokens, args.capacity_blocks, lambda i: hash(sessions[i]) % args.replicas)
            spread = simulate_lru(tokens, args.capacity_blocks, lambda i: i % args.replicas)
            lengths = sorted(len(t) for t in tokens)
            print(f"{w.name}: {w.description}\n  {len(w.requests)} requests over {w.duration_s:.0f} s "
                  f"({len(w.requests) / max(w.duration_s, 1e-9):.1f} req/s), {len({r.session for r in w.requests})} sessions; "
                  f"prompt tokens mean {sum(lengths) / len(lengths):.0f} p50 {lengths[len(lengths) // 2]} max {lengths[-1]}; "
                  f"unique blocks {o.unique_blocks} ({o.unique_blocks / pooled:.2f}x pooled)\n  hit rates: oracle {o.hit_rate:.1%} "
                  f"(unbounded {o.unbounded_hit_rate:.1%}); {args.replicas} LRUs: sessions by hash {sticky.hit_rate:.1%}, "
                  f"round robin {spread.hit_rate:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
