"""Token IDs of text the gateway has tokenized before: an LRU over text pieces, bounded by the
tokens it holds, so a repeated prompt costs a dict lookup and turn k+1 of a chat re-tokenizes only
its new messages.

The rule that makes pieces safe to cache separately: the `tokenizers` library cuts the text at
its added tokens (`<|im_start|>`, `<|im_end|>`, BOS, ...) before anything else runs, and then
tokenizes each stretch between them on its own. So a rendered chat is split here at the same
tokens, each stretch is looked up (or encoded and remembered), and the IDs are concatenated: the
same IDs as one encode of the whole text. That holds when the added tokens match literally (no
normalization, no stripping of the spaces around them, not single-word) and the stretch's
tokenization does not depend on where it starts (no normalizer, no prefix space added at the
start of the text: a SentencePiece `Metaspace` with prepend "first" adds one only at the start).
A bundle whose tokenizer does not say so, or that fails a check against whole-text encodes
(probe strings at first use, then the first CHECKED_ENCODES real texts), encodes whole texts
(still remembered whole).

A long stretch (a completions prompt is one stretch: no added tokens in it) is cut further, at word
starts: a space that follows a non-space and precedes a letter, the first such place at least
CHUNK_CHARS after the last cut. The pre-tokenizers of byte-level BPE tokenizers (GPT-2's regex, and
Llama 3's and Qwen's, which split the same way there) always start a word there and BPE never
merges across words, so the chunks tokenize independently; and the cuts depend only on the text
before them, so two prompts that share a prefix share its chunks. Turn k+1 of a conversation sent
as one completions prompt (what a trace replay sends) then tokenizes its new text and at most one
chunk of the old, not the whole prompt again. Used only where probes show the pre-tokenizer
starts a word at each such place and chunked encodes equal whole ones (then also checked on the
first real texts, as above).

A repeated completions prompt costs one lookup per chunk (the BOS rule applied after)."""
from __future__ import annotations

import json
import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from itertools import accumulate

import structlog

from tokenization.bundle import TokenizerBundle
from tokenization.word_encoder import PROBE_TEXT, WordEncoder, tokenizer_config

log = structlog.get_logger("kvgate.tokenization")

MAX_CACHED_TOKENS = 4_000_000   # ~32 MB: a pointer a token (plus the text keys; the int objects are shared)
MAX_PIECE_CHARS = 1 << 20       # a longer piece is encoded, not remembered
FRESH_COST = 5                  # a token of a piece not asked for again yet, against the bound (see TokenCache)
CHECKED_ENCODES = 32            # real texts also encoded whole and compared, per bundle
CHUNK_CHARS = 256               # a stretch longer than twice this is cached in chunks of about this
_PROBES = ("hello", " leading space", "two  spaces\n\nnewlines\n", "unicode: é 漢字 🙂", "x" * 40, "\n", " ")
# Where a chunk may start: a space after a non-space, before a letter.
_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")
# A chunk: CHUNK_CHARS characters, then up to the next word start (_WORD_START's place); where no
# word start is left, the rest in one piece (so findall never rescans from each later position).
_CHUNK_PIECES = re.compile(r"(?s).{%d}.*?(?=(?<=\S) [^\W\d_])|.+" % CHUNK_CHARS)


class TokenCache:
    """One bundle's cache. Thread-safe (tokenizer threads share it with the loop)."""

    def __init__(self, bundle: TokenizerBundle, max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.bundle = bundle
        self.max_tokens = max_tokens
        # A piece's IDs as a tuple of the vocabulary's own int objects (one per ID, made once): a hit
        # copies pointers into the request's list (~1.5 ns a token) where an int32 array made a
        # new int per token (~15 ns), at 8 bytes a token instead of 4. A piece is first kept as a
        # list of the tokenizer's own ints (a C copy, where mapping each ID to the shared one is
        # ~70 ns a token) and counted FRESH_COST times in the bound (an int object of its own is
        # 28 bytes, its pointer 8): unique prompts, never asked again, skip that work; a piece
        # asked again becomes a tuple of the shared ints (lookup) and counts once.
        self._pieces: OrderedDict[str, tuple | list] = OrderedDict()
        self._ints = list(range(bundle.vocab_size))
        self._tokens = 0  # what the pieces held count against max_tokens
        self._lock = threading.Lock()
        config = tokenizer_config(bundle.tokenizer)  # parsed once: a large vocabulary's JSON takes a while
        self._splitter, self._special_ids = _added_token_splitter(config)
        self._checks_left = CHECKED_ENCODES if self._splitter is not None else 0
        if self._splitter is not None and not self._probe():
            self._splitter = None
        self._chunks = self._splitter is not None and self._probe_chunks()
        # Text between added tokens is encoded word by word where the tokenizer allows it.
        self._word_encoder = (WordEncoder.for_tokenizer(bundle.tokenizer, config)
                              if self._splitter is not None else None)
        self.hits = 0
        self.misses = 0

    @property
    def splits(self) -> bool:
        """Texts are cached stretch by stretch (between added tokens), not only whole."""
        return self._splitter is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """bundle.encode(text, add_special_tokens), from the cache where it can."""
        ids = self.cached(text, add_special_tokens)
        return ids if ids is not None else self.finish(self.lookup(text), add_special_tokens)

    def cached(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """encode()'s IDs where the whole text is one remembered piece (a prompt asked again: one
        dict lookup, no cut, no Lookup), else None (lookup and finish serve it). lookup would cut
        such a text into that one piece: no piece of 64 characters or more holds an added token,
        and while long stretches are chunked no piece is longer than twice a chunk."""
        if self._checks_left:  # the first texts are checked against whole encodes (finish)
            return None
        with self._lock:
            ids = self._pieces.get(text)
            if ids is None or ids.__class__ is list:  # missing, or asked again: lookup shares its ints
                return None
            self._pieces.move_to_end(text)
            self.hits += 1
        ids = list(ids)
        if add_special_tokens and self.bundle.add_bos:
            ids.insert(0, self.bundle.bos_token_id)
        return ids

    def lookup(self, text: str) -> "Lookup":
        """The cache's part of an encode: the text cut the way it is cached (at added tokens, long
        stretches at word starts) and each piece looked up. Cheap (a regex pass and dict lookups);
        what is left to tokenize is `missing_chars` long, for `finish`."""
        splitter = self._splitter
        split = splitter is not None and len(text) >= 64
        if not split:
            keys: list = [text]
        elif len(parts := splitter.split(text)) == 1 and (len(text) <= 2 * CHUNK_CHARS or not self._chunks):
            keys = parts  # one stretch of plain text (a short completions prompt): cached whole
        else:
            keys = []  # a piece's text, or an added token's ID
            special = self._special_ids
            for index, piece in enumerate(parts):
                if index & 1:  # the captured added token
                    keys.append(special[piece])
                elif not piece:
                    continue
                elif not self._chunks or len(piece) <= 2 * CHUNK_CHARS:
                    keys.append(piece)
                else:
                    keys += _chunks(piece)
        found: list = []
        misses: list[str] = []
        pieces = self._pieces
        get, touch = pieces.get, pieces.move_to_end
        hits = 0
        with self._lock:
            for key in keys:
                if key.__class__ is int:
                    found.append(key)
                    continue
                cached = get(key)
                if cached is None:
                    found.append(None)
                    misses.append(key)
                else:
                    touch(key)
                    hits += 1
                    if cached.__class__ is list:  # asked again: kept from now on as the shared ints
                        cached = self._share(key, cached)
                    found.append(cached)
            self.hits += hits
        return Lookup(text, found, misses, split)

    def finish(self, lookup: "Lookup", add_special_tokens: bool = True, release_gil: bool = False) -> list[int]:
        """The IDs of a looked-up text: its missing pieces tokenized (and remembered), then all in order.

        `release_gil`, for a thread other than the event loop: the missing pieces go to the
        tokenizer in one batch call, which releases the GIL for its Rust work and spreads the
        pieces over the cores. The word encoder (Python, holding the GIL, faster on one core)
        serves the loop's own calls, where nothing runs meanwhile anyway: a Python encode in a
        thread stalls the loop for the interpreter's switch interval (5 ms) each time it wants
        the GIL back."""
        misses = lookup.misses
        encoded: list[list[int]] = []
        if misses:
            words = self._word_encoder
            if release_gil or words is None:
                encoded = [e.ids for e in self.bundle.tokenizer.encode_batch(misses, add_special_tokens=False)]
            elif lookup.split:  # plain text between added tokens
                encoded = [words.encode(text) for text in misses]
            else:
                encoded = [self.bundle.encode(misses[0], add_special_tokens=False)]
            self._remember(misses, encoded)
        found = lookup.found
        if len(found) == 1 and encoded:
            ids = encoded[0]
        elif len(found) == 1 and found[0].__class__ is not int:
            ids = list(found[0])  # one piece, cached
        else:
            ids = []
            fresh = iter(encoded)
            for item in found:
                if item is None:
                    ids += next(fresh)
                elif item.__class__ is int:
                    ids.append(item)
                else:
                    ids += item
        if lookup.split and self._checks_left:
            self._check(lookup.text, ids)
        if add_special_tokens and self.bundle.add_bos:
            ids.insert(0, self.bundle.bos_token_id)
        return ids

    def _remember(self, misses: list[str], encoded: list[list[int]]) -> None:
        with self._lock:
            pieces = self._pieces
            for text, ids in zip(misses, encoded):
                self.misses += 1
                if len(text) > MAX_PIECE_CHARS or len(ids) > self.max_tokens // 8 or text in pieces:
                    continue
                pieces[text] = ids[:]  # a copy: the caller's list becomes the request's
                self._tokens += len(ids) * FRESH_COST
                while self._tokens > self.max_tokens:
                    _, old = pieces.popitem(last=False)
                    self._tokens -= len(old) * FRESH_COST if old.__class__ is list else len(old)

    def _share(self, text: str, ids: list[int]) -> tuple:
        """A remembered piece asked for again, as a tuple of the shared ints (under the lock)."""
        shared = self._ints
        size = len(shared)
        stored = self._pieces[text] = tuple([shared[i] if 0 <= i < size else i for i in ids])
        self._tokens -= len(ids) * (FRESH_COST - 1)
        return stored

    def _probe(self) -> bool:
        specials = list(self._special_ids)
        texts = [special.join(_PROBES[i:] + _PROBES[:i]) for i, special in enumerate(specials[:4] or [""])]
        texts += [specials[0] + "x" + specials[-1] + " y" if specials else "x"]
        return all(self._same(text) for text in texts)

    def _probe_chunks(self) -> bool:
        """Whether the pre-tokenizer starts a word at every place _chunks may cut, and chunked
        encodes equal whole ones, on text with punctuation, digits, contractions, odd spaces and
        non-ASCII letters."""
        tokenizer = self.bundle.tokenizer
        if tokenizer.pre_tokenizer is None:
            return False
        text = PROBE_TEXT * 3
        try:
            starts = {start for _, (start, _end) in tokenizer.pre_tokenizer.pre_tokenize_str(text)}
        except Exception:  # a pre-tokenizer the Python side cannot run alone
            return False
        cuts = [match.start() for match in _WORD_START.finditer(text)]
        if not cuts or not starts.issuperset(cuts):
            return False
        whole = tokenizer.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for start, end in zip([0] + cuts, cuts + [len(text)]):
            ids += tokenizer.encode(text[start:end], add_special_tokens=False).ids
        return ids == whole

    def _check(self, text: str, ids: list[int]) -> None:
        self._checks_left -= 1
        whole = self.bundle.encode(text, add_special_tokens=False)
        if whole != ids:
            self._splitter = None
            self._chunks = False
            self._word_encoder = None
            self._checks_left = 0
            log.warning("token_cache_split_disabled", reason="a text encoded in stretches differed from its "
                        "whole encode; whole texts are cached from now on", chars=len(text))

    def _same(self, text: str) -> bool:
        ids: list[int] = []
        for index, piece in enumerate(self._splitter.split(text)):
            if index & 1:
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self.bundle.tokenizer.encode(piece, add_special_tokens=False).ids
        return ids == self.bundle.tokenizer.encode(text, add_special_tokens=False).ids


class Lookup:
    """A text as TokenCache.lookup left it: per piece its cached IDs (a tuple), an added token's
    ID, or None (missing: `misses` holds those pieces' texts; plain text between added tokens
    when the text was split)."""
    __slots__ = ("text", "found", "misses", "split", "missing_chars")

    def __init__(self, text: str, found: list, misses: list[str], split: bool) -> None:
        self.text = text
        self.found = found
        self.misses = misses
        self.split = split  # cut at added tokens and words (checked against whole encodes while checks are left)
        self.missing_chars = sum(map(len, misses)) if misses else 0


def _chunks(text: str) -> list[str]:
    """A long stretch cut into its cached chunks: each cut at the first word start at least
    CHUNK_CHARS after the last cut (or the stretch's start), while more than CHUNK_CHARS remain
    after it. One findall cuts the whole text in C (tests/test_token_cache.py compares it with the
    rule as a search loop); the cuts too close to the end are joined back."""
    pieces = _CHUNK_PIECES.findall(text)
    ends = list(accumulate(map(len, pieces)))
    keep = bisect_left(ends, len(text) - CHUNK_CHARS)  # cuts with more than CHUNK_CHARS after them
    return pieces[:keep] + [text[ends[keep - 1]:]] if keep else [text]


def _added_token_splitter(config: dict) -> tuple[re.Pattern | None, dict[str, int]]:
    """A regex whose split() cuts text at the tokenizer's added tokens, as `tokenizers` does, or
    None where its configuration (tokenizer_config) does not guarantee the pieces tokenize
    independently."""
    added = config.get("added_tokens") or []
    if not added or config.get("normalizer") is not None:
        return None, {}
    if any(token.get("normalized") or token.get("lstrip") or token.get("rstrip") or token.get("single_word")
           for token in added):
        return None, {}
    pre = json.dumps(config.get("pre_tokenizer"))
    if "Metaspace" in pre or '"add_prefix_space": true' in pre or '"prepend_scheme"' in pre:
        return None, {}
    special = {token["content"]: token["id"] for token in added if token.get("content")}
    # Longest first: the leftmost-longest match, as the library's matcher takes it.
    pattern = "(" + "|".join(re.escape(text) for text in sorted(special, key=len, reverse=True)) + ")"
    return re.compile(pattern), special


_caches_lock = threading.Lock()


def token_cache(bundle: TokenizerBundle) -> TokenCache:
    """The bundle's cache, made on first use and kept on the bundle (one attribute read a request)."""
    try:
        return bundle._token_cache
    except AttributeError:
        with _caches_lock:
            cache = bundle.__dict__.get("_token_cache")
            if cache is None:
                cache = bundle._token_cache = TokenCache(bundle)
        return cache


def warmed(bundle: TokenizerBundle) -> TokenizerBundle:
    """The bundle, its cache made and its encode paths run once (prompt text, a chat template):
    called where the tokenizer is loaded, off the event loop, so the first requests after a start
    do not wait for the tokenizer's JSON to be parsed again and the splitter built (~10 ms)."""
    cache = token_cache(bundle)
    cache.encode("Warm-up: a sentence.", add_special_tokens=True)
    try:
        text = bundle.apply_chat_template([{"role": "user", "content": "Warm-up."}], add_generation_prompt=True)
    except ValueError:  # no chat template: chat requests are refused anyway
        return bundle
    cache.encode(text, add_special_tokens=False)
    return bundle
