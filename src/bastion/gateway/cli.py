"""`bastion gateway dispatch-script|keygen|authorized-keys` and `bastion approvals list|approve|deny`.

A CLI decision is made as ``cli:<login user>`` (the real uid's name; `--by` is only a note after it).
It is not written to the audit chain: the running server holds the chain's head in memory, and no
CLI command appends to it (the decision reaches the chain in ``approval_used`` when it is used).
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
import time
from pathlib import Path
from typing import Final

from bastion.config import Config, GatewayConfig, add_config_option, load_config, resolve_config_path
from bastion.logs import escape
from bastion.safety.approvals import Approval, ApprovalQueue
from bastion.safety.errors import NotFound

MAX_NOTE_CHARS: Final = 100


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `gateway` and `approvals` commands to the top-level parser."""
    gateway = sub.add_parser("gateway", help="production gateway: install helpers")
    gateway_sub = gateway.add_subparsers(dest="gateway_command", required=True)
    script = gateway_sub.add_parser("dispatch-script", help="print dispatch.py (the target's forced command)")
    script.add_argument("--output", help="write it to this path (mode 0755) instead of printing it")
    for name, text in (
        ("keygen", "make the gateway's dedicated ed25519 key at its key_path"),
        ("authorized-keys", "print the exact authorized_keys line for the target"),
    ):
        command = gateway_sub.add_parser(name, help=text)
        add_config_option(command)
        command.add_argument("name", help="the [[gateway]] name")

    approvals = sub.add_parser("approvals", help="the approval queue")
    approvals_sub = approvals.add_subparsers(dest="approvals_command", required=True)
    listing = approvals_sub.add_parser("list", help="list pending requests (--all: recent ones in any state)")
    listing.add_argument("--all", action="store_true")
    for name in ("approve", "deny"):
        decide = approvals_sub.add_parser(name, help=f"{name} a pending request")
        decide.add_argument("id")
        decide.add_argument(
            "--by", help="a note kept after the decider's name (the decider is always cli:<your login user>)"
        )
        if name == "deny":
            decide.add_argument("--reason", default="", help="told to the agent")
    for command in (listing, *approvals_sub.choices.values()):
        if not any(action.dest == "config" for action in command._actions):
            add_config_option(command)


def _gateway(config: Config, name: str) -> GatewayConfig:
    gateway = config.gateway_by_name(name)
    if gateway is None:
        names = ", ".join(g.name for g in config.gateway) or "none"
        raise NotFound(f"no [[gateway]] named {name!r} in the config (configured: {names})")
    return gateway


def run_gateway(args: argparse.Namespace) -> int:
    from bastion.gateway.keys import authorized_keys_line, dispatch_source, generate_key

    if args.gateway_command == "dispatch-script":
        if args.output:
            path = Path(args.output)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o755)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(dispatch_source())
            print(f"wrote {path}")
        else:
            sys.stdout.write(dispatch_source())
        return 0
    gateway = _gateway(load_config(resolve_config_path(args.config)), args.name)
    if args.gateway_command == "keygen":
        public = generate_key(gateway)
        print(f"wrote {gateway.key_path} and {gateway.key_path}.pub")
        print(public)
        print(f"next: bastion gateway authorized-keys --config PATH {gateway.name}")
        return 0
    print(authorized_keys_line(gateway))
    return 0


def _show(approval: Approval) -> str:
    """One line per approval; who asked or decided and why are escaped (`logs.escape`): a client_id (an
    https URL for a metadata-document client) may hold C1 controls or bidi overrides that would act on the
    administrator's terminal, or reorder the line they decide from."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(approval.requested_at))
    left = max(0, int(approval.expires_at - time.time()))
    tail = f"expires in {left}s" if approval.state == "pending" else f"by {escape(approval.decided_by or '-')}"
    reason = f" ({escape(approval.reason)})" if approval.reason else ""
    return (
        f"{approval.id}  {approval.state:<8}  {escape(approval.action)}  {approval.literal!r}  "
        f"asked by {escape(approval.requested_by)} at {when}Z  {tail}{reason}"
    )


def decider(note: str | None) -> str:
    """``cli:<login user>``, from the process's real uid (not $USER, which anyone sets); `--by` follows as a note.

    The note is free text: it is cut and kept to printable characters, and never stands as the name.
    """
    name = f"cli:{pwd.getpwuid(os.getuid()).pw_name}"
    text = "".join(ch for ch in (note or "") if ch.isprintable()).strip()[:MAX_NOTE_CHARS]
    return f"{name} (note: {text})" if text else name


def run_approvals(args: argparse.Namespace) -> int:
    config = load_config(resolve_config_path(args.config))
    queue = ApprovalQueue(config.db_path)
    if args.approvals_command == "list":
        items = queue.recent() if args.all else queue.pending()
        for approval in items:
            print(_show(approval))
        if not items:
            print("no pending approvals" if not args.all else "no approvals")
        return 0
    by = decider(args.by)
    if args.approvals_command == "approve":
        print(_show(queue.approve(args.id, by)))
    else:
        print(_show(queue.deny(args.id, by, args.reason)))
    return 0
