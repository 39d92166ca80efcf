"""`kvgate keys add | revoke | list | admin-token`: the keys in a routing YAML.

A new key or admin token is printed once, on stdout (so `kvgate keys add app > app.key` works);
the file gets only its SHA-256. A gateway watching the file applies the change within a second."""
from __future__ import annotations

import sys
from pathlib import Path

from gateway.auth import ADMIN_PREFIX, new_secret, secret_hash
from gateway.config import ConfigError
from gateway.keys_file import KeysFileError, add_key, remove_key, set_admin_hash, write_checked

EXIT_REFUSED = 1
EXIT_MISSING_FILE = 2


def main(args) -> int:
    path = Path(args.config)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        print(f"error: {path}: no such file", file=sys.stderr)
        return EXIT_MISSING_FILE
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: {path}: cannot read it: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        if args.keys_command == "list":
            return _list(path, text)
        if args.keys_command == "add":
            secret = new_secret()
            write_checked(path, add_key(text, _entry(args, secret_hash(secret))))
            print(secret)
            print(f"kvgate: added key {args.name!r} to {path}; only its SHA-256 is stored, so this is the only "
                  "time the key is shown", file=sys.stderr)
            return 0
        if args.keys_command == "revoke":
            write_checked(path, remove_key(text, args.name))
            print(f"kvgate: revoked key {args.name!r} in {path}", file=sys.stderr)
            return 0
        if args.keys_command == "admin-token":
            secret = new_secret(ADMIN_PREFIX)
            write_checked(path, set_admin_hash(text, secret_hash(secret)))
            print(secret)
            print(f"kvgate: admin token set in {path} (any earlier one no longer works); use it as "
                  "Authorization: Bearer TOKEN on /admin/*", file=sys.stderr)
            return 0
    except (KeysFileError, ConfigError) as exc:
        print(f"error: {path}: {exc}" if isinstance(exc, KeysFileError) else f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_REFUSED


def _entry(args, digest: str) -> dict:
    entry: dict = {"name": args.name, "sha256": digest}
    if args.tenant:
        entry["tenant"] = args.tenant
    if args.models:
        entry["models"] = args.models
    for field in ("rpm", "tpm", "max_prompt_tokens", "max_tokens"):
        if getattr(args, field) is not None:
            entry[field] = getattr(args, field)
    if args.allow_cache_salt:
        entry["allow_cache_salt"] = True
    if args.allow_kv_transfer_params:
        entry["allow_kv_transfer_params"] = True
    return entry


def _list(path: Path, text: str) -> int:
    from gateway.config import parse_config
    config = parse_config(text, str(path))
    if config.auth == "none":
        print(f"{path}: auth: none (every client is served without a key)")
        return 0
    section = config.auth_section
    admin = "set" if section.admin_token_sha256 else "not set"
    print(f"{path}: {len(section.keys)} key{'s' if len(section.keys) != 1 else ''}, admin token {admin}, "
          f"/metrics {section.metrics}")
    for key in section.keys:
        limits = [f"{name}={getattr(key, name)}" for name in ("rpm", "tpm", "max_prompt_tokens", "max_tokens")
                  if getattr(key, name) is not None]
        flags = [name for name in ("allow_cache_salt", "allow_kv_transfer_params") if getattr(key, name)]
        models = ",".join(key.models) if key.models is not None else "*"
        print(f"  {key.name:20s} tenant={key.tenant_name} models={models} {' '.join(limits + flags)}".rstrip())
    return 0
