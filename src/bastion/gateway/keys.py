"""Installation helpers: the gateway's dedicated key, its authorized_keys line, the dispatch script."""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

import asyncssh

from bastion.config import GatewayConfig
from bastion.safety.errors import ConfigError, Conflict, NotFound
from bastion.safety.paths import folder_replaceable_by, secret_file_problem

_ONE_LINE = re.compile(r"[ -~]+")


def dispatch_source() -> str:
    """The text of dispatch.py, shipped inside the package, to install on the target host."""
    return importlib.resources.files("bastion.gateway").joinpath("dispatch.py").read_text(encoding="utf-8")


def generate_key(gateway: GatewayConfig) -> str:
    """Write a new ed25519 key to `key_path` (0600) and `key_path.pub`; return the public line.

    Raises:
        Conflict: a key is already there (a key is never overwritten: it may be installed on a host).
        ConfigError: another user could change the key's folder (then they would hold the key).
    """
    private_path = gateway.key_path
    public_path = Path(f"{private_path}.pub")
    if private_path.exists() or public_path.exists():
        raise Conflict(f"{private_path} already exists: remove it first to make a new key")
    _check_folder(gateway)  # where it will be made: no one else's folder, no link on the way
    private_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_folder(gateway)  # as made: a link planted meanwhile was followed by mkdir, and is seen now
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"bastion-gateway-{gateway.name}")
    public = key.export_public_key("openssh").decode("ascii").strip()
    _write_new(private_path, key.export_private_key("openssh"), 0o600)
    _write_new(public_path, (public + "\n").encode("ascii"), 0o644)
    return public


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _check_folder(gateway: GatewayConfig) -> None:
    """Found by attack: keygen followed another user's link (or folder) on the way to key_path, so they held
    root's new key, and could swap in a key of theirs before `authorized-keys` printed its line."""
    folder = gateway.key_path.parent
    who = folder_replaceable_by(str(folder), _owner())
    if who is not None:
        raise ConfigError(
            f"gateway {gateway.name!r} key folder {folder}: {who}; choose a key_path in a folder of root's"
        )


def _owner() -> tuple[int, int]:
    return os.geteuid(), os.getegid()


def public_key(gateway: GatewayConfig) -> str:
    """The gateway key's public line (`TYPE BASE64 COMMENT`).

    Raises:
        NotFound: there is no key.
        ConfigError: another user could read or replace it (its line would install their key, or a copy).
    """
    try:
        problem = secret_file_problem(str(gateway.key_path), _owner())
    except OSError:
        problem = None  # missing: said below
    if problem is not None:
        raise ConfigError(f"gateway {gateway.name!r} key {gateway.key_path}: {problem}; make a new key elsewhere")
    try:
        key = asyncssh.read_private_key(str(gateway.key_path))
    except (OSError, asyncssh.KeyImportError):
        raise NotFound(
            f"no key at {gateway.key_path}: run 'bastion gateway keygen --config PATH {gateway.name}'"
        ) from None
    return key.export_public_key("openssh").decode("ascii").strip()


def authorized_keys_line(gateway: GatewayConfig) -> str:
    """The exact line for the target's authorized_keys: restricted, from-pinned, forced to dispatch.py.

    `restrict` turns off pty, port, agent and X11 forwarding and ~/.ssh/rc; `command=` makes sshd run
    dispatch.py whatever the client asks, with the client's text in SSH_ORIGINAL_COMMAND (sshd(8)).
    """
    command = f"{gateway.remote_python} -I {gateway.dispatch_path} --config {gateway.dispatch_config}"
    addresses = ",".join(gateway.from_addresses)
    line = f'restrict,from="{addresses}",command="{command}" {public_key(gateway)}'
    # Config validation already allows no quote or line break here; a second line would be a second key entry.
    if not _ONE_LINE.fullmatch(line) or line.count('"') != 4:
        raise ConfigError(f"gateway {gateway.name!r}: the authorized_keys line would not be one well-formed line")
    return line
