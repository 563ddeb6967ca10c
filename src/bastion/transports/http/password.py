"""The one administrator credential: an argon2id hash in `<state_dir>/admin-password.argon2`.

The password itself is never stored or logged. Setting a new one revokes every grant, token and
admin session (the caller does that through the store), so a leaked password or token stops working.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Final

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from bastion.safety.errors import ConfigError, Conflict
from bastion.safety.paths import sync_folder

if TYPE_CHECKING:
    from bastion.transports.http.store import AuthStore

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
    """Store the argon2id hash of `password`, replacing any previous one atomically (mode 0600), owned by
    the owner of its folder: found by attack, root's `set-password` on a service user's state left a file
    the server could not read, and every login answered 500 until a `chown` by hand."""
    check_new_password(password)
    encoded = _HASHER.hash(password)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = os.stat(path.parent, follow_symlinks=False)
    temp = path.with_name(path.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.geteuid() == 0 and folder.st_uid != 0:
            os.fchown(fd, folder.st_uid, folder.st_gid)
        os.write(fd, encoded.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


CHANGING_SUFFIX: Final = ".changing"
"""`<hash file>.changing`: made before a password change writes its hash, removed once every grant is revoked;
flock'd by the change while it runs."""


def _mark(hash_path: Path) -> Path:
    return hash_path.with_name(hash_path.name + CHANGING_SUFFIX)


def begin_change(hash_path: Path) -> int:
    """Mark a password change under way, durably, before its hash is written; the mark stays locked (flock) by
    the returned fd until `end_change`, so `finish_cut_short_change` leaves a change that runs alone (found by
    review: any `bastion admin` command, or a server's start, during a change revoked early and took its mark).

    Raises:
        Conflict: another change holds the mark.
    """
    mark = _mark(hash_path)
    while True:
        fd = os.open(mark, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Conflict("another 'bastion admin set-password' is under way: let it finish") from None
        except BaseException:
            os.close(fd)
            raise
        if _is(fd, mark):  # not a mark a finisher removed between our open and our lock
            break
        os.close(fd)
    try:
        os.fsync(fd)
        sync_folder(hash_path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def end_change(hash_path: Path, held: int) -> None:
    """The change is over (its grants revoked, or its hash never written): its mark goes, then its lock."""
    try:
        _mark(hash_path).unlink(missing_ok=True)
        sync_folder(hash_path.parent)
    finally:
        os.close(held)


def finish_cut_short_change(hash_path: Path, store: AuthStore) -> int:
    """Revoke every grant if a password change stopped between its hash and its revocation; how many.

    Found by attack: `set-password` killed there left the new password in force and every earlier token
    working, after a restart too. Run by the server's start and by every `bastion admin` command; a change
    still running (its mark locked) is left to finish itself.
    """
    mark = _mark(hash_path)
    try:
        fd = os.open(mark, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        if not _is(fd, mark):  # finished meanwhile
            return 0
        revoked = store.revoke_everything("admin password changed (a change cut short, finished now)")
        mark.unlink(missing_ok=True)
        sync_folder(hash_path.parent)
    finally:
        os.close(fd)
    logger.warning("an admin password change was cut short before its revocation: %d grant(s) revoked now", revoked)
    return revoked


def _is(fd: int, path: Path) -> bool:
    """Whether `path` names the file open as `fd`."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class AdminCredential:
    """Checks the administrator's password against the hash file (re-read when it changes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cached: tuple[tuple[int, int, int], str] | None = None
        self._unreadable = ""

    def _hash(self) -> str | None:
        """The stored hash; None when unset, or unreadable (said once in the log: no login can pass then)."""
        try:
            stat = os.stat(self.path, follow_symlinks=False)
            # A new file is a new inode: two changes within one tick of the file clock keep one mtime.
            key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if self._cached is None or self._cached[0] != key:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    text = os.read(fd, 4096).decode(errors="replace").strip()
                finally:
                    os.close(fd)
                self._cached = (key, text)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.strerror != self._unreadable:
                self._unreadable = exc.strerror or type(exc).__name__
                logger.error(
                    "the admin password file %s cannot be read (%s): no login can pass; give it to the server's "
                    "user (run 'bastion admin set-password' as that user)",
                    self.path,
                    self._unreadable,
                )
            return None
        self._unreadable = ""
        return self._cached[1]

    @property
    def is_set(self) -> bool:
        return self._hash() is not None

    def version(self) -> str:
        """Changes whenever the password does: a login made with an older password no longer counts."""
        encoded = self._hash()
        return "" if encoded is None else _version_of(encoded)

    def verify(self, password: str) -> str | None:
        """The version (`version`) of the hash `password` matched, or None; the argon2 work is done even for
        an unset hash. A login counts for that version only: found by attack, a login checked against the
        old hash while `set-password` replaced it read the version again afterwards, got the new one, and
        its session outlived the change."""
        encoded = self._hash()
        if encoded is None or len(password) > MAX_PASSWORD_CHARS:
            # Same cost as a real check, so timing does not say whether a password is set.
            _HASHER.hash("x" * MIN_PASSWORD_CHARS)
            return None
        try:
            return _version_of(encoded) if _HASHER.verify(encoded, password) else None
        except VerifyMismatchError:
            return None
        except (VerificationError, InvalidHashError) as exc:
            # Not a wrong password: the check itself failed (argon2's memory or threads, a damaged hash).
            logger.error(
                "admin password check failed: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            )
            return None

    def is_current(self, version: str) -> bool:
        """Whether `version` (from `verify`) is still the password's: asked after what a login made exists."""
        return hmac.compare_digest(version.encode(), self.version().encode())


def _version_of(encoded: str) -> str:
    return hashlib.sha256(encoded.encode()).hexdigest()
