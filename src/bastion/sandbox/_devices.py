"""Device nodes of the sandboxes' own. DANGEROUS: makes character devices and mounts a tmpfs (root only).

bubblewrap's ``--dev`` binds the host's own /dev/null, /dev/zero, /dev/full, /dev/random,
/dev/urandom and /dev/tty into a sandbox. They are mode 0666, and utimensat(2) with NULL times
needs only write access: ``touch /dev/null`` in any sandbox would set the host's node's times
to now (chmod, chown and explicit times need ownership, which the sandbox's own id does not
have). A root server therefore gives each sandbox nodes of its own: the same device numbers on
fresh inodes, in a small tmpfs of the server's, bound over bwrap's. What a sandbox changes on
them is its own and goes with it. An unprivileged server cannot make device nodes: its
sandboxes keep the host's, which every local user may touch the same way.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Final

from bastion.sandbox._disk import drop_disk, mount_tmpfs

# The Linux character devices every sandbox gets (Documentation/admin-guide/devices.txt).
DEVICES: Final[dict[str, tuple[int, int]]] = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
_TMPFS_BYTES: Final = 64 * 1024  # nodes and folders only: no data
_TMPFS_INODES: Final = 8 * 20_000  # a folder and six nodes per sandbox or host workspace, at most


class DeviceFolder:
    """`<state_dir>/dev`: a tmpfs (nosuid, noexec, devices allowed) holding one folder of nodes per sandbox."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> None:
        """Mount it, first dropping a crashed server's (whose nodes no sandbox uses any more)."""
        self.path.mkdir(mode=0o711, exist_ok=True)
        if os.path.ismount(self.path):
            drop_disk(self.path)
        mount_tmpfs(self.path, _TMPFS_BYTES, _TMPFS_INODES, 0o711, devices=True)

    def make(self, name: str) -> str:
        """A folder of the six nodes for sandbox `name`; returns its path (for `SandboxSpec.devices`)."""
        folder = self.path / name
        folder.mkdir(mode=0o711)
        for node, (major, minor) in DEVICES.items():
            os.mknod(folder / node, stat.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(folder / node, 0o666)  # noqa: S103 - as the host's; mknod's mode passes the umask
        return str(folder)

    def drop(self, name: str) -> None:
        """Remove a sandbox's nodes (the folder holds nodes only; rmtree never follows links here)."""
        if shutil.rmtree.avoids_symlink_attacks:  # noqa: TID251 - fd-based; on our own tmpfs only
            shutil.rmtree(self.path / name, ignore_errors=True)  # noqa: TID251 - see above

    def close(self) -> None:
        drop_disk(self.path)
