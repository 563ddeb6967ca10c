"""`bastion admin set-password|clients|tokens|token|revoke`: the administrator's commands.

set-password reads the new password from a prompt (twice), or from stdin when stdin is not a terminal,
stores its argon2id hash under the state folder, and revokes every grant, token and admin session.
`clients prune` forgets registered clients that never got a grant (what a registration flood leaves).
`token` issues an access token for a script or the MCP Inspector without an OAuth client: it is printed
once (only its SHA-256 digest is stored), belongs to a grant of its own, and is listed by `tokens` and
revoked by `revoke` like any other.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any, Final

from bastion.config import Config, add_config_option, load_config, resolve_config_path, split_listen
from bastion.safety.errors import InvalidRequest, NotFound
from bastion.transports.http.password import (
    begin_change,
    check_new_password,
    end_change,
    finish_cut_short_change,
    generate_password,
    write_hash,
)
from bastion.transports.http.store import AuthStore


def add_admin_parser(sub: Any) -> None:
    admin = sub.add_parser("admin", help="the administrator's credential, OAuth clients and tokens")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    setpw = admin_sub.add_parser("set-password", help="set the admin password (revokes every token)")
    add_config_option(setpw)
    setpw.add_argument("--generate", action="store_true", help="generate a random password and print it once")
    setpw.add_argument("--if-unset", action="store_true", help="do nothing if a password is already set")
    clients = admin_sub.add_parser("clients", help="list registered OAuth clients, or prune the unused ones")
    clients.add_argument("action", nargs="?", choices=("list", "prune"), default="list")
    add_config_option(clients)
    clients.add_argument("--json", action="store_true", help="print JSON")
    clients.add_argument(
        "--older-than",
        type=_duration,
        default=PRUNE_MIN_AGE_S,
        metavar="DURATION",
        help="prune: only clients registered longer ago than this (default 10m); one whose authorization "
        "started in the last 10 minutes is always kept",
    )
    tokens = admin_sub.add_parser("tokens", help="list active grants (tokens)")
    add_config_option(tokens)
    tokens.add_argument("--json", action="store_true", help="print JSON")
    token = admin_sub.add_parser("token", help="issue an access token for a script or the MCP Inspector")
    add_config_option(token)
    token.add_argument("--client", required=True, help="a name for what will use it (letters, digits, . _ -)")
    token.add_argument(
        "--scope", required=True, action="append", help="a scope to grant (repeat it, or give several in quotes)"
    )
    token.add_argument("--ttl", type=_duration, default=3600.0, help="lifetime, e.g. 3600, 30m, 12h, 7d (default 1h)")
    token.add_argument(
        "--listen", help="HOST:PORT the server was started with, if 'serve --listen' moved its URL (the token names it)"
    )
    revoke = admin_sub.add_parser("revoke", help="revoke a grant (by grant id), every grant of a client, or 'all'")
    add_config_option(revoke)
    revoke.add_argument("id", help="a grant id, a client id, or 'all'")


PRUNE_MIN_AGE_S: Final = 600.0  # an authorization request lives 10 minutes
CLI_CLIENT_PREFIX: Final = "cli:"
_CLIENT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DURATION: Final = re.compile(r"([0-9]{1,9})([smhd]?)")
_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def _duration(text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use seconds or 30m, 12h, 7d")
    return float(int(match[1]) * _UNITS[match[2]])


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_password(generate: bool) -> str:
    if generate:
        return generate_password()
    if sys.stdin.isatty():
        first = getpass.getpass("new admin password: ")
        if getpass.getpass("again: ") != first:
            raise InvalidRequest("the two passwords differ: try again")
        return first
    return sys.stdin.readline().rstrip("\r\n")


def _store(config: Config) -> AuthStore:
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = AuthStore(config.db_path)
    try:
        finish_cut_short_change(config.admin_hash_path, store)
    except BaseException:
        store.close()
        raise
    return store


def set_password(config: Config, *, generate: bool, if_unset: bool) -> int:
    if if_unset and config.admin_hash_path.exists():
        print(f"bastion: an admin password is already set ({config.admin_hash_path})", file=sys.stderr)
        return 0
    password = _read_password(generate)
    check_new_password(password)
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = _store(config)
    try:
        # The hash first, then the revocation: a login checked against the old hash meanwhile is refused by its
        # version. A change killed in between is finished by the next run or start (`finish_cut_short_change`).
        held = begin_change(config.admin_hash_path)
        try:
            write_hash(config.admin_hash_path, password)
        except BaseException:
            end_change(config.admin_hash_path, held)  # the password did not change: nothing to revoke
            raise
        revoked = store.revoke_everything("admin password changed")
        end_change(config.admin_hash_path, held)
    finally:
        store.close()
    if generate:
        print("bastion: generated admin password (shown once; only its hash is stored):", file=sys.stderr, flush=True)
        print(password, flush=True)
    print(f"bastion: admin password set ({config.admin_hash_path}); {revoked} grant(s) revoked", file=sys.stderr)
    return 0


def list_clients(store: AuthStore, *, as_json: bool) -> int:
    clients = store.clients()
    if as_json:
        print(json.dumps(clients, indent=1))
        return 0
    for c in clients:
        uris = ", ".join(c["redirect_uris"] or []) if isinstance(c["redirect_uris"], list) else ""
        name = ascii(c["client_name"]) if c["client_name"] is not None else "-"  # no control or bidi characters
        print(f"{c['client_id']}  {name}  registered {_when(c['created_at'])}  from {c['ip']}")  # type: ignore[arg-type]
        print(f"    redirect: {ascii(uris)[1:-1]}; scope {c['scope'] or '-'}; last used {_when(c['last_used_at'])}")  # type: ignore[arg-type]
    if not clients:
        print("no registered clients")
    return 0


def prune_clients(store: AuthStore, older_than_s: float, *, as_json: bool) -> int:
    """Forget clients that never got a grant, registered more than `older_than_s` ago (not one whose
    authorization is under way: `AuthStore.expire_unused_clients`)."""
    removed = store.expire_unused_clients(older_than_s)
    if as_json:
        print(json.dumps({"removed": removed}))
    else:
        print(f"removed {removed} unused client(s) registered more than {older_than_s:g} s ago")
    return 0


def list_grants(store: AuthStore, *, as_json: bool) -> int:
    now = time.time()
    grants = [g for g in store.grants() if g.expires_at > now]
    if as_json:
        print(json.dumps([g.__dict__ for g in grants], indent=1))
        return 0
    for g in grants:
        print(
            f"{g.grant_id}  client {g.client_id}  scopes {' '.join(g.scopes)}  "
            f"since {_when(g.created_at)}  until {_when(g.expires_at)}"
        )
    if not grants:
        print("no active grants")
    return 0


def _token_scopes(requested: list[str]) -> tuple[str, ...]:
    from bastion.tools.server import SCOPES

    asked = [scope for text in requested for scope in text.replace(",", " ").split()]
    unknown = sorted(set(asked) - set(SCOPES))
    if unknown or not asked:
        raise InvalidRequest(f"unknown scope {' '.join(unknown) or '(none)'}: use some of {' '.join(SCOPES)}")
    return tuple(scope for scope in SCOPES if scope in asked)


def _checked_listen(listen: str | None) -> str | None:
    if listen is None:
        return None
    if split_listen(listen) is None:
        raise InvalidRequest(f"--listen {listen!r} must be HOST:PORT, as given to 'bastion serve --listen'")
    return listen


def issue_token(
    config: Config, store: AuthStore, *, client: str, scopes: list[str], ttl_s: float, listen: str | None = None
) -> int:
    """`bastion admin token`: print a new access token (stdout, once) and what it is (stderr)."""
    from bastion.transports.http.app import endpoints_for

    if not _CLIENT_NAME.fullmatch(client):
        raise InvalidRequest(f"--client {client!r} must be 1 to 64 letters, digits, '.', '_' or '-'")
    granted = _token_scopes(scopes)
    limit = config.http.grant_lifetime_s
    if not 60 <= ttl_s <= limit:
        raise InvalidRequest(f"--ttl must be from 60 s to grant_lifetime_s ({limit:g} s)")
    # Tokens are bound to one MCP URL (RFC 8707): the one the server answers at, which `--listen` moves.
    resource = endpoints_for(config, _checked_listen(listen)).resource
    client_id = CLI_CLIENT_PREFIX + client
    token, grant_id = store.issue_admin_token(client_id=client_id, scopes=granted, resource=resource, lifetime_s=ttl_s)
    print(token, flush=True)
    print(
        f"bastion: access token for {client_id} on {resource}, scopes {' '.join(granted)}, "
        f"until {_when(time.time() + ttl_s)} (shown once; only its digest is stored). "
        f"Use it as 'Authorization: Bearer <token>'; revoke it with 'bastion admin revoke {grant_id}'.",
        file=sys.stderr,
    )
    return 0


def run_admin(args: argparse.Namespace) -> int:
    config = load_config(resolve_config_path(args.config))
    if args.admin_command == "set-password":
        return set_password(config, generate=args.generate, if_unset=args.if_unset)
    store = _store(config)
    try:
        if args.admin_command == "clients" and args.action == "prune":
            return prune_clients(store, args.older_than, as_json=args.json)
        if args.admin_command == "clients":
            return list_clients(store, as_json=args.json)
        if args.admin_command == "tokens":
            return list_grants(store, as_json=args.json)
        if args.admin_command == "token":
            return issue_token(config, store, client=args.client, scopes=args.scope, ttl_s=args.ttl, listen=args.listen)
        target = args.id
        if target == "all":
            count = store.revoke_everything("revoked by the administrator (CLI)")
        elif store.revoke_grant(target, "revoked by the administrator (CLI)"):
            count = 1
        else:
            count = store.revoke_client(target, "revoked by the administrator (CLI)")
            if count == 0 and store.client(target) is None:
                raise NotFound(f"no active grant or client {target!r}: see 'bastion admin tokens'")
        print(f"revoked {count} grant(s)")
        return 0
    finally:
        store.close()
