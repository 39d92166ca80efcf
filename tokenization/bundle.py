"""TokenizerBundle: one model's tokenizer, chat template and special tokens, loadable from an HF
checkpoint dir or a GGUF file and shippable as a JSON payload (replicas serve it to the gateway)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from tokenization.chat_template import render_chat

# End-of-turn markers used by common chat formats; generation stops on them as well as on eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")


def _token_text(value) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class TokenizerBundle:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        add_bos: bool = False,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        if bos_token_id is None and bos_token is not None:
            bos_token_id = tokenizer.token_to_id(bos_token)
        self.bos_token_id = bos_token_id
        self.stop_token_ids = list(stop_token_ids or [])
        self.add_bos = bool(add_bos and bos_token_id is not None)

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # BOS is added here, not by the tokenizer's post-processor, so one flag says whether it is.
        # The batch call releases the GIL for the Rust work (encode() holds it): a long prompt
        # tokenized on a worker thread then does not stall the event loop or the engine's thread
        # (same IDs, ~1 us more a call).
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions with a raw prompt")
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- wire format ---------------------------------------------------------------------------
    def to_payload(self) -> bytes:
        return json.dumps({
            "tokenizer_json": self.tokenizer.to_str(),
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "bos_token_id": self.bos_token_id,
            "stop_token_ids": self.stop_token_ids,
            "add_bos": self.add_bos,
        }).encode()

    @classmethod
    def from_payload(cls, data: bytes) -> "TokenizerBundle":
        d = json.loads(data)
        return cls(
            tokenizer=Tokenizer.from_str(d["tokenizer_json"]),
            chat_template=d.get("chat_template"),
            bos_token=d.get("bos_token"),
            eos_token=d.get("eos_token"),
            bos_token_id=d.get("bos_token_id"),
            stop_token_ids=d.get("stop_token_ids") or [],
            add_bos=d.get("add_bos", False),
        )

    # -- loaders -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path) -> "TokenizerBundle":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"  # where transformers>=4.43 saves it
        if chat_template is None and jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")

        bos_token = _token_text(config.get("bos_token"))
        eos_token = _token_text(config.get("eos_token"))
        bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        if bos_token_id is None and generation.get("bos_token_id") is not None:
            bos_token_id = int(generation["bos_token_id"])
            bos_token = tokenizer.id_to_token(bos_token_id)
        eos_ids = _as_id_list(generation.get("eos_token_id"))
        if eos_token and tokenizer.token_to_id(eos_token) is not None:
            eos_ids.insert(0, tokenizer.token_to_id(eos_token))

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: follow the tokenizer.json post-processor, which is what transformers does.
            probe = tokenizer.encode("a", add_special_tokens=True).ids
            add_bos = bos_token_id is not None and bool(probe) and probe[0] == bos_token_id
        return cls(
            tokenizer=tokenizer, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
            bos_token_id=bos_token_id, stop_token_ids=_stop_ids(tokenizer, eos_ids), add_bos=bool(add_bos),
        )

    @classmethod
    def from_gguf(cls, path) -> "TokenizerBundle":
        from gguf import GGUFReader  # numpy-only; imported lazily to keep gateway start-up light

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such GGUF file")
        return cls.from_gguf_reader(GGUFReader(str(path)))

    @classmethod
    def from_gguf_reader(cls, reader) -> "TokenizerBundle":
        from tokenization.gguf_vocab import read_gguf_tokenizer

        spec = read_gguf_tokenizer(reader)
        bos = spec.tokens[spec.bos_token_id] if spec.bos_token_id is not None else None
        eos = spec.tokens[spec.eos_token_id] if spec.eos_token_id is not None else None
        eos_ids = [spec.eos_token_id] if spec.eos_token_id is not None else []
        return cls(
            tokenizer=spec.tokenizer, chat_template=spec.chat_template, bos_token=bos, eos_token=eos,
            bos_token_id=spec.bos_token_id, stop_token_ids=_stop_ids(spec.tokenizer, eos_ids), add_bos=spec.add_bos,
        )


def _stop_ids(tokenizer: Tokenizer, eos_ids: list[int]) -> list[int]:
    ids = list(dict.fromkeys(eos_ids))
    for text in _END_OF_TURN_TOKENS:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
