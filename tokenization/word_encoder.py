"""Byte-level BPE encoding word by word, from a cache of words: the same IDs as the tokenizer's own
encode, at a fraction of its cost.

Why: `tokenizers` spends most of an encode in its pre-tokenizer's regex (Oniguruma): ~0.25 us per
character on a 2-core box, ~0.5 ms for a 2,000-character prompt, on the request path before
routing. Text is mostly the same few thousand words, and a byte-level BPE tokenizer encodes each
pre-token (word) on its own: no merge crosses a word. So the text is split here with the same
pattern (the `regex` module runs the GPT-2 / Llama 3 / Qwen patterns about 3x faster) and each
word's IDs come from a dict. A new word goes to the BPE model alone (`model.tokenize` of its
byte-level characters, ~6 us), not through the tokenizer's whole encode (~15 us for one word: its
pipeline, offsets and Encoding cost more than the word), and is remembered; a model with BPE
dropout gets the whole encode.

Used only for a BPE model whose pre-tokenizer is exactly that split and nothing else (ByteLevel
with its regex, or Split(pattern, isolated) then ByteLevel without one), no normalizer, and only
after probe texts give the tokenizer's own pre-tokens (their byte-level characters included) and
IDs. The token cache also compares its first real texts with whole encodes
(tokenization/token_cache.py)."""
from __future__ import annotations

import json
import re
import threading

import regex
import tokenizers

try:  # tokenization/_word_split.c: ASCII_BYTE_LEVEL_PATTERN's findall in one pass
    from tokenization._word_split import ids as _native_ids
    from tokenization._word_split import split as _native_split
except ImportError:  # built without a C compiler: `re` splits, Python puts the IDs together
    _native_ids = _native_split = None

# The pattern `tokenizers`' ByteLevel pre-tokenizer splits on when use_regex is true (GPT-2's).
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same split for ASCII text, in the standard library's `re` (about twice as fast as `regex`
# with Unicode classes: 0.19 vs 0.41 ms for an 8k-character prompt). Used only after it agrees
# with BYTE_LEVEL_PATTERN on every ASCII character in several contexts (_ascii_agrees).
_ASCII_SPACE = "\t\n\x0b\x0c\r "
ASCII_BYTE_LEVEL_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^%s\x80-\uffffA-Za-z0-9]+"""
                            r"""|[%s]+(?![^%s])|[%s]+""") % ((_ASCII_SPACE,) * 4)

def _byte_level_chars() -> list[str]:
    """The character ByteLevel writes for each byte (GPT-2's bytes_to_unicode): printable Latin-1
    bytes as themselves, the others as 256 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, shifted = [""] * 256, 256
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(shifted)
            shifted += 1
    return chars


BYTE_LEVEL_CHARS = _byte_level_chars()


def byte_level(word: str) -> str:
    """`word` as ByteLevel writes it (its UTF-8 bytes as BYTE_LEVEL_CHARS)."""
    return "".join([BYTE_LEVEL_CHARS[byte] for byte in word.encode()])

MAX_WORDS = 262_144    # words remembered; past it the cache starts over (a few tens of MB at most)
MAX_WORD_CHARS = 256   # a longer word (a run of spaces, a base64 blob) is encoded, not remembered
PROBE_TEXT = (  # what a split may treat differently: contractions, numbers, odd spaces, marks
    "It's 42 apples, isn't it? Yes: they're   here.\n\n  Indented\tTab... ünïcode 漢字 🙂 mixed123abc "
    "x=y+z; (paren) [bracket] {brace} 'quote' \"dq\" end_of_line. Next-word foo_bar  double  space\r\n"
    "line 1234567 ½ Ⅷ ² ٣ naïve I'LL WE'VE you'd   \n \n\n\t ")


class WordEncoder:
    """encode(text) == tokenizer.encode(text, add_special_tokens=False).ids for text without added
    tokens (the token cache splits those off first). Thread-safe."""

    def __init__(self, tokenizer, pattern: str) -> None:
        self.tokenizer = tokenizer
        self._findall = regex.compile(pattern).findall
        self._ascii_findall = None  # the faster split of ASCII text, where one agrees with `pattern`
        if pattern == BYTE_LEVEL_PATTERN:
            # tokenization/_word_split.c first (~6x faster than `re` on ASCII text), `re` where
            # the C module was not built or disagrees.
            for ascii_findall in (_native_split, re.compile(ASCII_BYTE_LEVEL_PATTERN).findall):
                if ascii_findall is not None and _ascii_agrees(self._findall, ascii_findall):
                    self._ascii_findall = ascii_findall
                    break
        self._words: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        model = tokenizer.model
        # A new word's IDs from the model alone (see the module doc); the probes check it.
        self._tokenize = (model.tokenize if isinstance(model, tokenizers.models.BPE) and not model.dropout
                          else None)

    @classmethod
    def for_tokenizer(cls, tokenizer, config: dict | None = None) -> "WordEncoder | None":
        """The tokenizer's word encoder, or None where its configuration (tokenizer_config, when
        the caller has it already) is not a plain word split of a byte-level BPE or the probes
        disagree with it."""
        pattern = _split_pattern(tokenizer_config(tokenizer) if config is None else config)
        if pattern is None:
            return None
        try:
            encoder = cls(tokenizer, pattern)
        except regex.error:
            return None
        return encoder if encoder._agrees(PROBE_TEXT) and encoder._agrees(PROBE_TEXT * 3 + " end") else None

    def encode(self, text: str) -> list[int]:
        words = self._ascii_findall(text) if self._ascii_findall is not None and text.isascii() else self._findall(text)
        if _native_ids is not None:
            return _native_ids(words, self._words, self._learn)
        get = self._words.get
        ids: list[int] = []
        for word in words:
            found = get(word)
            if found is None:
                found = self._learn(word)
            ids += found
        return ids

    def _learn(self, word: str) -> list[int]:
        if self._tokenize is not None:  # the word is one pre-token: its byte-level characters, tokenized
            ids = [token.id for token in self._tokenize(byte_level(word))]
        else:
            ids = self.tokenizer.encode(word, add_special_tokens=False).ids
        if len(word) <= MAX_WORD_CHARS:
            with self._lock:
                if len(self._words) >= MAX_WORDS:
                    self._words = {}
                self._words[word] = ids
        return ids

    def _agrees(self, text: str) -> bool:
        pieces = [piece for piece, _ in self.tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        words = self._findall(text)
        if "".join(words) != text:
            return False
        # The tokenizer's pre-tokens come out byte-level mapped ("Ġ" for a space): what _learn
        # hands the model for each word.
        if pieces != [byte_level(word) for word in words]:
            return False
        return self.encode(text) == self.tokenizer.encode(text, add_special_tokens=False).ids


def _ascii_agrees(findall, ascii_findall) -> bool:
    """The two splits cut alike every ASCII character alone, doubled, and between letters, digits,
    spaces and marks, and the probe text's ASCII part."""
    contexts = ("{c}", "{c}{c}", "a{c}b", " {c} ", "1{c}2", "{c} x", "x {c}", "{c}\n", "'{c}s", " {c}{c}  y")
    texts = [form.format(c=chr(code)) for code in range(128) for form in contexts]
    texts.append("".join(ch for ch in PROBE_TEXT if ch.isascii()) * 2)
    return all(findall(text) == ascii_findall(text) for text in texts)


def tokenizer_config(tokenizer) -> dict:
    """The tokenizer's tokenizer.json as a dict ({} where it cannot be serialized)."""
    try:
        return json.loads(tokenizer.to_str())
    except (ValueError, TypeError):
        return {}


def _split_pattern(config: dict) -> str | None:
    """The regex a byte-level BPE tokenizer (its tokenizer_config) cuts words with, when that cut
    is its whole pre-tokenization; else None."""
    if (config.get("model") or {}).get("type") != "BPE" or config.get("normalizer") is not None:
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not steps:
        return None
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True) \
            and not steps[0].get("add_prefix_space"):
        return BYTE_LEVEL_PATTERN
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
            and not steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space"):
        split = steps[0]
        if str(split.get("behavior", "")).lower() == "isolated" and not split.get("invert") \
                and isinstance(split.get("pattern"), dict) and "Regex" in split["pattern"]:
            return split["pattern"]["Regex"]
    return None
