"""`bastion admin set-password|clients|tokens|revoke`: the administrator's commands.

set-password reads the new password from a prompt (twice), or from stdin when stdin is not a terminal,
stores its argon2id hash under the state folder, and revokes every grant, token and admin session.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from datetime import UTC, datetime
from typing import Any

from bastion.config import CONFIG_ENV, Config, load_config, resolve_config_path
from bastion.http.password import check_new_password, generate_password, write_hash
from bastion.http.store import AuthStore
from bastion.safety.errors import ConfigError


def add_admin_parser(sub: Any) -> None:
    admin = sub.add_parser("admin", help="the administrator's credential, OAuth clients and tokens")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    setpw = admin_sub.add_parser("set-password", help="set the admin password (revokes every token)")
    setpw.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
    setpw.add_argument("--generate", action="store_true", help="generate a random password and print it once")
    setpw.add_argument("--if-unset", action="store_true", help="do nothing if a password is already set")
    for name, text in (("clients", "list registered OAuth clients"), ("tokens", "list active grants (tokens)")):
        cmd = admin_sub.add_parser(name, help=text)
        cmd.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
        cmd.add_argument("--json", action="store_true", help="print JSON")
    revoke = admin_sub.add_parser("revoke", help="revoke a grant (by grant id), every grant of a client, or 'all'")
    revoke.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
    revoke.add_argument("id", help="a grant id, a client id, or 'all'")


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_password(generate: bool) -> str:
    if generate:
        return generate_password()
    if sys.stdin.isatty():
        first = getpass.getpass("new admin password: ")
        if getpass.getpass("again: ") != first:
            raise ConfigError("the two passwords differ: try again")
        return first
    return sys.stdin.readline().rstrip("\r\n")


def _store(config: Config) -> AuthStore:
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return AuthStore(config.db_path)


def set_password(config: Config, *, generate: bool, if_unset: bool) -> int:
    if if_unset and config.admin_hash_path.exists():
        print(f"bastion: an admin password is already set ({config.admin_hash_path})", file=sys.stderr)
        return 0
    password = _read_password(generate)
    check_new_password(password)
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_hash(config.admin_hash_path, password)
    store = _store(config)
    try:
        revoked = store.revoke_everything("admin password changed")
    finally:
        store.close()
    if generate:
        print("bastion: generated admin password (shown once; only its hash is stored):", file=sys.stderr, flush=True)
        print(password, flush=True)
    print(f"bastion: admin password set ({config.admin_hash_path}); {revoked} grant(s) revoked", file=sys.stderr)
    return 0


def run_admin(args: argparse.Namespace) -> int:
    config = load_config(resolve_config_path(args.config))
    if args.admin_command == "set-password":
        return set_password(config, generate=args.generate, if_unset=args.if_unset)
    store = _store(config)
    try:
        if args.admin_command == "clients":
            clients = store.clients()
            if args.json:
                print(json.dumps(clients, indent=1))
            for c in [] if args.json else clients:
                uris = ", ".join(c["redirect_uris"] or []) if isinstance(c["redirect_uris"], list) else ""
                print(f"{c['client_id']}  {c['client_name']!r}  registered {_when(c['created_at'])}  from {c['ip']}")  # type: ignore[arg-type]
                print(f"    redirect: {uris}; last used {_when(c['last_used_at'])}")  # type: ignore[arg-type]
            if not clients and not args.json:
                print("no registered clients")
            return 0
        if args.admin_command == "tokens":
            grants = store.grants()
            if args.json:
                print(json.dumps([g.__dict__ for g in grants], indent=1))
                return 0
            for g in grants:
                print(f"{g.grant_id}  client {g.client_id}  scopes {' '.join(g.scopes)}  since {_when(g.created_at)}")
            if not grants:
                print("no active grants")
            return 0
        target = args.id
        if target == "all":
            count = store.revoke_everything("revoked by the administrator (CLI)")
        elif store.revoke_grant(target, "revoked by the administrator (CLI)"):
            count = 1
        else:
            count = store.revoke_client(target, "revoked by the administrator (CLI)")
            if count == 0 and store.client(target) is None:
                raise ConfigError(f"no active grant or client {target!r}: see 'bastion admin tokens'")
        print(f"revoked {count} grant(s)")
        return 0
    finally:
        store.close()
