"""The `bastion` command: init, serve, doctor, policy explain, audit verify.

Every refusal is one line on stderr and a non-zero exit; no traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Final

from bastion.config import CONFIG_ENV, load_config, resolve_config_path
from bastion.safety.errors import BastionError, ConfigError

EXIT_USAGE: Final = 2
EXIT_CONFIG: Final = 78  # EX_CONFIG from sysexits.h


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bastion", description="A kernel-isolated workbench for AI agents, over MCP.")
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="write a demo config and its folders into DIR")
    init.add_argument("dir")
    init.add_argument(
        "--python-env",
        help="a venv on /usr/bin/python3 for the python-data sandbox template, which becomes the default "
        "(default: the checkout's .venv-python-data, built by 'make install', when it exists)",
    )

    serve = sub.add_parser("serve", help="serve MCP")
    serve.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
    transport = serve.add_mutually_exclusive_group(required=True)
    transport.add_argument("--stdio", action="store_true", help="serve over stdin/stdout")
    transport.add_argument("--http", action="store_true", help="serve Streamable HTTP at /mcp, with OAuth")
    serve.add_argument("--listen", help="HOST:PORT to bind with --http (default: the config's [http] listen)")

    doctor = sub.add_parser("doctor", help="check what this machine and config will enforce, before an agent connects")
    doctor.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
    doctor.add_argument("--json", action="store_true", help="print a JSON list of {check, status, detail}")

    from bastion.transports.http.admin_cli import add_admin_parser

    add_admin_parser(sub)

    policy = sub.add_parser("policy", help="inspect command policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    explain = policy_sub.add_parser("explain", help="print the decision for a command and the rule that made it")
    explain.add_argument("--config", help=f"path to bastion.toml (or set {CONFIG_ENV})")
    explain.add_argument("--workspace", help="workspace id (default: the config's default_workspace)")
    explain.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...] (or one quoted command line)")

    audit = sub.add_parser("audit", help="audit log tools")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    verify = audit_sub.add_parser("verify", help="check the hash chain of an audit log")
    verify.add_argument("path")

    from bastion.gateway.cli import add_parsers as add_gateway_parsers

    add_gateway_parsers(sub)
    return parser


def _cmd_init(args: argparse.Namespace) -> int:
    from bastion.demo import find_data_env, init_demo

    python_env = args.python_env if args.python_env is not None else find_data_env()
    path = init_demo(args.dir, python_env=python_env)
    print(f"wrote {path}")
    if python_env is not None:
        print(f"default sandbox template: python-data (numpy, pandas, matplotlib from {python_env})")
    else:
        print("default sandbox template: the system's Python ('make install' builds python-data; see --python-env)")
    print(f"serve it with: bastion serve --config {path} --http  (or --stdio for a local client)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from bastion.serve import serve_stdio

    config_path = resolve_config_path(args.config)
    config = load_config(config_path)
    if args.http:
        from bastion.serve import serve_http

        return serve_http(config, config_path, args.listen)
    return serve_stdio(config, config_path)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from bastion.doctor import run_doctor

    return run_doctor(args.config, as_json=args.json)


def _cmd_admin(args: argparse.Namespace) -> int:
    from bastion.transports.http.admin_cli import run_admin

    return run_admin(args)


def _cmd_policy_explain(args: argparse.Namespace) -> int:
    from bastion.safety.commands import CommandPolicy

    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("bastion: give the command after --, e.g. 'bastion policy explain -- git status'", file=sys.stderr)
        return EXIT_USAGE
    config = load_config(resolve_config_path(args.config))
    workspace = config.workspace_by_id(args.workspace or config.default_workspace)
    if workspace is None:
        raise ConfigError(f"no workspace {args.workspace!r} in the config: use one of its [[workspace]] ids")
    # One word is a command line as an agent would send it ("ls; id"); several are argv.
    text = argv[0] if len(argv) == 1 else shlex.join(argv)
    decision = CommandPolicy(workspace.policy).explain(text)
    verdict = "ALLOW" if decision.allowed else "DENY"
    print(f"{verdict} {shlex.join(decision.argv) if decision.argv else text}")
    print(f"rule: {decision.rule}")
    if decision.reason:
        print(f"reason: {decision.reason}")
    return 0 if decision.allowed else 1


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    from bastion.safety.audit import verify

    report = verify(args.path)
    if report.ok:
        print(f"ok: {report.records} records, chain intact")
        return 0
    where = f"{report.file}:{report.line}" if report.file else args.path
    print(f"BROKEN at {where}: {report.first_error}")
    return 1


def _cmd_gateway(args: argparse.Namespace) -> int:
    from bastion.gateway.cli import run_gateway

    return run_gateway(args)


def _cmd_approvals(args: argparse.Namespace) -> int:
    from bastion.gateway.cli import run_approvals

    return run_approvals(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {
        "init": _cmd_init,
        "serve": _cmd_serve,
        "doctor": _cmd_doctor,
        "admin": _cmd_admin,
        "policy": _cmd_policy_explain,
        "audit": _cmd_audit_verify,
        "gateway": _cmd_gateway,
        "approvals": _cmd_approvals,
    }
    try:
        return handlers[args.command](args)
    except (ConfigError, BastionError) as exc:
        print(f"bastion: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
