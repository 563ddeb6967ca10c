"""The shared base of bastion.toml's models: the frozen, closed `Model` and the env check.

Private. The section modules (`bastion._config_*`) import from here, never from `bastion.config`,
which imports them all; everything public is imported from `bastion.config`.
"""

from __future__ import annotations

import re
from typing import Final

from pydantic import BaseModel, ConfigDict

ID_PATTERN: Final = r"^[a-z][a-z0-9_-]{0,31}$"
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that change how a program loads code; never settable through config.
_FORBIDDEN_ENV_PREFIXES: Final = ("LD_", "GIT_", "PYTHON", "NODE_", "PERL", "RUBY", "BASH_", "DYLD_")
_FIXED_ENV: Final = frozenset({"PATH", "HOME", "LANG"})


def checked_env(env: dict[str, str]) -> dict[str, str]:
    for name in env:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} is not valid")
        if name in _FIXED_ENV or name.upper().startswith(_FORBIDDEN_ENV_PREFIXES):
            raise ValueError(f"environment variable {name!r} may not be set from config")
    return env


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
