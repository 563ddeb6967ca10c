"""Device nodes of the sandboxes' own. DANGEROUS: makes character devices and mounts a tmpfs (root only).

bubblewrap's ``--dev`` binds the host's own /dev/null, /dev/zero, /dev/full, /dev/random,
/dev/urandom and /dev/tty into a sandbox. They are mode 0666, and utimensat(2) with NULL times
needs only write access: ``touch /dev/null`` in any sandbox would set the host's node's times
to now (chmod, chown and explicit times need ownership, which the sandbox's own id does not
have). A root server therefore gives each sandbox nodes of its own: the same device numbers on
fresh inodes, in a small tmpfs of the server's, bound over bwrap's. What a sandbox changes on
them is its own and goes with it. An unprivileged server cannot make device nodes: its
sandboxes keep the host's, which every local user may touch the same way.

Each sandbox's /tmp and /dev/shm are tmpfs of its own here too, with a size and an inode cap
(bwrap's --tmpfs takes a size only, and its /dev/shm has none): filling either is ENOSPC
inside, never the host's memory or an OOM kill of the whole sandbox. Being the server's mounts,
they also outlive the sandbox's processes, so an idle sandbox can sleep without losing them.

The whole /dev is made here, not by bwrap's ``--dev``: the nodes, the links bwrap makes (fd,
stdin, stdout, stderr, core, ptmx), /dev/shm and a devpts of the sandbox's own at /dev/pts, with
a cap on its terminals. bwrap binds the folder once. ``--dev`` plus the six nodes bound over its
own were thirteen binds, and bubblewrap 0.8.0 reads the host's whole mount table at each bind.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bastion.safety.errors import Unavailable
from bastion.safety.trees import remove_tree
from bastion.sandbox._disk import drop_disk, mount_devpts, mount_tmpfs, used_bytes
from bastion.sandbox._idmap import unmount

# The Linux character devices every sandbox gets (Documentation/admin-guide/devices.txt).
DEVICES: Final[dict[str, tuple[int, int]]] = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
# The links bubblewrap's --dev makes in /dev, and what they point to.
LINKS: Final[dict[str, str]] = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "core": "/proc/kcore",
    "ptmx": "pts/ptmx",
}
DEV: Final = "dev"  # in each sandbox's folder: what bwrap binds at /dev
PTS: Final = "dev/pts"  # its devpts
# Terminals a sandbox may have open at once: the terminal tools' 64 at most, and as many for its commands' own.
MAX_PTYS: Final = 128
_TMPFS_BYTES: Final = 64 * 1024  # nodes, links and folders only: no data
# Per sandbox or host workspace: two folders, six nodes, six links, three mount points.
_TMPFS_INODES: Final = 20 * 20_000
SCRATCH: Final = ("tmp", "dev/shm")  # in each sandbox's folder: the mount points of its /tmp and /dev/shm
TMP_SIZE_BYTES: Final = 64 * 1024 * 1024
SHM_SIZE_BYTES: Final = 64 * 1024 * 1024
SCRATCH_INODES: Final = 16_384


# A POSIX ACL as the kernel reads it from system.posix_acl_access (<linux/posix_acl_xattr.h>):
# a version, then (tag, permissions, id) entries in tag order.
_ACL_VERSION: Final = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID: Final = 0xFFFFFFFF
_SEARCH: Final = 1


def _passable_only_by(folder: Path, uid: int) -> None:
    """Make `folder` root's 0700, with search (no read, no write) for `uid` alone: an ACL entry, since
    a group would let in whoever else is in it. Raises Unavailable where the filesystem has no ACLs."""
    entries = (
        (_ACL_USER_OBJ, 0o7, _ACL_NO_ID),
        (_ACL_USER, _SEARCH, uid),
        (_ACL_GROUP_OBJ, 0, _ACL_NO_ID),
        (_ACL_MASK, _SEARCH, _ACL_NO_ID),
        (_ACL_OTHER, 0, _ACL_NO_ID),
    )
    acl = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    try:
        os.setxattr(folder, "system.posix_acl_access", acl, follow_symlinks=False)
    except OSError as exc:
        raise Unavailable(
            f"cannot let only the sandbox's id pass {folder}: {exc.strerror} (the kernel needs CONFIG_TMPFS_POSIX_ACL)"
        ) from None


@dataclass(frozen=True)
class ScratchSizes:
    """Caps of a sandbox's /tmp and /dev/shm: each a tmpfs of its own, so filling one is ENOSPC inside."""

    tmp_bytes: int = TMP_SIZE_BYTES
    shm_bytes: int = SHM_SIZE_BYTES
    inodes: int = SCRATCH_INODES
    """Files and folders in each; tmpfs inodes are kernel memory, so an empty-file flood needs a cap too."""


class DeviceFolder:
    """`<state_dir>/dev`: a tmpfs (nosuid, noexec, devices allowed) holding one folder per sandbox:
    its device nodes, and the mount points of its /tmp and /dev/shm (`SCRATCH`), tmpfs of their own."""

    def __init__(self, path: Path, sizes: ScratchSizes | None = None) -> None:
        self.path = path
        self.sizes = sizes or ScratchSizes()

    def open(self) -> None:
        """Mount it, first dropping a crashed server's (whose nodes no sandbox uses any more)."""
        self.path.mkdir(mode=0o711, exist_ok=True)
        if os.path.ismount(self.path):
            drop_disk(self.path)  # lazily if a sandbox's /tmp is still mounted inside: the tree goes
        mount_tmpfs(self.path, _TMPFS_BYTES, _TMPFS_INODES, 0o711, devices=True)

    def make(self, name: str, owner: tuple[int, int] | None = None) -> str:
        """A folder for sandbox `name`: its /dev (`DEV`: the six nodes, `LINKS`, /dev/shm and a devpts
        of its own) and its /tmp; returns its path (for `SandboxSpec.devices`). `owner` (uid, gid): whose
        /tmp and /dev/shm are (the sandbox's id); /dev itself is root's, so the sandbox adds nothing to it."""
        folder = self.path / name
        folder.mkdir(mode=0o700)
        try:
            if owner is not None:
                # Only the sandbox's id (bwrap binds from here as it) passes: its /tmp is 1777, and a
                # local user must not reach a host workspace's by its predictable name (ws-<id>). The
                # folder stays root's: were it the id's (a host workspace's may be a real user's), the
                # id could rename dev/ and put a link there, and root's mounts and unmounts of
                # dev/pts and dev/shm would follow it to any folder of the host.
                _passable_only_by(folder, owner[0])
            else:
                os.chmod(folder, 0o711)  # noqa: S103 - passable, never listable
            dev = folder / DEV
            dev.mkdir(mode=0o755)
            os.chmod(dev, 0o755)  # noqa: S103 - as the host's /dev; mkdir's mode passes the umask
            for node, (major, minor) in DEVICES.items():
                os.mknod(dev / node, stat.S_IFCHR | 0o666, os.makedev(major, minor))
                os.chmod(dev / node, 0o666)  # noqa: S103 - as the host's; mknod's mode passes the umask
            for link, target in LINKS.items():
                os.symlink(target, dev / link)
            (folder / PTS).mkdir(mode=0o755)
            mount_devpts(folder / PTS, MAX_PTYS)
            for scratch, size in zip(SCRATCH, (self.sizes.tmp_bytes, self.sizes.shm_bytes), strict=True):
                (folder / scratch).mkdir(mode=0o700)
                # Executable as bwrap's own tmpfs is (programs built in /tmp run); never setuid or devices.
                mount_tmpfs(folder / scratch, size, self.sizes.inodes, 0o1777, executable=True, owner=owner)
        except BaseException:
            self.drop(name)
            raise
        return str(folder)

    def scratch_bytes(self, name: str) -> dict[str, int]:
        """Bytes used now in the sandbox's /tmp and /dev/shm, by their path inside."""
        used: dict[str, int] = {}
        for scratch, inside in zip(SCRATCH, ("/tmp", "/dev/shm"), strict=True):  # noqa: S108 - paths inside
            with contextlib.suppress(OSError):
                used[inside] = used_bytes(self.path / name / scratch)
        return used

    def drop(self, name: str) -> None:
        """Remove a sandbox's folder: unmount its /tmp, /dev/shm (their files go) and /dev/pts, then its nodes."""
        folder = self.path / name
        for mounted in (*SCRATCH, PTS):
            unmount(folder / mounted)
        remove_tree(folder)  # no link followed, at any depth (`trees`)

    def close(self) -> None:
        # Each unmount is best effort: dropping the tmpfs below detaches whatever is left, lazily.
        with contextlib.suppress(OSError, Unavailable):
            for name in os.listdir(self.path):
                for mounted in (*SCRATCH, PTS):
                    unmount(self.path / name / mounted)
        drop_disk(self.path)
