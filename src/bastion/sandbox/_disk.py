"""A sandbox's /workspace as a filesystem of its own, so its size is a hard quota. DANGEROUS.

Runs mkfs and mount as the server (root). A loop-mounted ext4 image per sandbox: writes
past the size fail with ENOSPC inside the sandbox, the files are on disk (they survive a
server crash for recovery), and closing is an unmount and a delete. Measured here:
mkfs 13 ms + mount 8 ms, paid in the warm pool, not by create_sandbox.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess  # allowed in pyproject.toml: this is a dangerous-layer module: mkfs and mount
from pathlib import Path
from typing import Final

from bastion.safety.errors import Unavailable

_MKFS_OPTIONS: Final = (
    "-q",
    "-F",
    "-m",
    "0",  # no blocks reserved for root: the quota is the quota
    "-O",
    "^has_journal,^resize_inode",  # a disposable workspace (snapshots are the durable copy), never grown
    "-i",
    "8192",  # one inode per 8 KiB (262,144 at 2 GiB): enough for node_modules, half the default table
    "-E",
    "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0",
)
_MOUNT_OPTIONS: Final = "loop,nosuid,nodev,noatime"
_TIMEOUT_S: Final = 30
_MS_NOSUID: Final = 2
_MS_NODEV: Final = 4
_MS_NOEXEC: Final = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.mount.restype = ctypes.c_int


def quota_available() -> str | None:
    """None when quotas can be made here; else one line saying why not."""
    if os.geteuid() != 0:
        return "a disk quota needs root (it mounts a filesystem per sandbox)"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (e2fsprogs, mount)"
    return None


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{argv[0]} failed: {exc}") from exc
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise Unavailable(f"{argv[0]} failed: {lines[-1] if lines else 'exit status ' + str(done.returncode)}")


def make_disk(image: Path, mountpoint: Path, size_bytes: int) -> None:
    """Create a sparse image of `size_bytes`, make ext4 in it, mount it at `mountpoint` (empty)."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)
    _run(["mkfs.ext4", *_MKFS_OPTIONS, str(image)])
    _run(["mount", "-o", _MOUNT_OPTIONS, str(image), str(mountpoint)])
    (mountpoint / "lost+found").rmdir()
    os.chmod(mountpoint, 0o700)


def mount_disk(image: Path, mountpoint: Path) -> None:
    """Mount an existing image again (after a host reboot, to recover a sandbox's files)."""
    _run(["mount", "-o", _MOUNT_OPTIONS, str(image), str(mountpoint)])


def drop_disk(mountpoint: Path) -> None:
    """Unmount (lazily if busy). The image file goes with the sandbox's folder."""
    if os.path.ismount(mountpoint):
        try:
            _run(["umount", str(mountpoint)])
        except Unavailable:
            _run(["umount", "-l", str(mountpoint)])


def mount_tmpfs(
    mountpoint: Path,
    size_bytes: int,
    inodes: int,
    mode: int,
    *,
    devices: bool = False,
    executable: bool = False,
    owner: tuple[int, int] | None = None,
) -> None:
    """Mount a small private tmpfs on `mountpoint`, an existing folder: nosuid always, noexec unless
    `executable`, nodev unless `devices`; its root `mode`, owned by `owner` (uid, gid) or root.

    mount(2) directly, not mount(8): a sandbox's /tmp and /dev/shm are two of these per start,
    and a process per mount would be most of a cold create_sandbox.
    """
    options = f"size={size_bytes},nr_inodes={inodes},mode={mode:o}"
    if owner is not None:
        options += f",uid={owner[0]},gid={owner[1]}"
    flags = _MS_NOSUID | (0 if devices else _MS_NODEV) | (0 if executable else _MS_NOEXEC)
    if _libc.mount(b"bastion", os.fsencode(mountpoint), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise Unavailable(f"cannot mount a tmpfs on {mountpoint}: {os.strerror(err)}")


def used_bytes(mountpoint: Path) -> int:
    st = os.statvfs(mountpoint)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
