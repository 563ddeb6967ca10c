"""Idmapped mounts: a host folder shown to a sandbox's uid as if it were the folder's owner. DANGEROUS.

Runs as the server (root): makes user namespaces and mounts, through raw syscalls of the
new mount API (open_tree, mount_setattr, move_mount: mount_setattr(2), Linux 5.12+).
A sandbox's processes run on the host as an unprivileged uid X. Through an idmapped
mount of a host folder, a file they create lands on disk as the folder's owner, and the
owner's files show to them as X (so as uid 1000 inside, through bwrap's own map). Files
of any other uid show as the overflow uid (65534): X has only the "other" rights there.

The mount is a clone of the source alone (mounts below the source are not in it),
nosuid, nodev, and private: it leaves the source's peer group, so nothing mounted later
on either side appears on the other. Attaching it still follows the propagation of the
target's parent mount: keep staging folders under a private mount, or the attach shows
in the other mount namespaces that share that parent.

What it is NOT: a limit on what X may do to the owner's files (there X is the owner:
write, chmod, delete), nor on the mode bits X sets. A setuid or setgid file X makes is
the owner's setuid file on disk, live on any host path to it without nosuid; keeping
that out is the seccomp filter's or a host-side check's job, not this mount's.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import stat
import subprocess  # allowed in pyproject.toml: this is a dangerous-layer module: `unshare` makes the user namespace
import time
from pathlib import Path
from typing import Final

from bastion.safety.errors import Unavailable

IdRange = tuple[int, int, int]
"""One line of a uid_map or gid_map: first id inside, first id outside, count (user_namespaces(7))."""

# The new mount API's numbers are the same on every architecture (asm-generic, since 5.2).
_SYSCALLS: Final[dict[str, dict[str, int]]] = {
    "x86_64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442},
    "aarch64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442},
}
# <linux/mount.h>, <fcntl.h>, <sys/mount.h>.
_OPEN_TREE_CLONE: Final = 1
_AT_EMPTY_PATH: Final = 0x1000
_AT_SYMLINK_NOFOLLOW: Final = 0x100
_MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_MOVE_MOUNT_T_EMPTY_PATH: Final = 0x40
_MOUNT_ATTR_NOSUID: Final = 0x2
_MOUNT_ATTR_NODEV: Final = 0x4
_MOUNT_ATTR_IDMAP: Final = 0x100000
_MS_PRIVATE: Final = 1 << 18
_MNT_DETACH: Final = 2
_UMOUNT_NOFOLLOW: Final = 8

_MAX_ID: Final = 2**32 - 2  # (uid_t)-1 is "no id"
_PROBE_MAP: Final[IdRange] = (0, 65534, 1)
UNSHARE_ENV: Final = {"PATH": "/usr/bin:/bin"}
_NAMESPACE_WAIT_S: Final = 5.0
_POLL_S: Final = 0.001
_REAP_TIMEOUT_S: Final = 10.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.umount2.restype = ctypes.c_int


class _MountAttr(ctypes.Structure):
    """struct mount_attr, MOUNT_ATTR_SIZE_VER0 (32 bytes)."""

    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def _syscall(name: str, *args: object) -> int:
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise OSError(errno.ENOSYS, f"no syscall number for {name} on {os.uname().machine}")
    # syscall(2) is variadic: ctypes would pass a bare int as a 32-bit C int, so widen them.
    wide = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    rc = int(_libc.syscall(ctypes.c_long(numbers[name]), *wide))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def _check_range(id_range: IdRange) -> None:
    inside, outside, count = id_range
    if count < 1 or min(inside, outside) < 0 or max(inside, outside) + count - 1 > _MAX_ID:
        raise ValueError(f"invalid id range {id_range}")


def user_namespace(uid_map: IdRange, gid_map: IdRange) -> int:
    """A new user namespace with one uid range and one gid range.

    A short-lived ``unshare --user sleep infinity`` makes it; the maps are written as
    root, then the namespace is held by an fd and the child is killed and reaped.

    Args:
        uid_map: (first uid inside, first uid outside, count).
        gid_map: the same for gids; setgroups(2) is denied in the namespace.

    Returns:
        An fd of the namespace (close-on-exec); the caller closes it.

    Raises:
        ValueError: a range is empty or outside 0..2**32-2.
        Unavailable: unshare is missing or failed, or the maps were refused (not root).
    """
    _check_range(uid_map)
    _check_range(gid_map)
    unshare = shutil.which("unshare", path=UNSHARE_ENV["PATH"])
    sleep = shutil.which("sleep", path=UNSHARE_ENV["PATH"])
    if unshare is None or sleep is None:
        raise Unavailable("unshare or sleep is not installed (util-linux, coreutils)")
    try:
        child = subprocess.Popen(
            [unshare, "--user", sleep, "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=UNSHARE_ENV,
        )
    except OSError as exc:
        raise Unavailable(f"cannot run unshare: {exc.strerror}") from None
    try:
        _wait_for_namespace(child)
        _write_proc(child.pid, "uid_map", "{} {} {}\n".format(*uid_map))
        _write_proc(child.pid, "setgroups", "deny")
        _write_proc(child.pid, "gid_map", "{} {} {}\n".format(*gid_map))
        try:
            return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise Unavailable(f"cannot open the new user namespace: {exc.strerror}") from None
    finally:
        child.kill()
        child.communicate(timeout=_REAP_TIMEOUT_S)


def _wait_for_namespace(child: subprocess.Popen[bytes]) -> None:
    """Return once `child` is in a user namespace other than ours (it has called unshare(2))."""
    own = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + _NAMESPACE_WAIT_S
    while True:
        try:
            if os.readlink(f"/proc/{child.pid}/ns/user") != own:
                return
        except OSError:
            pass  # exiting: poll() below says so
        if child.poll() is not None:
            assert child.stderr is not None
            lines = child.stderr.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {child.returncode}"
            raise Unavailable(f"cannot make a user namespace: {why}")
        if time.monotonic() > deadline:
            raise Unavailable(f"unshare made no user namespace within {_NAMESPACE_WAIT_S:g} s")
        time.sleep(_POLL_S)


def _write_proc(pid: int, name: str, text: str) -> None:
    # Each map must arrive in one write(2) (user_namespaces(7)).
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise Unavailable(f"cannot write the user namespace's {name}: {exc.strerror}") from None


def _open_dir(path: Path | str, role: str) -> int:
    """An O_PATH fd of the directory `path` itself, refusing a symlink in its last component."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        what = "does not exist" if exc.errno == errno.ENOENT else f"cannot be opened: {exc.strerror}"
        raise Unavailable(f"idmapped mount {role} {path} {what}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISDIR(mode):
        os.close(fd)
        what = "is a symbolic link" if stat.S_ISLNK(mode) else "is not a directory"
        raise Unavailable(f"idmapped mount {role} {path} {what}")
    return fd


def _is_empty(dir_fd: int) -> bool:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            return next(entries, None) is None
    finally:
        os.close(fd)


def _idmapped_tree(source: Path | str, userns_fd: int) -> int:
    """A detached, idmapped, nosuid, nodev, private clone of the mount at `source`; its fd."""
    source_fd = _open_dir(source, "source")
    try:
        flags = _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW | _OPEN_TREE_CLONE | os.O_CLOEXEC
        tree = _syscall("open_tree", source_fd, b"", flags)
    except OSError as exc:
        raise Unavailable(_mount_api_reason("open_tree", exc, source)) from None
    finally:
        os.close(source_fd)
    attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, _MS_PRIVATE, userns_fd)
    try:
        _syscall("mount_setattr", tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr))
    except OSError as exc:
        os.close(tree)  # a detached tree goes away with its last fd
        raise Unavailable(_mount_api_reason("mount_setattr", exc, source)) from None
    return tree


def _mount_api_reason(call: str, exc: OSError, source: Path | str) -> str:
    if exc.errno == errno.ENOSYS:
        return f"the kernel has no {call} (idmapped mounts need Linux 5.12 or later)"
    if call == "mount_setattr" and exc.errno == errno.EINVAL:
        return f"the filesystem of {source} does not support idmapped mounts"
    if call == "mount_setattr" and exc.errno == errno.EPERM:
        return f"{source} is already on an idmapped mount, or its filesystem is not root's to idmap"
    return f"{call} of {source} failed: {exc.strerror}"


def idmapped_mount(
    source: Path | str, target: Path | str, *, owner: tuple[int, int], identity: tuple[int, int]
) -> None:
    """Attach at `target` an idmapped clone of the folder `source`, where `identity` acts as `owner`.

    Files that host uid/gid `identity` creates through the mount are `owner`'s on disk,
    and `owner`'s files show as `identity`'s. The mount is nosuid, nodev and private.

    Args:
        source: the host folder; refused if its last component is a symlink.
        target: an existing empty directory, not a symlink, not already a mount point.
        owner: (uid, gid) on disk.
        identity: (uid, gid) of the processes that will use the mount.

    Raises:
        Unavailable: a path is refused, or the kernel or filesystem refused the mount.
    """
    target_fd = _open_dir(target, "target")
    try:
        if not _is_empty(target_fd):
            raise Unavailable(f"idmapped mount target {target} is not empty")
        if is_mounted(target):
            raise Unavailable(f"idmapped mount target {target} is already a mount point: unmount it first")
        userns = user_namespace((owner[0], identity[0], 1), (owner[1], identity[1], 1))
        try:
            tree = _idmapped_tree(source, userns)
        finally:
            os.close(userns)
        try:
            flags = _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH
            _syscall("move_mount", tree, b"", target_fd, b"", flags)
        except OSError as exc:
            raise Unavailable(f"cannot attach the idmapped mount at {target}: {exc.strerror}") from None
        finally:
            os.close(tree)
    finally:
        os.close(target_fd)


def unmount(target: Path | str) -> None:
    """Detach the mount at `target`, lazily (open files keep it alive); nothing if none is there.

    Raises:
        Unavailable: the kernel refused for another reason (e.g. not root).
    """
    if _libc.umount2(os.fsencode(target), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
        raise Unavailable(f"cannot unmount {target}: {os.strerror(err)}")


def is_mounted(path: Path | str) -> bool:
    """Whether something is mounted at `path` (resolved), per this process's /proc/self/mountinfo."""
    wanted = os.path.realpath(path)
    with open("/proc/self/mountinfo", "rb") as info:
        return any(mount_point(line) == wanted for line in info)


def mount_point(line: bytes) -> str:
    # Field 5 per proc(5); space, tab, newline and backslash are octal escapes there.
    fields = line.split(b" ", 5)
    if len(fields) < 5:
        return ""
    raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
    return os.fsdecode(raw)


def idmap_supported(path: Path | str) -> str | None:
    """None when an idmapped mount of the folder `path` can be made here; else one line why not.

    A real probe: a user namespace and a detached idmapped clone of `path`'s mount,
    both gone before it returns (nothing is attached).
    """
    if os.geteuid() != 0:
        return "idmapped mounts need root (the server makes user namespaces and mounts)"
    if os.uname().machine not in _SYSCALLS:
        return f"idmapped mounts: no mount API syscall numbers known for {os.uname().machine}"
    try:
        userns = user_namespace(_PROBE_MAP, _PROBE_MAP)
    except Unavailable as exc:
        return exc.reason
    try:
        os.close(_idmapped_tree(path, userns))
    except Unavailable as exc:
        return exc.reason
    finally:
        os.close(userns)
    return None
