"""The environment bastion.toml (or create_sandbox) may give commands: valid names only, never one that
changes how code loads.

PATH, HOME, LANG and NODE_OPTIONS are bastion's own (`HostWorkspace.environment`; NODE_OPTIONS preloads
node's network-interface shim, a convenience a command may drop, not a layer); variables that make a
program load other code (LD_PRELOAD, PYTHONPATH, GIT_*, NODE_OPTIONS...) are never settable.
A host workspace's commands also get editors that refuse and pagers that only print
(`no_shell_escape_env`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from typing import Final

from bastion.safety.commands import FIXED_PATH

ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that change how a program loads code; never settable through config.
FORBIDDEN_ENV_PREFIXES: Final = ("LD_", "GIT_", "PYTHON", "NODE_", "PERL", "RUBY", "BASH_", "DYLD_")
FIXED_ENV: Final = frozenset({"PATH", "HOME", "LANG"})
# What an allowed program starts by itself on a terminal: git commit's editor, git log's pager, man's.
EDITOR_ENV: Final = ("GIT_EDITOR", "GIT_SEQUENCE_EDITOR", "EDITOR", "VISUAL")
PAGER_ENV: Final = ("GIT_PAGER", "PAGER", "MANPAGER", "SYSTEMD_PAGER")


def env_name_problem(name: str) -> str | None:
    """Why `name` may not be set (config or create_sandbox alike), or None if it may."""
    if not ENV_NAME.fullmatch(name):
        return f"environment variable name {name!r} is not valid"
    if name in FIXED_ENV or name.upper().startswith(FORBIDDEN_ENV_PREFIXES):
        return f"environment variable {name!r} may not be set: it is bastion's own or changes how code loads"
    return None


def checked_env(env: dict[str, str]) -> dict[str, str]:
    """`env` unchanged if every name may be set from config.

    Raises:
        ValueError: an invalid name, a fixed one, or one that changes how code loads (pydantic reports it).
    """
    for name in env:
        problem = env_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
    return env


def no_shell_escape_env(configured: Mapping[str, str]) -> dict[str, str]:
    """Editor and pager variables for a host workspace, whose policy decides which programs run.

    Left unset, git starts the system's editor (vim) or pager (less) on a terminal, and both run a
    shell on request (vim's ``:!``, less's ``!``). Editors become ``false`` (git then aborts the
    commit), pagers ``cat`` (git then pages nothing), and less, if run, gets LESSSECURE=1 (no shell,
    no editor; less(1) "SECURITY"). The administrator's own EDITOR, VISUAL or PAGER in the config win,
    and git's GIT_* (which config may not set) follow them, so a ``.git/config`` the agent wrote
    (core.editor, core.pager) never picks the program: git prefers GIT_EDITOR and GIT_PAGER to it.

    Args:
        configured: the workspace's `env` from the config.

    Returns:
        The variables, to be overridden by `configured`.
    """
    refuse = shutil.which("false", path=FIXED_PATH) or "false"
    editor = configured.get("VISUAL") or configured.get("EDITOR") or refuse
    pager = configured.get("PAGER") or "cat"
    env = dict.fromkeys(EDITOR_ENV, editor) | dict.fromkeys(PAGER_ENV, pager)
    env["LESSSECURE"] = "1"
    return env
