"""The `bastion` command: init, serve, doctor, admin, policy explain, audit verify, gateway, approvals, template,
install-service.

Every refusal is one line on stderr and a non-zero exit; no traceback. Exit codes:
0 done; 1 an operation failed or what was named does not exist (a port in use, an unknown
grant, approval or gateway); 2 usage (an unknown flag, a bad value); 78 (EX_CONFIG) the
config is missing or invalid, or this machine cannot serve it as written (its state folder
held by another server, cgroups or quotas it needs unusable): restarting will not help.
`--config PATH` (or $BASTION_CONFIG) goes before or after the subcommand.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from bastion.config import CONFIG_ENV, add_config_option, load_config, resolve_config_path
from bastion.safety.errors import BastionError, ConfigError, InvalidRequest, NotFound

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONFIG: Final = 78  # EX_CONFIG from sysexits.h


def version() -> str:
    try:
        return importlib.metadata.version("bastion")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bastion", description="A kernel-isolated workbench for AI agents, over MCP.")
    parser.add_argument("-V", "--version", action="version", version=f"bastion {version()}")
    parser.add_argument(
        "--config", help=f"path to bastion.toml (or set {CONFIG_ENV}); also accepted after the subcommand"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")

    init = sub.add_parser("init", help="write a demo config and its folders into DIR")
    init.add_argument("dir")
    data_env = init.add_mutually_exclusive_group()
    data_env.add_argument(
        "--python-env",
        help="an existing venv on /usr/bin/python3 for the python-data sandbox template, which becomes the default",
    )
    data_env.add_argument(
        "--python-data",
        action="store_true",
        help="build the python-data template's venv (numpy, pandas, matplotlib from bastion's hashed lock; "
        "needs PyPI) into DIR/envs/python-data and make it the default",
    )

    serve = sub.add_parser("serve", help="serve MCP")
    add_config_option(serve)
    # Checked after parsing: argparse's own check runs before it names an unknown flag (--htpp).
    transport = serve.add_mutually_exclusive_group()
    transport.add_argument("--stdio", action="store_true", help="serve over stdin/stdout")
    transport.add_argument("--http", action="store_true", help="serve Streamable HTTP at /mcp, with OAuth")
    serve.add_argument("--listen", help="HOST:PORT to bind with --http (default: the config's [http] listen)")
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="the server log on stderr (default: the config's log_format)"
    )

    doctor = sub.add_parser("doctor", help="check what this machine and config will enforce, before an agent connects")
    add_config_option(doctor)
    doctor.add_argument("--json", action="store_true", help="print a JSON list of {check, status, detail}")

    from bastion.transports.http.admin_cli import add_admin_parser

    add_admin_parser(sub)

    policy = sub.add_parser("policy", help="inspect command policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    explain = policy_sub.add_parser("explain", help="print the decision for a command and the rule that made it")
    add_config_option(explain)
    explain.add_argument("--workspace", help="workspace id (default: the config's default_workspace)")
    explain.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...] (or one quoted command line)")

    audit = sub.add_parser("audit", help="audit log tools")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    verify = audit_sub.add_parser("verify", help="check the hash chain of an audit log (PATH, or the config's)")
    add_config_option(verify)
    verify.add_argument("path", nargs="?", help="the audit log (default: the config's [audit] path)")

    from bastion.gateway.cli import add_parsers as add_gateway_parsers

    add_gateway_parsers(sub)

    from bastion.templates.cli import add_parser as add_template_parser

    add_template_parser(sub)
    _add_install_service(sub)
    return parser


def _add_install_service(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    service = sub.add_parser(
        "install-service", help="create the systemd unit, its user, folders and config (as root; idempotent)"
    )
    # One or the other (found by review: both were taken, and --user was dropped without a word).
    account = service.add_mutually_exclusive_group()
    account.add_argument("--user", default="bastion", help="the account the service runs as (default: bastion)")
    account.add_argument(
        "--as-root",
        action="store_true",
        help="run the service as root (bastion.service.d/root.conf), as [sandboxes] disk_quota = true needs",
    )
    service.add_argument("--prefix", default="/", help="install under this root instead of / (an image, a test)")
    service.add_argument(
        "--exec", dest="executable", help="the bastion the unit runs (default: this environment's bin/bastion)"
    )
    service.add_argument("--dry-run", action="store_true", help="print what it would do; change nothing")


def _cmd_init(args: argparse.Namespace) -> int:
    from bastion.demo import DATA_ENV_DIR, init_demo

    path = init_demo(args.dir, python_env=args.python_env, build_python_data=args.python_data)
    python_env = Path(args.dir).absolute() / DATA_ENV_DIR if args.python_data else args.python_env
    print(f"wrote {path}")
    if python_env is not None:
        print(f"default sandbox template: python-data (numpy, pandas, matplotlib from {python_env})")
    else:
        print("default sandbox template: the system's Python (for numpy, pandas, matplotlib: see --python-data)")
    print(f"serve it to a local client (Claude Desktop, Claude Code): bastion serve --config {path} --stdio")
    print("serve it over HTTP: first set the administrator's password, then serve:")
    print(f"  bastion admin set-password --config {path} --generate")
    print(f"  bastion serve --config {path} --http")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from bastion.serve import serve_stdio

    if not (args.stdio or args.http):
        print("bastion serve: give --stdio (a local client starts it) or --http (a listener)", file=sys.stderr)
        return EXIT_USAGE
    config_path = resolve_config_path(args.config)
    config = load_config(config_path)
    if args.log_format is not None:
        config = config.model_copy(update={"log_format": args.log_format})
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
        raise NotFound(f"no workspace {args.workspace!r} in the config: use one of its [[workspace]] ids")
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

    path = args.path if args.path is not None else str(load_config(resolve_config_path(args.config)).audit_path)
    report = verify(path)
    if report.ok:
        print(f"ok: {report.records} records, chain intact")
        return 0
    if report.line is None:  # nothing was read: not a broken chain, a file that cannot be checked
        print(f"bastion: cannot verify {path}: {report.first_error}", file=sys.stderr)
        return EXIT_FAILED
    print(f"BROKEN at {report.file}:{report.line}: {report.first_error}")
    return EXIT_FAILED


def _cmd_gateway(args: argparse.Namespace) -> int:
    from bastion.gateway.cli import run_gateway

    return run_gateway(args)


def _cmd_approvals(args: argparse.Namespace) -> int:
    from bastion.gateway.cli import run_approvals

    return run_approvals(args)


def _cmd_template(args: argparse.Namespace) -> int:
    from bastion.templates.cli import run_template

    return run_template(args)


def _cmd_install_service(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from bastion.systemd.install import InstallOptions, default_executable, install_service

    options = InstallOptions(
        executable=Path(args.executable) if args.executable else default_executable(),
        prefix=Path(args.prefix),
        user=args.user,
        as_root=args.as_root,
        dry_run=args.dry_run,
    )
    if not options.dry_run and options.prefix == Path("/") and os.geteuid() != 0:
        print("bastion install-service: run it as root (or see what it would do with --dry-run)", file=sys.stderr)
        return EXIT_FAILED
    install_service(options, sys.stdout)
    return 0


def _cmd_version(_args: argparse.Namespace) -> int:
    print(f"bastion {version()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {
        "version": _cmd_version,
        "init": _cmd_init,
        "serve": _cmd_serve,
        "doctor": _cmd_doctor,
        "admin": _cmd_admin,
        "policy": _cmd_policy_explain,
        "audit": _cmd_audit_verify,
        "gateway": _cmd_gateway,
        "approvals": _cmd_approvals,
        "template": _cmd_template,
        "install-service": _cmd_install_service,
    }
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        _say(exc)
        return EXIT_CONFIG
    except InvalidRequest as exc:
        _say(exc)
        return EXIT_USAGE
    except BastionError as exc:  # not found, refused, failed: the config itself is fine
        _say(exc)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _say(exc: Exception) -> None:
    """The refusal on stderr, its control characters escaped: a message may quote a name an agent chose, whose
    terminal escapes would rewrite the administrator's screen (found by attack)."""
    from bastion.logs import terminal_text

    print(f"bastion: {terminal_text(str(exc))}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
