"""A template's Python environment: which lock it is built from, and building it into `python_env`.

The locks bastion ships (`python-data.lock`, numpy, pandas and matplotlib with a hash for every file)
are package data, read through importlib.resources: an installed wheel needs no source checkout.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.resources
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bastion.config import TemplateConfig
from bastion.config.sandboxes import UNFINISHED_MARK, python_env_problem
from bastion.safety.errors import ConfigError, Conflict, Unavailable
from bastion.safety.paths import file_replaceable_by, folder_to_make_changeable_by, owners_phrase
from bastion.templates._pip import install_lock, make_venv

_LOCK_SUFFIX = ".lock"
# A lock line pip may read: `name[extras]==version`, an optional marker, then only --hash options.
# Anything else a requirements file allows (-r, -e, --index-url, --no-binary, `name @ url`...) could
# fetch from elsewhere or build an sdist, running its code as the user building (often root).
_PINNED: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._, -]*\])?\s*==\s*[A-Za-z0-9.!+_-]+(\s*;[^-@]*)?")
_HASH: Final = re.compile(r"--hash[=\s]+[a-z0-9]+:[0-9a-f]+")


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


def check_lock(name: str, lock: Path) -> None:
    """Refuse a lock with anything but pinned requirements and their hashes.

    Raises:
        ConfigError: a line is an option, an include, a URL or an unpinned requirement.
    """
    _check_lock_text(name, lock, lock.read_text(encoding="utf-8", errors="replace"))


def _check_lock_text(name: str, lock: Path, text: str) -> None:
    for number, line in _logical_lines(text):
        requirement, _, hashes = line.partition(" --hash")
        hashes = "--hash" + hashes if hashes else ""
        if _PINNED.fullmatch(requirement.strip()) and all(_HASH.fullmatch(h) for h in _hash_options(hashes)):
            continue
        raise ConfigError(
            f"template {name!r} lock {lock} line {number} is not `name==version --hash=...`: "
            "a lock holds only pinned requirements and their hashes (no options, includes or URLs)"
        )


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each requirement, continuations joined and comments dropped."""
    joined, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not joined:
            start = number
        line = re.sub(r"(^|\s)#.*", "", raw)
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        if joined.strip():
            yield start, " ".join(joined.split())
        joined = ""
    if joined.strip():
        yield start, " ".join(joined.split())


def _hash_options(text: str) -> list[str]:
    return [f"--hash{part}".strip() for part in text.split("--hash")[1:]]


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() and (path / "bin" / "python").exists()


def _check_target(name: str, target: Path) -> None:
    """Build only into a new folder, an empty one, or an earlier build: never over other files."""
    if target.is_symlink():
        raise ConfigError(f"template {name!r} python_env {target} is a symbolic link: name the real folder")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"template {name!r} python_env {target} is not a folder: choose a new path")
    unfinished = (target / UNFINISHED_MARK).exists()  # an earlier build's, stopped part-way: built over
    if target.is_dir() and not _is_venv(target) and not unfinished and any(target.iterdir()):
        raise ConfigError(
            f"template {name!r} python_env {target} holds files and is not a virtual environment: "
            "choose a new or empty folder"
        )
    # An existing venv's python and pip run on the host: only one this user made is trusted, and only if
    # no one else could have changed a file in it (a .pth in site-packages runs with pip, as root).
    if target.is_dir() and (owner := target.stat().st_uid) != os.geteuid():
        raise ConfigError(
            f"template {name!r} python_env {target} belongs to uid {owner}, not to this user: "
            "remove it, or build as its owner"
        )
    _check_folders(name, target)
    if _is_venv(target):
        problem = python_env_problem(name, target)
        if problem is not None:
            raise ConfigError(problem)


def _check_folders(name: str, target: Path) -> None:
    """`target` (or, not made yet, the folder it will be made in) and every folder above it must be ones
    only root and this user could change, reached through no symbolic link: venv and pip then use the
    path, and whoever could swap a folder or link on it would choose the bin/python they run (as root).
    Judged without following links (a link another user planted in /tmp, pointing at a folder of
    root's, passed a check that looked through it); a sticky folder (/tmp) is passable, but nothing
    may be made in one (another user could be first)."""
    owner = (os.geteuid(), os.getegid())
    try:
        who = folder_to_make_changeable_by(str(target), owner)
    except OSError as exc:
        raise ConfigError(
            f"template {name!r} python_env {target} cannot be examined ({exc.strerror or exc}): fix the path"
        ) from None
    if who is not None:
        raise ConfigError(
            f"template {name!r} python_env {target} could be changed by {who}, and so what venv and pip run as "
            f"this user: build it in a folder {owners_phrase(owner)} alone, reached through no symbolic link"
        )


@contextlib.contextmanager
def _private_lock(name: str, lock: Path) -> Iterator[Path]:
    """A copy of the checked lock in a folder of this user's, which pip reads: the lock's own path
    could change between the check and pip. A lock another user could change is refused: they would
    choose the wheels, and a wheel's .pth runs whenever the venv's python starts (as root, here).
    Links on the way are judged as links (who may re-point them), not by where they lead now."""
    lock = lock.absolute()
    owner = (os.geteuid(), os.getegid())
    try:
        who = file_replaceable_by(str(lock), owner)
    except OSError as exc:
        raise ConfigError(
            f"template {name!r} python_lock {lock} cannot be examined ({exc.strerror or exc}): fix the path"
        ) from None
    if who is not None:
        raise ConfigError(
            f"template {name!r} python_lock {lock} would let other users choose what pip installs ({who}): "
            f"keep the lock where {owners_phrase(owner)} alone may write, reached through no one else's link"
        )
    text = lock.read_text(encoding="utf-8", errors="replace")
    _check_lock_text(name, lock, text)
    with tempfile.TemporaryDirectory(prefix="bastion-lock-") as folder:
        copy = Path(folder) / lock.name
        copy.write_text(text, encoding="utf-8")
        yield copy


@contextlib.contextmanager
def _building(name: str, target: Path) -> Iterator[None]:
    """An exclusive flock for the whole build on a file named after the venv's path, beside it (left there); a
    second build of the path is refused at once.

    Found by attack (two configs naming one python_env): a build started while another made the venv ran
    pip before ensurepip had put it in (pip's own error, then bastion's), and the first to finish unmarked
    the folder (`UNFINISHED_MARK`) while the other still installed. By path, not the folder (found by review):
    every step of a build goes by path, and with the folder moved aside a second build locked a new one.

    Raises:
        ConfigError: the lock file cannot be opened.
        Conflict: another build holds it.
        Unavailable: its filesystem has no file locks.
    """
    # Beside the venv, in the folder `_check_folders` found only root or this user can change.
    lock = target.with_name(f".{target.name}{BUILD_LOCK_SUFFIX}")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"template {name!r} python_env {target}: {lock} cannot be opened ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(
                f"template {name!r} python_env {target} is being built by another 'bastion template build': "
                "let it finish (run this one again after it if the lock changed)"
            ) from None
        except OSError as exc:
            raise Unavailable(
                f"template {name!r} python_env {target}: {lock} cannot be locked ({exc.strerror}): build it on a "
                "filesystem with file locks"
            ) from None
        yield
    finally:
        os.close(fd)


BUILD_LOCK_SUFFIX: Final = ".bastion-build"
"""`.<venv folder's name>.bastion-build`, beside it: held by the build under way (`_building`)."""


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
        Conflict: another build of the same folder is under way.
        Unavailable: the system Python cannot make a venv.
        OperationFailed: pip failed.
    """
    if template.python_env is None:
        raise ConfigError(f"template {template.name!r} has no python_env: set the folder to build it in")
    # The path judged is the path used: `..` is resolved once here, as text, not by the kernel after a link.
    target = Path(os.path.abspath(template.python_env))
    _check_target(template.name, target)
    with template_lock(template) as lock, _private_lock(template.name, lock) as copy:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with _building(template.name, target):
            _check_target(template.name, target)  # again, held: it was judged while another build could run
            target.mkdir(mode=0o755, exist_ok=True)
            created = not _is_venv(target)
            # Marked before the venv is made in it or the lock installed, unmarked once the lock is in: a build
            # that fails or is killed part-way (a rebuild too: found by review) leaves a folder the server refuses
            # (`unfinished_env_problem`), not one it serves.
            (target / UNFINISHED_MARK).touch(mode=0o644)
            if created:
                make_venv(target)
            install_lock(target, copy, index_url)
            (target / UNFINISHED_MARK).unlink(missing_ok=True)
    shipped = template.python_lock is None
    return BuiltEnv(target, f"bastion's {template.name}{_LOCK_SUFFIX}" if shipped else str(lock), created)
