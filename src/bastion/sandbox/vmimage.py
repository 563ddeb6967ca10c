"""The microVM's boot files, built at install time from Debian's packages (`make setup`).

A folder holding `vmlinuz` (a copy of Debian's generic kernel: the cloud flavour has no 9p) and
`initramfs.cpio`: busybox-static, the kernel modules the guest needs (virtio-mmio, virtio-serial,
virtio-9p) and an `/init` that mounts the host's /usr and the workspace over 9p and a private
/tmp, then waits on the agent's serial port for the program the host sends (`bastion.sandbox.
microvm`): nothing of bastion is frozen into the image, so an upgrade never runs a stale agent.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import Final

__all__ = [
    "AGENT_PORT",
    "DEFAULT_IMAGE_DIR",
    "INITRAMFS_NAME",
    "KERNEL_NAME",
    "ImageError",
    "build",
    "find_kernel",
    "initramfs",
    "module_files",
]

DEFAULT_IMAGE_DIR: Final = Path("/var/lib/bastion/microvm")
KERNEL_NAME: Final = "vmlinuz"
INITRAMFS_NAME: Final = "initramfs.cpio"
BUSYBOX: Final = Path("/bin/busybox")
# Load order matters: each module's dependencies come first (modules.dep).
MODULES: Final = ("virtio_pci", "virtio_console", "9pnet_virtio", "9p")
AGENT_PORT: Final = "/dev/vport0p1"  # the first virtio-serial device's port 1 (nr=1 in the VMM's argv)
_NEEDED_CONFIG: Final = ("CONFIG_NET_9P", "CONFIG_9P_FS", "CONFIG_VIRTIO_CONSOLE", "CONFIG_VIRTIO_PCI")

# PID 1 of the guest. It runs the program the host writes on the agent port (a length, then
# Python source), as root of the guest; when that ends, the guest powers off (-no-reboot ends QEMU).
INIT: Final = f"""#!/busybox sh
/busybox mount -t proc proc /proc
/busybox mount -t sysfs sys /sys
/busybox mount -t devtmpfs dev /dev
/busybox mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
for m in $(/busybox cat /modules/order); do
  /busybox insmod /modules/$m.ko || echo "bastion-init: insmod $m failed"
done
p9=trans=virtio,version=9p2000.L,msize=262144
/busybox mount -t 9p -o $p9,ro,nodev,cache=loose usr /usr || echo "bastion-init: no /usr"
/busybox mount -t 9p -o $p9,nosuid,nodev workspace /workspace || echo "bastion-init: no /workspace"
tmp=$(/busybox sed -n 's/.*bastion.tmp=\\([0-9]*\\).*/\\1/p' /proc/cmdline)
/busybox mount -t tmpfs -o nosuid,nodev,size=$tmp tmpfs /tmp
/busybox mount -t tmpfs -o nosuid,nodev,noexec,size=1m tmpfs /run
/busybox ip link set lo up  # the only interface: the forwarder listens on 127.0.0.1:3128
/busybox mkdir -p /dev/shm && /busybox mount -t tmpfs -o nosuid,nodev,size=16m tmpfs /dev/shm
# Terminals: a slave is made by the agent (root) and opened by its command (the workspace's owner).
# /dev/ptmx a link into /dev/pts, as bubblewrap makes it: Landlock lets commands write beneath /dev/pts only.
/busybox mkdir -p /dev/pts
/busybox mount -t devpts -o nosuid,noexec,mode=0660,ptmxmode=0666,gid=$(/busybox stat -c %g /workspace) devpts /dev/pts
/busybox rm -f /dev/ptmx && /busybox ln -s pts/ptmx /dev/ptmx
/busybox chmod 1777 /tmp /dev/shm
/usr/bin/python3 -I -S -c '
import os
port = os.open("{AGENT_PORT}", os.O_RDWR)
head = b""
while len(head) < 8:
    head += os.read(port, 8 - len(head))
size = int.from_bytes(head, "big")
source = b""
while len(source) < size:
    source += os.read(port, size - len(source))
exec(compile(source, "relay", "exec"), {{"__name__": "__main__", "PORT": port}})
'
echo "bastion-init: the relay ended"
"""


class ImageError(Exception):
    """The boot files cannot be built here (one line)."""


def find_kernel(boot: Path = Path("/boot")) -> tuple[Path, str]:
    """The newest installed Debian kernel with virtio-9p and virtio-serial, and its release."""
    found: list[tuple[Path, str]] = []
    for image in sorted(boot.glob("vmlinuz-*")):
        release = image.name.removeprefix("vmlinuz-")
        config = boot / f"config-{release}"
        if config.is_file() and all(_configured(config, name) for name in _NEEDED_CONFIG):
            found.append((image, release))
    if not found:
        raise ImageError("no kernel in /boot has virtio-9p and virtio-serial: run 'apt-get install linux-image-amd64'")
    return found[-1]


def _configured(config: Path, name: str) -> bool:
    return re.search(rf"^{name}=[ym]$", config.read_text(errors="replace"), re.MULTILINE) is not None


def module_files(release: str, names: tuple[str, ...] = MODULES) -> list[Path]:
    """The .ko files of `names` and their dependencies, in load order, from modules.dep."""
    root = Path("/lib/modules") / release
    deps: dict[str, list[str]] = {}
    for line in (root / "modules.dep").read_text().splitlines():
        module, _, rest = line.partition(":")
        deps[Path(module).name.split(".ko")[0].replace("-", "_")] = [module, *rest.split()]
    order: list[str] = []
    for name in names:
        if name not in deps:
            raise ImageError(f"kernel {release} has no module {name}")
        # modules.dep lists a module's dependencies nearest first: load them in reverse.
        for path in reversed(deps[name]):
            if path not in order:
                order.append(path)
    files = [root / path for path in order]
    if any(path.suffix != ".ko" for path in files):
        raise ImageError("compressed kernel modules are not supported (busybox insmod loads plain .ko)")
    return files


class _Cpio:
    """A newc archive (the initramfs format), written in memory."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.ino = 1

    def add(self, name: str, mode: int, data: bytes = b"") -> None:
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0)
        self.ino += 1
        self.out.write(b"070701" + b"".join(b"%08x" % value for value in fields))
        self.out.write(name.encode() + b"\0")
        self._pad()
        self.out.write(data)
        self._pad()

    def _pad(self) -> None:
        self.out.write(b"\0" * (-self.out.tell() % 4))

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return self.out.getvalue()


def initramfs(release: str, busybox: Path = BUSYBOX) -> bytes:
    """The initramfs: busybox, the modules, /init and the empty mount points (merged /usr links)."""
    if not busybox.is_file():
        raise ImageError("busybox is not installed: run 'apt-get install busybox-static'")
    archive = _Cpio()
    for folder in ("proc", "sys", "dev", "usr", "workspace", "tmp", "run", "etc", "modules", "opt"):
        archive.add(folder, stat.S_IFDIR | 0o755)
    for link in ("bin", "sbin", "lib", "lib64"):
        archive.add(link, stat.S_IFLNK | 0o777, f"usr/{link}".encode())
    archive.add("busybox", stat.S_IFREG | 0o755, busybox.read_bytes())
    archive.add("init", stat.S_IFREG | 0o755, INIT.encode())
    files = module_files(release)
    for path in files:
        archive.add(f"modules/{path.name}", stat.S_IFREG | 0o644, path.read_bytes())
    order = "\n".join(path.name.removesuffix(".ko") for path in files) + "\n"
    archive.add("modules/order", stat.S_IFREG | 0o644, order.encode())
    return archive.finish()


def build(image_dir: Path = DEFAULT_IMAGE_DIR) -> Path:
    """Write the kernel and initramfs into `image_dir` (0755, world-readable: the VMM is unprivileged)."""
    kernel, release = find_kernel()
    data = initramfs(release)
    image_dir.mkdir(parents=True, exist_ok=True)
    folder = _open_own_folder(image_dir)
    try:
        os.fchmod(folder, 0o755)  # boot files, no secret: the unprivileged VMM reads them
        for name, contents in ((KERNEL_NAME, kernel.read_bytes()), (INITRAMFS_NAME, data)):
            _write_in(folder, name, contents)
    finally:
        os.close(folder)
    return image_dir


def _open_own_folder(image_dir: Path) -> int:
    """The image folder, opened without following a link, refused unless this user owns it: the
    default lies in /var/lib/bastion, which the service's account owns and could plant links in."""
    try:
        fd = os.open(image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{image_dir} is not a folder (a symbolic link?): {exc.strerror}") from None
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise ImageError(f"{image_dir} belongs to uid {owner}, not to this user: remove it, or build as its owner")
    return fd


def _write_in(folder: int, name: str, contents: bytes) -> None:
    """Write `name` in the open folder through a new file (a link planted at its name is replaced)."""
    staged = f".{name}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staged, dir_fd=folder)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
    with os.fdopen(fd, "wb") as handle:
        handle.write(contents)
        os.fchmod(handle.fileno(), 0o644)
    os.replace(staged, name, src_dir_fd=folder, dst_dir_fd=folder)


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_IMAGE_DIR
    try:
        built = build(target)
    except (ImageError, OSError) as exc:
        print(f"bastion: cannot build the microVM image: {exc}", file=sys.stderr)
        return 1
    print(f"microVM boot files in {built} ({shutil.disk_usage(built).free >> 20} MiB free there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
