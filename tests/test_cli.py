"""The CLI: policy explain, audit verify, and each papercut an administrator met (issue 18), on the real command."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from bastion.cli import main
from bastion.config import load_config
from bastion.safety.audit import AuditLog
from bastion.safety.redact import Redactor
from tests.helpers import BASTION, write_cheap_hash


def test_policy_explain_allow(capsys: pytest.CaptureFixture[str], demo_config_path: Path) -> None:
    assert main(["policy", "explain", "--config", str(demo_config_path), "--", "git", "status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ALLOW git status")
    assert "rule: allow: git" in out


def test_policy_explain_deny_names_the_rule(capsys: pytest.CaptureFixture[str], demo_config_path: Path) -> None:
    code = main(["policy", "explain", "--config", str(demo_config_path), "--", "git", "-c", "core.pager=sh", "log"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith("DENY")
    assert "rule git: deny '-c|--config-env'" in out


def test_policy_explain_shell_syntax(capsys: pytest.CaptureFixture[str], demo_config_path: Path) -> None:
    assert main(["policy", "explain", "--config", str(demo_config_path), "--", "ls; id"]) == 1
    assert "no shell runs here" in capsys.readouterr().out


def _log(path: Path, count: int) -> None:
    log = AuditLog(path, redactor=Redactor())
    log.open()
    for i in range(count):
        log.append({"tool": "t", "n": i})
    log.close()


def test_audit_verify_ok(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _log(path, 5)
    assert main(["audit", "verify", str(path)]) == 0
    assert "5 records" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["edit", "delete", "reorder"])
def test_audit_verify_reports_first_broken_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "audit.jsonl"
    _log(path, 6)
    lines = path.read_text().splitlines()
    if damage == "edit":
        record = json.loads(lines[2])
        record["tool"] = "forged"
        lines[2] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    elif damage == "delete":
        del lines[3]
    else:
        lines[2], lines[3] = lines[3], lines[2]
    path.write_text("\n".join(lines) + "\n")
    assert main(["audit", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("BROKEN at")
    assert ":3" in out or ":4" in out


# -- the papercuts of issue 18, each on the real CLI ------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed `bastion` command, as an administrator types it."""
    return subprocess.run([str(BASTION), *args], capture_output=True, text=True, timeout=60, env=env, check=False)


def set_a_password(config: Path) -> None:
    path = load_config(config).admin_hash_path
    write_cheap_hash(path, "a long enough password")


@pytest.mark.parametrize("flag", ["--version", "-V", "version"])
def test_version_is_printed_and_exits_0(flag: str) -> None:
    done = run_cli(flag)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"bastion \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout


def test_an_unknown_flag_is_named_not_a_missing_transport(demo_config_path: Path) -> None:
    done = run_cli("serve", "--config", str(demo_config_path), "--htpp")
    assert done.returncode == 2
    assert "unrecognized arguments: --htpp" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_without_a_transport_says_which_to_give(demo_config_path: Path) -> None:
    done = run_cli("serve", "--config", str(demo_config_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bastion serve: give --stdio (a local client starts it) or --http (a listener)"
    ]


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_goes_before_or_after_the_subcommand(where: str, demo_config_path: Path) -> None:
    config = ["--config", str(demo_config_path)]
    done = run_cli(*config, "approvals", "list") if where == "before" else run_cli("approvals", "list", *config)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no pending approvals\n"


def test_bastion_config_env_serves_every_subcommand(demo_config_path: Path) -> None:
    env = {**os.environ, "BASTION_CONFIG": str(demo_config_path)}
    _log(load_config(demo_config_path).audit_path, 2)
    done = run_cli("approvals", "list", env=env)
    assert done.returncode == 0, done.stderr
    verified = run_cli("audit", "verify", env=env)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("ok: ")


def test_audit_verify_takes_the_config_instead_of_a_path(demo_config_path: Path) -> None:
    _log(load_config(demo_config_path).audit_path, 1)
    done = run_cli("audit", "verify", "--config", str(demo_config_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok: 1 records, chain intact\n"


@pytest.mark.parametrize("target", ["folder", "missing"])
def test_audit_verify_of_what_is_not_a_log_is_one_line_exit_1(target: str, tmp_path: Path) -> None:
    path = tmp_path if target == "folder" else tmp_path / "nope.jsonl"
    done = run_cli("audit", "verify", str(path))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"bastion: cannot verify {path}: ")
    assert "None" not in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("admin", "revoke", "nope"),
        ("approvals", "approve", "ap-nope"),
        ("gateway", "authorized-keys", "nope"),
        ("policy", "explain", "--workspace", "nope", "--", "ls"),  # found by review: exited 78
    ],
)
def test_what_does_not_exist_exits_1_not_78(args: tuple[str, ...], demo_config_path: Path) -> None:
    done = run_cli("--config", str(demo_config_path), *args)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_install_service_refuses_a_user_and_as_root_together() -> None:
    """Found by review (twenty-seventh session): `--user foo --as-root` was taken, and the unit ran as root with
    no word that --user was dropped. Invariant: the two are refused together, as usage (exit 2)."""
    done = run_cli("install-service", "--user", "foo", "--as-root", "--dry-run")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "not allowed with argument" in done.stderr, done.stderr


def test_a_bad_value_is_usage_and_a_bad_config_is_78(demo_config_path: Path, tmp_path: Path) -> None:
    bad_value = run_cli("admin", "token", "--config", str(demo_config_path), "--client", "no spaces!")
    assert bad_value.returncode == 2, bad_value.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[sandboxes\n")
    bad_config = run_cli("approvals", "list", "--config", str(broken))
    assert bad_config.returncode == 78, bad_config.stderr


def test_init_prints_commands_that_work_as_printed(tmp_path: Path) -> None:
    done = run_cli("init", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stderr
    commands = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("bastion ")]
    config = str(tmp_path / "demo" / "bastion.toml")
    assert f"bastion admin set-password --config {config} --generate" in commands
    set_password = run_cli("admin", "set-password", "--config", config, "--generate")
    assert set_password.returncode == 0, set_password.stderr
    assert any(line.endswith(f"bastion serve --config {config} --http") for line in done.stdout.splitlines())


def test_a_port_in_use_is_one_line_and_exit_1_before_any_banner(demo_config_path: Path) -> None:
    set_a_password(demo_config_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_cli("serve", "--config", str(demo_config_path), "--http", "--listen", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"bastion: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_the_cgroup_hint_names_the_setting_that_helps(demo_config_path: Path) -> None:
    from bastion.app import without_cgroups

    config = load_config(demo_config_path)
    assert "[sandboxes] enabled = false" in without_cgroups(config)
    assert "use_cgroups" not in without_cgroups(config)


def test_a_preview_port_in_use_is_one_line_and_exit_1_before_any_banner(demo_config_path: Path) -> None:
    set_a_password(demo_config_path)
    with socket.create_server(("127.0.0.1", 0)) as main_port, socket.create_server(("127.0.0.1", 0)) as taken:
        free = main_port.getsockname()[1]
        port = taken.getsockname()[1]
        text = demo_config_path.read_text()
        demo_config_path.write_text(text.replace("[http]\n", f'[http]\npreview_listen = "127.0.0.1:{port}"\n', 1))
        main_port.close()  # the main listener's port is free; the preview's is taken
        done = run_cli("serve", "--config", str(demo_config_path), "--http", "--listen", f"127.0.0.1:{free}")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"bastion: cannot listen on 127.0.0.1:{port}: Address already in use"]
