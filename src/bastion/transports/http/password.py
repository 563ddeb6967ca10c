"""The one administrator credential: an argon2id hash in `<state_dir>/admin-password.argon2`.

The password itself is never stored or logged. Setting a new one revokes every grant, token and
admin session (the caller does that through the store), so a leaked password or token stops working.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path
from typing import Final

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from bastion.safety.errors import ConfigError

logger = logging.getLogger("bastion.http.password")

MIN_PASSWORD_CHARS: Final = 12
MAX_PASSWORD_CHARS: Final = 1024
_HASHER: Final = PasswordHasher()  # argon2id, RFC 9106 low-memory profile defaults


def generate_password() -> str:
    """A random password for first runs: about 120 bits, easy to copy."""
    return secrets.token_urlsafe(15)


def check_new_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_CHARS:
        raise ConfigError(f"the admin password must have at least {MIN_PASSWORD_CHARS} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise ConfigError(f"the admin password may have at most {MAX_PASSWORD_CHARS} characters")


def write_hash(path: Path, password: str) -> None:
    """Store the argon2id hash of `password`, replacing any previous one atomically (mode 0600)."""
    check_new_password(password)
    encoded = _HASHER.hash(password)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, encoded.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


class AdminCredential:
    """Checks the administrator's password against the hash file (re-read when it changes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cached: tuple[float, str] | None = None

    def _hash(self) -> str | None:
        try:
            stat = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if self._cached is None or self._cached[0] != stat.st_mtime_ns:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                text = os.read(fd, 4096).decode().strip()
            finally:
                os.close(fd)
            self._cached = (stat.st_mtime_ns, text)
        return self._cached[1]

    @property
    def is_set(self) -> bool:
        return self._hash() is not None

    def version(self) -> str:
        """Changes whenever the password does: a login made with an older password no longer counts."""
        encoded = self._hash()
        return "" if encoded is None else hashlib.sha256(encoded.encode()).hexdigest()

    def verify(self, password: str) -> bool:
        """True if `password` is the administrator's; the argon2 work is done even for an unset hash."""
        encoded = self._hash()
        if encoded is None or len(password) > MAX_PASSWORD_CHARS:
            # Same cost as a real check, so timing does not say whether a password is set.
            _HASHER.hash("x" * MIN_PASSWORD_CHARS)
            return False
        try:
            return _HASHER.verify(encoded, password)
        except VerifyMismatchError:
            return False
        except (VerificationError, InvalidHashError) as exc:
            # Not a wrong password: the check itself failed (argon2's memory or threads, a damaged hash).
            logger.error(
                "admin password check failed: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            )
            return False
