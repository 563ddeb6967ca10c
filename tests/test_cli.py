"""The CLI's inspection commands: policy explain and audit verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bastion.cli import main
from bastion.safety.audit import AuditLog
from bastion.safety.redact import Redactor


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
