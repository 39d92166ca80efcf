"""Default sampling for requests that leave a field out, derived as vLLM derives it.

vLLM 0.33 (`--generation-config auto`, its default) reads the model's generation_config.json and
applies the sampling fields the model's authors recommend (repetition_penalty, presence_penalty,
frequency_penalty, temperature, top_k, top_p, min_p, max_new_tokens, skip_special_tokens: the fields
that differ from transformers' GenerationConfig defaults) to every request that does not set them; `--generation-config vllm` uses
vLLM's own neutral defaults; a directory reads that directory's generation_config.json; and
`--override-generation-config '{...}'` sets fields on top. `do_sample` is ignored, as vLLM does.
A model without the file (the embedded SmolLM2 GGUF) carries its model card's recommendation
from the loader instead.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# generation_config.json key -> request field, in the order vLLM reads them.
_READ = {"repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens",
         "skip_special_tokens": "skip_special_tokens"}
# The request fields a default may set that the engine honours; the rest are reported at start.
_HONOURED = ("temperature", "top_p", "top_k", "max_tokens", "skip_special_tokens")
# transformers' GenerationConfig defaults: `to_diff_dict` (what vLLM reads) leaves these out.
_NEUTRAL = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


class GenerationConfigError(ValueError):
    """A generation config that cannot be read or names an impossible value."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for a sampling field it leaves out."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None   # None: up to the context (chat), 16 (completions), as vLLM
    skip_special_tokens: bool = True
    source: str = "vllm"            # where the non-neutral values came from, for the start-up log

    def as_dict(self) -> dict:
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        return out


def read_generation_config(directory: Path) -> dict:
    """The recommended sampling fields of `directory`/generation_config.json ({} without the file)."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    return {_READ[key]: raw[key] for key in _READ if raw.get(key) is not None
            and not (key in _NEUTRAL and raw[key] == _NEUTRAL[key])}


def resolve_sampling_defaults(mode: str, model_recommended: dict, override: dict | None = None,
                              model_source: str = "the model") -> tuple[SamplingDefaults, dict]:
    """(defaults, ignored): `mode` is "auto" (the model's recommendation), "vllm" (none) or a
    directory holding a generation_config.json; `override` (request field names, or the file's
    own `max_new_tokens`) goes on top. `ignored` holds recommended fields the engine cannot honour,
    so the replica can say so at start instead of dropping them silently."""
    if mode == "auto":
        fields, source = dict(model_recommended), model_source
    elif mode == "vllm":
        fields, source = {}, "vllm"
    else:
        directory = Path(mode).expanduser()
        if not directory.is_dir():
            raise GenerationConfigError(f"--generation-config {mode!r}: expected auto, vllm or a directory")
        fields, source = read_generation_config(directory), str(directory / "generation_config.json")
    if override:  # a null value removes a field the model recommends
        for key, value in override.items():
            if value is None:
                fields.pop(_READ.get(key, key), None)
            else:
                fields[_READ.get(key, key)] = value
        source = f"{source} + override"
    unknown = sorted(set(fields) - set(_READ.values()))
    if unknown:
        raise GenerationConfigError(f"unknown generation config field(s) {unknown} "
                                    f"(known: {', '.join(sorted(_READ))})")
    ignored = {key: value for key, value in fields.items() if key not in _HONOURED}
    honoured = {key: fields[key] for key in _HONOURED if key in fields}
    try:
        defaults = SamplingDefaults(
            temperature=float(honoured.get("temperature", 1.0)), top_p=float(honoured.get("top_p", 1.0)),
            top_k=int(honoured.get("top_k", -1)) or -1,
            max_tokens=int(honoured["max_tokens"]) if "max_tokens" in honoured else None,
            skip_special_tokens=bool(honoured.get("skip_special_tokens", True)),
            source=source if honoured else "vllm")
    except (TypeError, ValueError) as exc:
        raise GenerationConfigError(f"generation config {honoured}: {exc}") from None
    if not (0.0 <= defaults.temperature <= 2.0 and math.isfinite(defaults.temperature)):
        raise GenerationConfigError(f"generation config temperature {defaults.temperature} is not in [0, 2]")
    if not 0.0 < defaults.top_p <= 1.0:
        raise GenerationConfigError(f"generation config top_p {defaults.top_p} is not in (0, 1]")
    if defaults.top_k < -1:
        raise GenerationConfigError(f"generation config top_k {defaults.top_k} must be -1 or positive")
    if defaults.max_tokens is not None and defaults.max_tokens < 1:
        raise GenerationConfigError(f"generation config max_new_tokens {defaults.max_tokens} must be >= 1")
    return defaults, ignored
