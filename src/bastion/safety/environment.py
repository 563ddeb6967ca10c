"""The environment bastion.toml (or create_sandbox) may give commands: valid names only, never one that
changes how code loads.

PATH, HOME and LANG are bastion's own (`HostWorkspace.environment`); variables that make a
program load other code (LD_PRELOAD, PYTHONPATH, GIT_*, NODE_OPTIONS...) are never settable.
"""

from __future__ import annotations

import re
from typing import Final

ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that change how a program loads code; never settable through config.
FORBIDDEN_ENV_PREFIXES: Final = ("LD_", "GIT_", "PYTHON", "NODE_", "PERL", "RUBY", "BASH_", "DYLD_")
FIXED_ENV: Final = frozenset({"PATH", "HOME", "LANG"})


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
