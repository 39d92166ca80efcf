"""Tokenization agrees with transformers: GGUF-built vocab, chat templates, streaming detokenization."""
import subprocess
import sys
from pathlib import Path

import pytest

from tokenization import IncrementalDetokenizer, TokenizerBundle

transformers = pytest.importorskip("transformers")

VARIED_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi, 1,000,000 is a million and 0x1F is 31.",
    "  leading spaces, trailing spaces   \n\n\ttabs and\r\nwindows newlines",
    "Café naïve résumé über straße — “quotes” and ‘apostrophes’ …",
    "你好，世界。こんにちは。안녕하세요. Привет мир. مرحبا",
    "Emoji: 😀🚀❤️👨‍👩‍👧‍👦 🇫🇷",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    '{"role": "user", "content": [1, 2, 3]} <tag attr="x">&amp;</tag>',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvgate<file_sep>README.md",
    "I'm sure they've said we'll see what you'd do, isn't it?",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why? 😀"}],
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from replica.loader import _smollm2_path

    return _smollm2_path()


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> TokenizerBundle:
    return TokenizerBundle.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from replica.tiny import tiny_checkpoint_dir

    return tiny_checkpoint_dir()


def test_gguf_token_ids_match_transformers(smollm2, hf_smollm2):
    for text in VARIED_TEXTS:
        assert smollm2.encode(text) == hf_smollm2.encode(text), text
        assert smollm2.encode(text, add_special_tokens=False) == hf_smollm2.encode(text, add_special_tokens=False)
    assert smollm2.tokenizer.get_vocab_size() == len(hf_smollm2) == 49152


def test_gguf_numeric_symbols_follow_smollm_pre_tokenizer(smollm2, hf_smollm2):
    """Non-ASCII numerals (½, ², Ⅻ) are \\p{N}: llama.cpp's "smollm" pre-tokenizer and SmolLM2's own
    tokenizer.json (Digits(individual_digits) + ByteLevel) isolate them, so " ½" is [" ", "½"].
    transformers' GGUF converter uses plain GPT-2 splitting and gives [" \\xc2", "\\xbd"] there;
    with SmolLM2's pre-tokenizer swapped in, it agrees with us, so vocab and merges are identical."""
    from tokenizers import Tokenizer, pre_tokenizers

    text = "Take ½ cup, x² + y², chapter Ⅻ, 3½ and ¾ of 1⁄4."
    reference = Tokenizer.from_str(hf_smollm2.backend_tokenizer.to_str())  # a copy: the fixture is shared
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    assert smollm2.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert smollm2.tokenizer.encode(" ½").tokens == ["Ġ", "Â½"]


def test_gguf_decode_matches_transformers(smollm2, hf_smollm2):
    for text in VARIED_TEXTS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids, skip_special_tokens=False) == hf_smollm2.decode(ids) == text
        assert smollm2.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens(smollm2):
    assert smollm2.bos_token == "<|im_start|>" and smollm2.eos_token == "<|im_end|>"
    assert smollm2.add_bos is False
    assert smollm2.stop_token_ids[0] == 2 and 0 in smollm2.stop_token_ids  # <|im_end|>, <|endoftext|>
    assert smollm2.encode("<|im_start|>") == [1]


def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            theirs = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours == theirs


def test_chat_content_parts_are_joined(smollm2):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert smollm2.apply_chat_template(parts) == smollm2.apply_chat_template(plain)


def test_missing_chat_template_is_a_clear_error(smollm2):
    bundle = TokenizerBundle(smollm2.tokenizer, chat_template=None)
    with pytest.raises(ValueError, match="chat template"):
        bundle.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_dir_bundle_matches_transformers(tiny_dir):
    bundle = TokenizerBundle.from_hf_dir(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in VARIED_TEXTS:
        assert bundle.encode(text) == hf.encode(text), text
    for messages in CONVERSATIONS:
        assert bundle.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    im_end, endoftext = bundle.tokenizer.token_to_id("<|im_end|>"), bundle.tokenizer.token_to_id("<|endoftext|>")
    assert bundle.stop_token_ids == [im_end, endoftext]
    assert bundle.bos_token_id == endoftext and bundle.add_bos is False


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_incremental_detokenizer_deltas_concatenate_to_decode(which, smollm2, tiny_dir):
    bundle = smollm2 if which == "smollm2" else TokenizerBundle.from_hf_dir(tiny_dir)
    for text in VARIED_TEXTS[3:7] + ["Mixed 😀 emoji 🚀 and 汉字 in 1 line, ✓ done."]:
        ids = bundle.encode(text)
        detok = IncrementalDetokenizer(bundle)
        deltas = [detok.add(token_id) for token_id in ids]
        assert "".join(deltas) == detok.text == bundle.decode(ids), text
        assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_skips_special_tokens(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nSure 😀<|im_end|>")
    detok = IncrementalDetokenizer(smollm2)
    assert "".join(detok.add(i) for i in ids) == "assistant\nSure 😀"
    keep = IncrementalDetokenizer(smollm2, skip_special_tokens=False)
    assert "".join(keep.add(i) for i in ids) == "<|im_start|>assistant\nSure 😀<|im_end|>"


def test_payload_round_trip(smollm2):
    restored = TokenizerBundle.from_payload(smollm2.to_payload())
    for attr in ("chat_template", "bos_token", "eos_token", "bos_token_id", "stop_token_ids", "add_bos"):
        assert getattr(restored, attr) == getattr(smollm2, attr), attr
    for text in VARIED_TEXTS:
        assert restored.encode(text) == smollm2.encode(text)
    assert restored.apply_chat_template(CONVERSATIONS[0]) == smollm2.apply_chat_template(CONVERSATIONS[0])


def test_add_bos_prepends_bos_once(smollm2):
    bundle = TokenizerBundle(smollm2.tokenizer, bos_token="<|im_start|>", add_bos=True)
    assert bundle.encode("hi") == [1, *smollm2.encode("hi")]
    assert bundle.encode("hi", add_special_tokens=False) == smollm2.encode("hi")


def test_tokenization_package_does_not_import_torch(tiny_dir):
    code = (
        "import sys, gguf; from tokenization import TokenizerBundle, IncrementalDetokenizer; "
        f"TokenizerBundle.from_hf_dir({str(tiny_dir)!r}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
