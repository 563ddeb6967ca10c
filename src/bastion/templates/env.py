"""A template's Python environment: which lock it is built from, and building it into `python_env`.

The locks bastion ships (`python-data.lock`, numpy, pandas and matplotlib with a hash for every file)
are package data, read through importlib.resources: an installed wheel needs no source checkout.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bastion.config import TemplateConfig
from bastion.safety.errors import ConfigError
from bastion.templates._pip import install_lock, make_venv

_LOCK_SUFFIX = ".lock"


def builtin_lock_names() -> tuple[str, ...]:
    """Template names bastion ships a lock for (python-data)."""
    folder = importlib.resources.files("bastion.templates")
    names = (entry.name for entry in folder.iterdir() if entry.is_file())
    return tuple(sorted(name.removesuffix(_LOCK_SUFFIX) for name in names if name.endswith(_LOCK_SUFFIX)))


@contextlib.contextmanager
def template_lock(template: TemplateConfig) -> Iterator[Path]:
    """The lock file `template` is built from: its `python_lock`, else the one shipped under its name.

    Raises:
        ConfigError: neither exists.
    """
    if template.python_lock is not None:
        if not template.python_lock.is_file():
            raise ConfigError(
                f"template {template.name!r} python_lock {template.python_lock} is not a file: fix the path"
            )
        yield template.python_lock
        return
    if template.name not in builtin_lock_names():
        raise ConfigError(
            f"template {template.name!r} has no python_lock and bastion ships none of that name: "
            "set python_lock to a requirements file with a --hash for every package"
        )
    resource = importlib.resources.files("bastion.templates").joinpath(template.name + _LOCK_SUFFIX)
    with importlib.resources.as_file(resource) as path:
        yield path


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() and (path / "bin" / "python").exists()


def _check_target(name: str, target: Path) -> None:
    """Build only into a new folder, an empty one, or an earlier build: never over other files."""
    if target.is_symlink():
        raise ConfigError(f"template {name!r} python_env {target} is a symbolic link: name the real folder")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"template {name!r} python_env {target} is not a folder: choose a new path")
    if target.is_dir() and not _is_venv(target) and any(target.iterdir()):
        raise ConfigError(
            f"template {name!r} python_env {target} holds files and is not a virtual environment: "
            "choose a new or empty folder"
        )
    # An existing venv's python and pip run on the host: only one this user made is trusted.
    if target.is_dir() and (owner := target.stat().st_uid) != os.geteuid():
        raise ConfigError(
            f"template {name!r} python_env {target} belongs to uid {owner}, not to this user: "
            "remove it, or build as its owner"
        )


@dataclass(frozen=True)
class BuiltEnv:
    """A template environment `build_template_env` made or brought up to its lock."""

    path: Path
    lock: str  # the lock's path, or "bastion's <name>.lock" for a shipped one
    created: bool  # False: an existing environment was brought up to the lock


def build_template_env(template: TemplateConfig, *, index_url: str) -> BuiltEnv:
    """Make `template.python_env` on the system's Python and install its hashed lock into it.

    Rerunning it on a built environment installs what the lock changed; nothing else is touched.

    Raises:
        ConfigError: no python_env, no lock, or the folder holds something else.
        Unavailable: the system Python cannot make a venv.
        OperationFailed: pip failed.
    """
    target = template.python_env
    if target is None:
        raise ConfigError(f"template {template.name!r} has no python_env: set the folder to build it in")
    _check_target(template.name, target)
    with template_lock(template) as lock:
        created = not _is_venv(target)
        if created:
            make_venv(target)
        install_lock(target, lock, index_url)
    shipped = template.python_lock is None
    return BuiltEnv(target, f"bastion's {template.name}{_LOCK_SUFFIX}" if shipped else str(lock), created)
