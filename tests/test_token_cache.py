"""The tokenization cache gives exactly the IDs a fresh tokenization gives: multi-turn chats cached
stretch by stretch between added tokens, repeated prompts whole, a tokenizer whose stretches are
not independent never split, memory bounded."""
from __future__ import annotations

import json
import random

from tokenizers import Tokenizer

from replica.tiny import tiny_checkpoint_dir
from tokenization import TokenizerBundle
from tokenization.token_cache import FRESH_COST, TokenCache, token_cache

WORDS = ["fox", " dog", "  cache", "\n", "block\n\n", "é", "漢字", "🙂", " ", "<|im", "end|>", "12", "!?"]


def bundle() -> TokenizerBundle:
    return TokenizerBundle.from_hf_dir(tiny_checkpoint_dir())


def test_a_chat_turn_by_turn_has_the_ids_of_a_fresh_tokenization():
    tiny = bundle()
    cache = TokenCache(tiny)
    assert cache.splits
    rng = random.Random(7)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 6}]
    for turn in range(12):
        messages.append({"role": "user", "content": "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60)))})
        text = tiny.apply_chat_template(messages)
        misses = cache.misses
        assert cache.encode(text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)
        if turn:
            assert cache.misses - misses <= 2  # only the new message (and the generation prompt) tokenized
        messages.append({"role": "assistant", "content": "".join(rng.choice(WORDS) for _ in range(20))})


def test_a_repeated_prompt_is_remembered_with_its_bos_rule():
    tiny = bundle()
    cache = token_cache(tiny)
    assert token_cache(tiny) is cache
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    first = cache.encode(prompt)
    hits = cache.hits
    assert cache.encode(prompt) == first == tiny.encode(prompt)
    assert cache.hits == hits + 1
    assert cache.encode(prompt, add_special_tokens=False) == tiny.encode(prompt, add_special_tokens=False)


def test_a_tokenizer_whose_stretches_depend_on_their_start_is_never_split():
    # A SentencePiece-style pre-tokenizer that prefixes the text's first word only: stretches
    # tokenized on their own would each get the prefix, so the cache must take whole texts.
    config = json.loads(bundle().tokenizer.to_str())
    config["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}
    odd = TokenizerBundle(Tokenizer.from_str(json.dumps(config)), chat_template=bundle().chat_template)
    cache = TokenCache(odd)
    assert not cache.splits
    text = odd.apply_chat_template([{"role": "user", "content": "hello there"}] * 3)
    assert cache.encode(text, add_special_tokens=False) == odd.encode(text, add_special_tokens=False)


def test_the_cache_holds_at_most_its_token_budget():
    tiny = bundle()
    cache = TokenCache(tiny, max_tokens=400)
    for n in range(200):
        text = f"prompt number {n} " * 4
        assert cache.encode(text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)
    assert cache._tokens <= 400 and len(cache._pieces) < 200


def test_a_completions_prompt_extended_turn_by_turn_tokenizes_only_its_new_text():
    # A conversation replayed as one completions prompt per turn (what a trace replay sends): the
    # prompt is one stretch, cut into chunks at word starts, so turn k+1 finds turn k's chunks.
    tiny = bundle()
    cache = TokenCache(tiny)
    rng = random.Random(11)
    words = WORDS + [" the", " gateway", " routes", ". Then", ", and", " it's", " 2024", " naïve", "x"]
    prompt = "System: you are a careful assistant. " * 20
    for turn in range(15):
        prompt += "".join(rng.choice(words) for _ in range(rng.randrange(20, 120)))
        held = sum(map(len, cache._pieces.values()))  # tokens remembered so far
        ids = cache.encode(prompt)
        assert ids == tiny.encode(prompt)
        if turn:  # it tokenized the new words and a chunk or two of the old, not the whole prompt
            added = sum(map(len, cache._pieces.values())) - held
            assert added - (len(ids) - previous) < 0.3 * previous, "the old text was tokenized again"
        previous = len(ids)


def test_chunks_are_never_cut_where_the_tokenizer_does_not_start_a_word():
    # ByteLevel without its regex: the whole stretch is one word, so chunks would tokenize apart
    # from each other differently; the cache must keep such a stretch whole.
    config = json.loads(bundle().tokenizer.to_str())
    config["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                               "use_regex": False}
    odd = TokenizerBundle(Tokenizer.from_str(json.dumps(config)), chat_template=bundle().chat_template)
    cache = TokenCache(odd)
    text = "a gateway routes the request to the replica that holds its prefix. " * 40
    assert cache.encode(text) == odd.encode(text)
    assert cache.misses == 1


def test_a_lookup_finished_on_a_worker_thread_gives_the_tokenizers_ids_and_is_remembered():
    """What the gateway does with a long new prompt: look it up on the loop, tokenize what is
    missing on a thread in the tokenizer's GIL-free batch call, then serve it from the cache."""
    from concurrent.futures import ThreadPoolExecutor

    tiny = bundle()
    cache = TokenCache(tiny)
    rng = random.Random(11)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 30}]
    for turn in range(6):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(400))})
        messages.append({"role": "assistant", "content": "Noted: " + " ".join(rng.choice(WORDS) for _ in range(80))})
    text = tiny.apply_chat_template(messages)
    lookup = cache.lookup(text)
    assert lookup.missing_chars > 0.9 * len(text) and len(lookup.misses) > 10  # stretches and chunks
    with ThreadPoolExecutor(1) as pool:
        ids = pool.submit(cache.finish, lookup, False, True).result()
    assert ids == tiny.tokenizer.encode(text, add_special_tokens=False).ids
    again = cache.lookup(text)
    assert again.missing_chars == 0 and cache.finish(again, add_special_tokens=False) == ids


def test_a_short_prompt_that_arrives_with_a_long_new_one_is_tokenized_first():
    """The gateway tokenizes on its loop: of requests that arrive together, a long new prompt lets
    the shorter ones go ahead (gateway.prompts.YIELD_CHARS), so they reach a replica first."""
    import asyncio

    import msgspec

    from gateway.prompts import YIELD_CHARS, prompt_token_ids
    from protocol.requests import decode_completion

    tiny = bundle()
    rng = random.Random(5)
    long_prompt = " ".join(f"w{rng.randrange(10**9)}" for _ in range(YIELD_CHARS))  # all new text
    short_prompt = "A short question?"

    async def both() -> list[str]:
        done: list[str] = []

        async def one(name: str, prompt: str) -> None:
            request = decode_completion(msgspec.json.encode({"model": "tiny", "prompt": prompt}))
            ids = await prompt_token_ids(request, tiny)
            assert ids == tiny.encode(prompt)
            done.append(name)
        await asyncio.gather(one("long", long_prompt), one("short", short_prompt))  # the long one starts first
        return done

    assert asyncio.run(both()) == ["short", "long"]


def test_a_piece_asked_again_holds_the_vocabularys_shared_ints_and_ids_past_it_as_they_are():
    """A remembered piece is kept as the tokenizer gave it, counted FRESH_COST times against the
    bound; asked again, it holds each ID as the table's one int object (memory: a shared pointer,
    not an int per token) and counts once. An ID the table does not have (past the vocabulary, or
    negative) is kept exactly, not looked up."""
    tiny = bundle()
    cache = TokenCache(tiny)
    size = len(cache._ints)
    fresh = [[5, 300, size - 1], [7, size, size + 9], [-1, 3]]
    texts = ["plain", "odd", "negative"]
    cache._remember(texts, [ids[:] for ids in fresh])
    assert cache._tokens == 8 * FRESH_COST
    assert [cache.encode(text, add_special_tokens=False) for text in texts] == fresh  # asked again
    assert [cache._pieces[text] for text in texts] == [tuple(ids) for ids in fresh]
    assert cache._tokens == 8
    assert all(a is b for a, b in zip(cache._pieces["plain"], (cache._ints[5], cache._ints[300], cache._ints[size - 1])))


def _chunks_by_search(text: str) -> list[str]:
    """The chunking rule as a loop: the first word start at least CHUNK_CHARS after the last cut,
    while more than CHUNK_CHARS remain after it."""
    from tokenization.token_cache import _WORD_START, CHUNK_CHARS

    limit = len(text) - CHUNK_CHARS
    chunks: list[str] = []
    start, at = 0, CHUNK_CHARS
    while at < limit:
        match = _WORD_START.search(text, at)
        if match is None or match.start() >= limit:
            break
        chunks.append(text[start:match.start()])
        start, at = match.start(), match.start() + CHUNK_CHARS
    chunks.append(text[start:])
    return chunks


def test_long_stretches_are_cut_where_the_search_loop_cuts_them():
    """_chunks cuts a stretch with one findall; _chunks_by_search is the rule as a loop (the first
    word start at least CHUNK_CHARS after the last cut, while more than CHUNK_CHARS remain): both
    give the same chunks on random text of every size around the limits, and the chunks are the
    whole text."""
    from tokenization.token_cache import CHUNK_CHARS, _chunks

    rng = random.Random(11)
    alphabet = ["a", "Z", "é", "漢", " ", "  ", "\n", "1", "_", "-", "x y", " q", "\t", "🙂"]
    sizes = [0, 1, CHUNK_CHARS - 1, CHUNK_CHARS, CHUNK_CHARS + 1, 2 * CHUNK_CHARS, 2 * CHUNK_CHARS + 1, 3000]
    for n in range(3000):
        size = sizes[n % len(sizes)] if n < 400 else rng.randrange(0, 4000)
        weights = [rng.random() for _ in alphabet]
        text = "".join(rng.choices(alphabet, weights, k=size))[:size]
        chunks = _chunks(text)
        assert chunks == _chunks_by_search(text), text
        assert "".join(chunks) == text


def test_a_prompt_asked_again_whole_is_served_from_its_one_piece_with_the_ids_of_a_fresh_tokenization():
    """cached(): a text that is one remembered piece (a repeated short prompt, with or without added
    tokens under 64 characters, a one-stretch prompt up to twice a chunk) gives the tokenizer's IDs
    and BOS rule from one lookup; a text lookup cuts in several pieces (a chat, a long chunked prompt)
    is left to lookup, and encode gives the tokenizer's IDs either way."""
    tiny = bundle()
    cache = TokenCache(tiny)
    rng = random.Random(11)
    specials = ["<|im_start|>", "<|im_end|>"]
    texts = ["".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12))) + rng.choice(specials) + "x",  # < 64
             "The quick brown fox jumps over the lazy dog. " * 3,  # one stretch
             "".join(rng.choice(WORDS) for _ in range(400)),  # chunked
             tiny.apply_chat_template([{"role": "user", "content": "hello there, " * 10}])]  # split at added tokens
    texts = [text for text in texts for _ in range(cache._checks_left)]  # past the checks against whole encodes
    for text in texts:
        assert cache.encode(text) == tiny.encode(text)
    assert cache._checks_left == 0
    whole = {text for text in texts if cache._pieces.get(text)}
    assert len(whole) == 2  # the short one and the one stretch are single pieces
    for text in set(texts):
        for add_special_tokens in (True, False):
            served = cache.cached(text, add_special_tokens)
            assert served is None if text not in whole else served == tiny.encode(text, add_special_tokens)
            assert cache.encode(text, add_special_tokens) == tiny.encode(text, add_special_tokens)
    hits = cache.hits
    assert cache.cached(texts[len(texts) // 4]) is not None and cache.hits == hits + 1  # a hit counted
