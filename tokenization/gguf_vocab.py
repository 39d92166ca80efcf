"""Byte-level BPE tokenizer rebuilt from a GGUF file's own vocabulary, merges and token types.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` metadata; this turns that
back into a `tokenizers.Tokenizer` that splits text the way the vocabulary was trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass
class GGUFTokenizerSpec:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    tokens: list[str]


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet byte-level BPE tokens are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _pre_tokenizer(pre: str | None):
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre == "smollm":
        # SmolLM's own tokenizer.json: every digit on its own, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf_tokenizer(reader) -> GGUFTokenizerSpec:
    """Build the tokenizer described by an open `gguf.GGUFReader`."""
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model_type!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:  # stored as raw text: respell in the byte alphabet
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens written outside the byte alphabet are llama.cpp mislabels; adding them would
    # grow the vocabulary past the embedding table, so they are left alone.
    special = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_types)
               if kind == TOKEN_TYPE_CONTROL and set(t) <= spelled]
    if special:
        tokenizer.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, token_types)
            if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return GGUFTokenizerSpec(
        tokenizer=tokenizer,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        tokens=tokens,
    )
