"""`kvgate keys`: API keys and the admin token written into the routing YAML as text edits, so the
file keeps its comments, order and layout (a YAML dumper would drop every comment).

PyYAML's node tree gives each node's position; an edit inserts or removes whole lines (or, in a
flow collection such as `keys: []`, the item's text). Each edited text is validated like any
config before it is written (atomically: a temporary file renamed over it, which the running
gateway's watcher picks up as one change)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from gateway.config import parse_config


class KeysFileError(Exception):
    """An edit that cannot be made; the message is ready for a user."""


def _compose(text: str) -> yaml.MappingNode | None:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"invalid YAML: {exc}") from None
    if root is not None and not isinstance(root, yaml.MappingNode):
        raise KeysFileError("the file is not a YAML mapping")
    return root


def _find(mapping: yaml.MappingNode, key: str):
    for key_node, value_node in mapping.value:
        if getattr(key_node, "value", None) == key:
            return key_node, value_node
    return None


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")


def _last_index(node: yaml.Node) -> int:
    """Where a node's text really ends (a block collection's end mark lies at the next token)."""
    if isinstance(node, yaml.MappingNode) and not node.flow_style:
        return max(_last_index(child) for pair in node.value for child in pair)
    if isinstance(node, yaml.SequenceNode) and not node.flow_style and node.value:
        return max(_last_index(child) for child in node.value)
    return node.end_mark.index


def _line_end(text: str, index: int) -> int:
    """Index just past the newline that ends the line holding `index`."""
    newline = text.find("\n", index)
    return len(text) if newline == -1 else newline + 1


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _after_colon(text: str, key_node: yaml.Node) -> int:
    return text.index(":", key_node.end_mark.index) + 1


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def flow(entry: dict) -> str:
    """A one-line YAML flow mapping; strings JSON-quoted (a name like `123` stays a string)."""
    return "{" + ", ".join(f"{name}: {json.dumps(value)}" for name, value in entry.items()) + "}"


def add_key(text: str, entry: dict) -> str:
    item = flow(entry)
    root = _compose(text)
    found = _find(root, "auth") if root is not None else None
    if found is None:
        return _with_newline(text) + f"\nauth:\n  keys:\n    - {item}\n"
    auth_key, auth = found
    if isinstance(auth, yaml.ScalarNode) and not _is_null(auth):
        raise KeysFileError(f"line {auth_key.start_mark.line + 1}: `auth: {auth.value}` serves without keys; "
                            "replace it with an `auth:` section (or delete it) to use keys")
    keys = None if _is_null(auth) else _find(auth, "keys")
    if keys is None:
        return _insert_in_auth(text, auth_key, auth, f"keys: [{item}]",
                               lambda indent: f"{indent}keys:\n{indent}  - {item}\n")
    keys_key, seq = keys
    if auth.flow_style and (_is_null(seq) or isinstance(seq, yaml.SequenceNode) and not seq.value):
        # inside `auth: {...}` a block list cannot start: the list stays flow
        if _is_null(seq) and seq.start_mark.index == seq.end_mark.index:  # `keys:` alone
            colon = _after_colon(text, keys_key)
            return text[:colon] + f" [{item}]" + text[colon:]
        return text[:seq.start_mark.index] + f"[{item}]" + text[seq.end_mark.index:]
    if _is_null(seq) or (isinstance(seq, yaml.SequenceNode) and seq.flow_style and not seq.value):
        # `keys:` or `keys: []`: becomes a block list under it
        indent = " " * (keys_key.start_mark.column + 2)
        colon = _after_colon(text, keys_key)
        end = colon if _is_null(seq) else seq.end_mark.index
        rest = text[end:]
        line_rest = rest[:rest.find("\n")] if "\n" in rest else rest
        comment = line_rest.strip()
        tail = rest[len(line_rest):] if "\n" in rest else ""
        return (text[:colon] + (f"  {comment}" if comment else "") + f"\n{indent}- {item}" +
                (tail if tail else "\n"))
    if not isinstance(seq, yaml.SequenceNode):
        raise KeysFileError(f"line {keys_key.start_mark.line + 1}: auth.keys must be a list")
    if seq.flow_style:
        close = seq.end_mark.index - 1
        return text[:close] + f", {item}" + text[close:]
    at = _line_end(text, _last_index(seq.value[-1]))
    indent = " " * seq.start_mark.column
    return _with_newline(text[:at]) + f"{indent}- {item}\n" + text[at:]


def remove_key(text: str, name: str) -> str:
    root = _compose(text)
    found = _find(root, "auth") if root is not None else None
    keys = _find(found[1], "keys") if found is not None and isinstance(found[1], yaml.MappingNode) else None
    seq = keys[1] if keys is not None else None
    if not isinstance(seq, yaml.SequenceNode):
        raise KeysFileError(f"no key named {name!r}")
    for index, item in enumerate(seq.value):
        if isinstance(item, yaml.MappingNode) and (n := _find(item, "name")) is not None and n[1].value == name:
            break
    else:
        raise KeysFileError(f"no key named {name!r}")
    if seq.flow_style:  # inside a flow list every item is flow too: its marks are exact
        start, end = item.start_mark.index, item.end_mark.index
        if index + 1 < len(seq.value):
            end = seq.value[index + 1].start_mark.index  # the item and the ", " after it
        elif index > 0:
            start = seq.value[index - 1].end_mark.index  # the ", " before it and the item
        return text[:start] + text[end:]
    start = _line_start(text, item.start_mark.index)
    end = _line_end(text, _last_index(item))
    text = text[:start] + text[end:]
    if len(seq.value) == 1:  # the last one: an empty list, not a `keys:` that means null
        colon = _after_colon(text, keys[0])
        text = text[:colon] + " []" + text[colon:]
    return text


def set_admin_hash(text: str, digest: str) -> str:
    root = _compose(text)
    found = _find(root, "auth") if root is not None else None
    value = json.dumps(digest)
    if found is None:
        return _with_newline(text) + f"\nauth:\n  admin_token_sha256: {value}\n"
    auth_key, auth = found
    entry = f"admin_token_sha256: {value}"
    if _is_null(auth):
        return _insert_in_auth(text, auth_key, auth, entry, lambda indent: f"{indent}{entry}\n")
    if not isinstance(auth, yaml.MappingNode):
        raise KeysFileError(f"line {auth_key.start_mark.line + 1}: `auth: {auth.value}` has no place for an admin "
                            "token; set KVGATE_ADMIN_TOKEN in kvgate's environment instead")
    existing = _find(auth, "admin_token_sha256")
    if existing is not None:
        node = existing[1]
        if _is_null(node) and node.start_mark.index == node.end_mark.index:  # `admin_token_sha256:` alone
            colon = _after_colon(text, existing[0])
            return text[:colon] + f" {value}" + text[colon:]
        return text[:node.start_mark.index] + value + text[node.end_mark.index:]
    return _insert_in_auth(text, auth_key, auth, entry, lambda indent: f"{indent}{entry}\n")


def _insert_in_auth(text: str, auth_key, auth, flow_entry: str, block_entry) -> str:
    """`text` with a new entry in its auth section: `auth:` with nothing under it, a flow mapping
    (`flow_entry` goes in before its brace) or a block one (`block_entry(indent)`: its lines)."""
    if not _is_null(auth) and auth.flow_style:  # auth: {...}
        close = auth.end_mark.index - 1
        sep = "" if not auth.value else ", "
        return text[:close] + f"{sep}{flow_entry}" + text[close:]
    at = _line_end(text, auth_key.start_mark.index)
    column = auth_key.start_mark.column + 2 if _is_null(auth) else auth.value[0][0].start_mark.column
    return _with_newline(text[:at]) + block_entry(" " * column) + text[at:]


def write_checked(path: Path, text: str) -> None:
    """Validate `text` as a routing config, then replace the file with it atomically."""
    parse_config(text, str(path))  # ConfigError: the caller says why and writes nothing
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
