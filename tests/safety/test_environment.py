"""Tests for bastion.safety.environment's editor and pager variables of host workspaces (the names a config
may set are tested through the real loader in tests/config)."""

from __future__ import annotations

import shutil

from bastion.safety.commands import FIXED_PATH
from bastion.safety.environment import EDITOR_ENV, PAGER_ENV, no_shell_escape_env


def test_editors_refuse_and_pagers_only_print_by_default() -> None:
    env = no_shell_escape_env({})
    refuse = shutil.which("false", path=FIXED_PATH) or "false"
    assert {name: env[name] for name in EDITOR_ENV} == dict.fromkeys(EDITOR_ENV, refuse)
    assert {name: env[name] for name in PAGER_ENV} == dict.fromkeys(PAGER_ENV, "cat")
    assert env["LESSSECURE"] == "1"


def test_the_administrators_editor_and_pager_win_and_git_follows_them() -> None:
    """git's GIT_EDITOR and GIT_PAGER (which config may not set) follow the administrator's choice, so a
    .git/config the agent wrote never picks the program."""
    env = no_shell_escape_env({"EDITOR": "/usr/bin/nano", "PAGER": "/usr/bin/less"})
    assert env["GIT_EDITOR"] == env["GIT_SEQUENCE_EDITOR"] == "/usr/bin/nano"
    assert env["GIT_PAGER"] == env["MANPAGER"] == "/usr/bin/less"
    assert no_shell_escape_env({"VISUAL": "vi", "EDITOR": "nano"})["GIT_EDITOR"] == "vi"
