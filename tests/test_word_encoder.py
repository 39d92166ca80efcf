"""Word-by-word encoding (tokenization/word_encoder.py), new words tokenized by the BPE model alone,
gives exactly the tokenizer's own IDs, for the tiny model's GPT-2-style split and for the Llama 3 /
Qwen 2 splits GGUF models carry, on text with every kind of character the splits treat
differently; tokenizers whose pre-tokenization is anything else get no word encoder."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers

from replica.tiny import tiny_checkpoint_dir
from tokenization import TokenizerBundle
from tokenization.gguf_vocab import _LLAMA3_SPLIT, _QWEN2_SPLIT
from tokenization.word_encoder import WordEncoder

PIECES = ["fox", " dog", "  cache", "\n", "\n\n", "\r\n", "\t", " ", "   ", "é", "ünï", "漢字", "🙂", "12", "12345",
          "½", "Ⅷ", "²", "٣", "'s", "'LL", "'ve", "n't", "!?", "...", "_", "foo_bar", "x=y", "(", ")", "\"", "Ça",
          "\u00a0", "\u2003", "\u200b", "\x0b", "\x1c", "a\u0301"]


def tiny() -> Tokenizer:
    return TokenizerBundle.from_hf_dir(tiny_checkpoint_dir()).tokenizer


def texts(seed: int, count: int = 300):
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 80)))


def with_pre_tokenizer(pre) -> Tokenizer:
    tokenizer = tiny()
    tokenizer.pre_tokenizer = pre
    return tokenizer


@pytest.fixture(params=["c", "python"])
def natives(request, monkeypatch):
    """Each test that asks runs with tokenization/_word_split.c and with the Python it replaces."""
    import tokenization.word_encoder as word_encoder
    if request.param == "python":
        monkeypatch.setattr(word_encoder, "_native_split", None)
        monkeypatch.setattr(word_encoder, "_native_ids", None)
    elif word_encoder._native_split is None:
        pytest.skip("tokenization/_word_split.c was not built (no C compiler at install)")
    return request.param


@pytest.mark.parametrize("split", ["byte_level", "llama3", "qwen2"])
def test_word_by_word_ids_are_the_tokenizers_own(split, natives):
    if split == "byte_level":
        tokenizer = tiny()
    else:
        pattern = _LLAMA3_SPLIT if split == "llama3" else _QWEN2_SPLIT
        tokenizer = with_pre_tokenizer(pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    encoder = WordEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    assert encoder._tokenize is not None  # new words go to the BPE model alone: that is what is checked
    for text in texts(seed=len(split)):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, repr(text)


def test_ascii_text_takes_the_faster_split_with_the_tokenizers_own_ids(natives):
    """ASCII text is split by tokenization/_word_split.c, or the standard library's `re` (the GPT-2
    split's ASCII form): the same IDs as the tokenizer on every kind of ASCII piece, control
    characters included."""
    tokenizer = tiny()
    encoder = WordEncoder.for_tokenizer(tokenizer)
    assert encoder._ascii_findall is not None
    ascii_pieces = [piece for piece in PIECES if piece.isascii()] + [chr(code) for code in range(128)]
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice(ascii_pieces) for _ in range(rng.randrange(1, 80)))
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, repr(text)


def test_the_c_split_of_ascii_text_is_the_patterns_findall():
    """tokenization/_word_split.c cuts ASCII text as the standard library's findall of the GPT-2
    split's ASCII form: every character, runs of spaces before words, at the end and before a
    lone newline, contractions and apostrophes that start none; and the tiny model's encoder
    takes it."""
    split = pytest.importorskip("tokenization._word_split").split
    import re
    from tokenization.word_encoder import ASCII_BYTE_LEVEL_PATTERN
    findall = re.compile(ASCII_BYTE_LEVEL_PATTERN).findall
    alphabet = [chr(code) for code in range(128)] + list("   \n\n\t'sdtmrevl") * 4
    rng = random.Random(7)
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        assert split(text) == findall(text), repr(text)
    for text in ("", " ", "a  b", "a  ", "  \nb", "'s 's ''s x'll 'LL 're'", "\x0b\x1c x", "12ab!? ."):
        assert split(text) == findall(text), repr(text)
    with pytest.raises(ValueError):
        split("na\u00efve")
    assert WordEncoder.for_tokenizer(tiny())._ascii_findall is split


@pytest.mark.parametrize("pre", [
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),   # no word split at all
    pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),     # a space added at the start
    pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    pre_tokenizers.Metaspace(),
])
def test_other_pre_tokenizers_get_no_word_encoder(pre):
    assert WordEncoder.for_tokenizer(with_pre_tokenizer(pre)) is None


def test_a_normalizer_means_no_word_encoder():
    config = json.loads(tiny().to_str())
    config["normalizer"] = {"type": "NFC"}
    assert WordEncoder.for_tokenizer(Tokenizer.from_str(json.dumps(config))) is None
