"""Chat template rendering the way transformers does it (sandboxed jinja2, same flags and helpers).

A template that refuses a conversation (`raise_exception("Conversation roles must alternate ...")`)
or trips the sandbox is the request's fault: it comes out as a ValueError, which every server maps
to a 400 naming `messages`. jinja's TemplateError is not a ValueError, so it is translated here,
in the one place that renders."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; templates expect plain JSON, as transformers renders it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def flatten_content(messages: list[dict]) -> list[dict]:
    """OpenAI content parts [{"type": "text", "text": ...}] joined into one string per message."""
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            message = {**message, "content": "".join(texts)}
        flat.append(message)
    return flat


def render_chat(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    **kwargs,
) -> str:
    try:
        template = compile_template(source)
        return template.render(
            messages=flatten_content(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **kwargs,
        )
    except jinja2.TemplateError as exc:  # raise_exception, sandbox refusals, undefined names
        raise ValueError(f"The chat template refused these messages: {exc}") from None
