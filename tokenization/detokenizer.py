"""Streaming detokenization: text deltas per generated token.

Byte-level BPE tokens can end in the middle of a UTF-8 character, so a token's text is only known
once the character completes. As vLLM does, we decode a short window of recent tokens twice
(up to the last emitted token, and up to now) and emit the difference once it no longer ends in
U+FFFD; the window keeps each step O(window), not O(sequence).
"""
from __future__ import annotations

from tokenization.bundle import TokenizerBundle


class IncrementalDetokenizer:
    def __init__(self, bundle: TokenizerBundle, skip_special_tokens: bool = True):
        self.bundle = bundle
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: tokens before it are already settled text
        self._read_offset = 0    # tokens before it have been emitted

    def add(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        decode = self.bundle.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        new_text = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # incomplete character (or a skipped special token): wait for more tokens
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
