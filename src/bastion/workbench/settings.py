"""Per-sandbox settings an agent gives create_sandbox: environment variables and labels, checked and bounded.

The variables are not secret: they are shown back in get_sandbox_status and never redacted (the
administrator's config `env` is where secrets go). Their names follow the config's rules
(`bastion.safety.environment`), so nothing that changes how code loads (LD_PRELOAD, PYTHONPATH,
GIT_*...) can be set this way either. Labels are the agent's own tags, for finding its sandboxes.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Final

from bastion.safety.environment import env_name_problem
from bastion.safety.errors import InvalidRequest

MAX_ENV_VARS: Final = 64
MAX_ENV_NAME_CHARS: Final = 128
MAX_ENV_VALUE_CHARS: Final = 4096
MAX_ENV_TOTAL_CHARS: Final = 32 * 1024
MAX_LABELS: Final = 32
MAX_LABEL_VALUE_CHARS: Final = 256
LABEL_KEY: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class SandboxSettings:
    """What an agent set on its sandbox at creation; only `checked_settings` makes one from client input."""

    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, wanted: tuple[str, str | None]) -> bool:
        """Whether the labels hold `wanted` (key, value), or the key at all when value is None."""
        key, value = wanted
        return key in self.labels and (value is None or self.labels[key] == value)


def checked_settings(
    env: Mapping[str, str] | None, labels: Mapping[str, str] | None, taken: Collection[str] = ()
) -> SandboxSettings:
    """The settings, if every name and value is allowed.

    Args:
        env: variable name -> value.
        labels: key -> value.
        taken: variable names the administrator or bastion already sets for this sandbox.

    Raises:
        InvalidRequest: a name the config's rules refuse, one already set, or a bound exceeded.
    """
    return SandboxSettings(env=_checked_env(env or {}, taken), labels=_checked_labels(labels or {}))


def _checked_env(env: Mapping[str, str], taken: Collection[str]) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise InvalidRequest(f"env has {len(env)} variables: at most {MAX_ENV_VARS}")
    total = 0
    for name, value in env.items():
        if len(name) > MAX_ENV_NAME_CHARS:
            raise InvalidRequest(f"env: a variable name is longer than {MAX_ENV_NAME_CHARS} characters")
        problem = env_name_problem(name)
        if problem is not None:
            raise InvalidRequest(f"env: {problem}")
        if name in taken:
            raise InvalidRequest(f"env: {name!r} is set by the administrator or by bastion: choose another name")
        if len(value) > MAX_ENV_VALUE_CHARS:
            raise InvalidRequest(f"env: the value of {name!r} is longer than {MAX_ENV_VALUE_CHARS} characters")
        if "\0" in value:
            raise InvalidRequest(f"env: the value of {name!r} holds a NUL character, which no environment can")
        total += len(name) + len(value)
    if total > MAX_ENV_TOTAL_CHARS:
        raise InvalidRequest(f"env: names and values add up to {total} characters: at most {MAX_ENV_TOTAL_CHARS}")
    return dict(env)


def _checked_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(f"labels has {len(labels)} entries: at most {MAX_LABELS}")
    for key, value in labels.items():
        _check_label_key(key)
        if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
            raise InvalidRequest(
                f"label {key!r}: the value must be printable text of at most {MAX_LABEL_VALUE_CHARS} characters"
            )
    return dict(labels)


def _check_label_key(key: str) -> None:
    if not LABEL_KEY.fullmatch(key):
        raise InvalidRequest(
            "a label key must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def label_filter(text: str) -> tuple[str, str | None]:
    """`key=value` (that value) or `key` (any value) as (key, value).

    Raises:
        InvalidRequest: the key is not a label key.
    """
    key, sep, value = text.partition("=")
    _check_label_key(key)
    return key, value if sep else None
