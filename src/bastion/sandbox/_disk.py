"""A sandbox's /workspace as a filesystem of its own, so its size is a hard quota. DANGEROUS.

Runs mkfs, sets up loop devices and mounts as the server (root). A loop-mounted ext4 image per
sandbox: writes past the size fail with ENOSPC inside the sandbox, the files are on disk (they
survive a server crash for recovery), and closing is an unmount and a delete.

mkfs.ext4 runs once per image size and server (`FormattedImage`): a sandbox's image is a sparse
copy of that one's written extents (about 100 KiB for 2 GiB), attached to a loop device with
LOOP_CONFIGURE and mounted with mount(2). Measured here: 44 ms for mkfs plus mount(8), 8 ms this
way; unmounting with umount2(2) 12 ms against 43 ms for umount(8). The copies share the
template's UUID and directory hash seed: nothing mounts them by UUID, and each is its own
filesystem (a hash seed known to one sandbox would only slow its own folders).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess  # allowed in pyproject.toml: this is a dangerous-layer module: mkfs and mount
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from bastion.safety.errors import BastionError, ResourceLimit, Unavailable

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
# The image is sparse: its never-written inode tables read as zeros already, so the kernel's lazy
# zeroing thread (ext4lazyinit) would only write 64 MiB per 2 GiB sandbox for nothing.
_EXT4_DATA: Final = b"noinit_itable"
_TIMEOUT_S: Final = 30
KEPT_FORMATS: Final = 8  # image sizes whose mkfs output is kept (`ImageFormats`)
_MS_NOSUID: Final = 2
_MS_NODEV: Final = 4
_MS_NOEXEC: Final = 8
_MS_NOATIME: Final = 1024
_MNT_DETACH: Final = 2
_UMOUNT_NOFOLLOW: Final = 8
# <linux/loop.h>
_LOOP_CONFIGURE: Final = 0x4C0A
_LOOP_CTL_GET_FREE: Final = 0x4C82
_LO_FLAGS_AUTOCLEAR: Final = 4  # the kernel detaches the device when the last user (the mount) goes
_LOOP_CONFIG: Final = struct.Struct("=II5Q4I64s64s32s2Q64x")  # struct loop_config, with its loop_info64
_LOOP_ATTEMPTS: Final = 8  # another process may take the free device between GET_FREE and CONFIGURE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.umount2.restype = ctypes.c_int
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.unshare.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
# The new mount API (<linux/mount.h>; the same numbers on every architecture, Linux 5.2 and later).
_SYS_MOVE_MOUNT: Final = 429
_SYS_FSOPEN: Final = 430
_SYS_FSCONFIG: Final = 431
_SYS_FSMOUNT: Final = 432
_FSOPEN_CLOEXEC: Final = 1
_FSCONFIG_SET_STRING: Final = 1
_FSCONFIG_CMD_CREATE: Final = 6
_FSMOUNT_CLOEXEC: Final = 1
_MOUNT_ATTR_NOSUID: Final = 0x2
_MOUNT_ATTR_NOEXEC: Final = 0x8
_MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_AT_FDCWD: Final = -100
_CLONE_FS: Final = 0x200
_CLONE_NEWNS: Final = 0x20000
T = TypeVar("T")


def quota_available() -> str | None:
    """None when quotas can be made here; else one line saying why not."""
    if os.geteuid() != 0:
        return "a disk quota needs root (it mounts a filesystem per sandbox)"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (e2fsprogs, mount)"
    return None


def _run(argv: list[str], pass_fds: tuple[int, ...] = ()) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False, pass_fds=pass_fds)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{argv[0]} failed: {exc}") from exc
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise Unavailable(f"{argv[0]} failed: {lines[-1] if lines else 'exit status ' + str(done.returncode)}")


@dataclass(frozen=True)
class FormattedImage:
    """What mkfs.ext4 wrote for one image size: its written extents (offset, bytes); the rest is holes."""

    size_bytes: int
    extents: tuple[tuple[int, bytes], ...]


def format_image(directory: Path, size_bytes: int) -> FormattedImage:
    """Run mkfs.ext4 on an unnamed sparse file in `directory` (O_TMPFILE: nothing left by a crash)
    and keep what it wrote."""
    try:
        fd = _unnamed_file(directory)
    except OSError as exc:
        raise Unavailable(f"cannot make a disk image in {directory}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, size_bytes)
        # mkfs opens the file as its own fd (the same inode, which has no other name), not as ours under
        # /proc/<our pid>: once the server's threads changed their file ids (`paths.acting_as`) the
        # kernel makes it non-dumpable, and a child then needs CAP_SYS_PTRACE to look into its /proc.
        _run(["mkfs.ext4", *_MKFS_OPTIONS, f"/dev/fd/{fd}"], pass_fds=(fd,))
        return FormattedImage(size_bytes, tuple(_extents(fd, size_bytes)))
    except OSError as exc:
        raise Unavailable(f"cannot make a disk image in {directory}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _unnamed_file(directory: Path) -> int:
    """An unnamed file in `directory`: O_TMPFILE, or where the filesystem lacks it, a file unlinked at once."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, name = tempfile.mkstemp(prefix=".format-", dir=directory)
    os.unlink(name)
    return fd


def _new_image(image: Path) -> tuple[int, bool]:
    """A new file for `image`: nameless (O_TMPFILE) in its folder, or where the filesystem lacks it, made under its
    name (O_EXCL, no link followed); whether it is named."""
    try:
        return os.open(image.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), False
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    return os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), True


def _name(fd: int, image: Path) -> int:
    """Give the nameless file `fd` the name `image` (an entry there already: EEXIST, never replaced), and open it
    again by that name, which a loop device then records as its backing file (the nameless fd's path stays
    "/#<inode> (deleted)", and recovery finds a crashed server's devices by path)."""
    folder = os.open(image.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # With a dir fd, os.link is linkat(AT_SYMLINK_FOLLOW): plain link() would link /proc's symlink itself.
        os.link(f"/proc/self/fd/{fd}", image.name, dst_dir_fd=folder)
        return os.open(image.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    finally:
        os.close(folder)


def _extents(fd: int, size: int) -> list[tuple[int, bytes]]:
    found = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole after `offset`
                break
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        found.append((start, os.pread(fd, end - start, start)))
        offset = end
    return found


class ImageFormats:
    """One `FormattedImage` per size, made on first use (mkfs once, not per sandbox). Thread-safe.

    At most `KEPT_FORMATS` sizes, the least recently used forgotten first: a client may ask each sandbox
    for a disk size of its own, and each size kept costs 70 to 90 KB."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._made: OrderedDict[int, FormattedImage] = OrderedDict()

    def get(self, size_bytes: int) -> FormattedImage:
        with self._lock:
            made = self._made.get(size_bytes)
            if made is None:
                made = self._made[size_bytes] = format_image(self._directory, size_bytes)
                while len(self._made) > KEPT_FORMATS:
                    self._made.popitem(last=False)
            self._made.move_to_end(size_bytes)
            return made


def make_disk(image: Path, mountpoint: Path, formatted: FormattedImage) -> None:
    """Create `image` as a copy of `formatted` (sparse), and mount it at `mountpoint` (empty).

    Named only once whole (found by attack: a server killed while it wrote the copy left an image of zeros under
    its name, which every later start failed to mount and kept, with its sandbox's folder, as left by a crash).
    """
    try:
        fd, named = _new_image(image)
    except OSError as exc:
        raise _disk_error(image, exc) from None
    try:
        os.ftruncate(fd, formatted.size_bytes)
        for offset, data in formatted.extents:
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, offset + len(data) - len(view)) :]
        if not named:
            nameless, fd = fd, _name(fd, image)
            os.close(nameless)
        _mount_image(fd, image, mountpoint)
    except OSError as exc:  # e.g. the state filesystem is full: typed, as mkfs failing was
        raise _disk_error(image, exc) from None
    finally:
        os.close(fd)
    (mountpoint / "lost+found").rmdir()
    os.chmod(mountpoint, 0o700)


STATE_FULL_ERRNOS: Final = (errno.ENOSPC, errno.EDQUOT)


def state_full(detail: str) -> ResourceLimit:
    """The refusal of a new sandbox whose folders or disk do not fit the state filesystem (`detail`: what failed,
    for the audit log, never the client)."""
    return ResourceLimit(
        "no room for a new sandbox: the state filesystem is full: delete snapshots with delete_snapshot, "
        "or close sandboxes",
        detail=detail,
    )


def _disk_error(image: Path, exc: OSError) -> BastionError:
    """A failure to make a sandbox's disk, typed: a full state filesystem is RESOURCE_LIMIT (found by review:
    UNAVAILABLE, where the rest of a create on a full state filesystem says RESOURCE_LIMIT)."""
    if exc.errno in STATE_FULL_ERRNOS:
        return state_full(f"{image}: {exc.strerror}")
    return Unavailable(f"cannot make the sandbox's disk {image.name}: {exc.strerror or exc}")


def mount_disk(image: Path, mountpoint: Path) -> None:
    """Mount an existing image again (after a host reboot, to recover a sandbox's files)."""
    fd = os.open(image, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _mount_image(fd, image, mountpoint)
    finally:
        os.close(fd)


def _mount_image(image_fd: int, image: Path, mountpoint: Path) -> None:
    """Attach the image to a free loop device (autoclear) and mount it nosuid, nodev, noatime.

    Where the loop ioctls are missing (a kernel before 5.8, no /dev/loop-control), mount(8) does it.
    """
    try:
        loop_fd, device = _attach_loop(image_fd, image)
    except OSError:
        _run(["mount", "-o", _MOUNT_OPTIONS, str(image), str(mountpoint)])
        return
    try:
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOATIME
        if _libc.mount(os.fsencode(device), os.fsencode(mountpoint), b"ext4", flags, _EXT4_DATA) != 0:
            err = ctypes.get_errno()
            raise Unavailable(f"cannot mount {image} on {mountpoint}: {os.strerror(err)}")
    finally:
        os.close(loop_fd)  # autoclear: the device is freed now if the mount failed, else at unmount


def _attach_loop(image_fd: int, image: Path) -> tuple[int, str]:
    """A loop device backed by `image_fd`: its open fd and path."""
    name = os.fsencode(image)[-63:]
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_LOOP_ATTEMPTS):
            device = f"/dev/loop{fcntl.ioctl(control, _LOOP_CTL_GET_FREE)}"
            loop_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            config = _LOOP_CONFIG.pack(image_fd, 0, 0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, name, b"", b"", 0, 0)
            try:
                fcntl.ioctl(loop_fd, _LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(loop_fd)
                if exc.errno == errno.EBUSY:
                    continue
                raise
            return loop_fd, device
    finally:
        os.close(control)
    raise OSError(errno.EBUSY, "no free loop device")


def drop_disk(mountpoint: Path) -> None:
    """Unmount (lazily if busy). The image file goes with the sandbox's folder; its loop device
    detaches itself (autoclear)."""
    if not os.path.ismount(mountpoint):
        return
    path = os.fsencode(mountpoint)
    if _libc.umount2(path, _UMOUNT_NOFOLLOW) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(path, _UMOUNT_NOFOLLOW | _MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # EINVAL: not a mount point any more (unmounted meanwhile)
        raise Unavailable(f"cannot unmount {mountpoint}: {os.strerror(err)}")


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


def mount_devpts(mountpoint: Path, max_ptys: int) -> None:
    """Mount a new devpts instance on `mountpoint`, an existing folder: a sandbox's /dev/pts, its own
    (ptmx 0666, mode 0620, as bubblewrap's) and capped at `max_ptys` terminals, so one sandbox cannot
    take the terminals every other sandbox draws from (kernel.pty.max).

    The kernel lets a devpts made from the host's (initial) mount namespace use the terminals kept for
    the host's own logins (kernel.pty.reserve); bubblewrap's, made in the sandbox's, cannot. So it is
    made detached (fsopen, fsmount) by a thread with a mount namespace of its own, and attached here
    with move_mount: a sandbox's terminals never reach the host's reserve.
    """
    try:
        attached = in_own_mount_namespace(lambda: _detached_devpts(max_ptys))
    except OSError as exc:
        raise Unavailable(f"cannot make a devpts for {mountpoint}: {exc}") from None
    try:
        if (
            _libc.syscall(_SYS_MOVE_MOUNT, attached, b"", _AT_FDCWD, os.fsencode(mountpoint), _MOVE_MOUNT_F_EMPTY_PATH)
            != 0
        ):
            err = ctypes.get_errno()
            raise Unavailable(f"cannot mount a devpts on {mountpoint}: {os.strerror(err)}")
    finally:
        os.close(attached)


def in_own_mount_namespace(work: Callable[[], T]) -> T:
    """`work()`, run by a new thread with a mount namespace of its own, which goes with the thread.

    A thread per call, not one kept: its namespace is a copy of the host's mounts, and a kept one
    would hold copies of sandboxes' disks and tmpfs the host has since unmounted.
    """
    results: list[T] = []
    errors: list[Exception] = []

    def run() -> None:
        try:
            _own_mount_namespace()
            results.append(work())
        except Exception as exc:  # raised again in the calling thread, below
            errors.append(exc)

    thread = threading.Thread(target=run, name="bastion-mount-namespace")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def _own_mount_namespace() -> None:
    """Give the calling thread (only) a mount namespace of its own; it never mounts anything there."""
    if _libc.unshare(_CLONE_FS | _CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare of a mount namespace: {os.strerror(err)}")


def _detached_devpts(max_ptys: int) -> int:
    """A devpts instance made in this thread's own mount namespace, as a detached mount's fd."""
    context = _checked(_libc.syscall(_SYS_FSOPEN, b"devpts", _FSOPEN_CLOEXEC), "fsopen devpts")
    try:
        for key, value in (("ptmxmode", "0666"), ("mode", "0620"), ("max", str(max_ptys))):
            _checked(
                _libc.syscall(_SYS_FSCONFIG, context, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0),
                f"devpts option {key}",
            )
        _checked(_libc.syscall(_SYS_FSCONFIG, context, _FSCONFIG_CMD_CREATE, None, None, 0), "devpts create")
        attrs = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NOEXEC
        return _checked(_libc.syscall(_SYS_FSMOUNT, context, _FSMOUNT_CLOEXEC, attrs), "fsmount devpts")
    finally:
        os.close(context)


def _checked(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def used_bytes(mountpoint: Path) -> int:
    st = os.statvfs(mountpoint)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
