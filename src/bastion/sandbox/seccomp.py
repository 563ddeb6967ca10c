"""The sandbox's seccomp filter, compiled with libseccomp. DANGEROUS.

A change to the table below changes what every sandboxed process may ask of the
kernel: review it as a security change. This module only compiles the filter to
classic BPF; bubblewrap loads it (``bwrap --seccomp FD``) just before it execs the
agent, so the agent and every command it starts run under it, and no process in
the sandbox can remove it (seccomp(2): filters are inherited and only ever added).

What it denies, with EPERM unless said otherwise (EPERM rather than a kill:
programs that probe a feature then degrade, and the refusal reaches the client as
a plain error):

- Mount API: mount(2), umount2(2), pivot_root(2), and the new mount API
  (open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr). The
  agent holds CAP_SYS_ADMIN in the sandbox's user namespace; it never mounts.
- New user namespaces: unshare(2) and clone(2) with CLONE_NEWUSER. A nested user
  namespace hands a command a full capability set again, and with it the kernel
  attack surface that user namespaces expose (user_namespaces(7)). Entering other
  namespaces, setns(2), is denied too, except with nstype CLONE_NEWPID: the agent
  uses that to make a fresh PID namespace per command (set its children's PID
  namespace back to its own, then unshare a new one); it needs CAP_SYS_ADMIN, which
  only the agent holds, and only ever names the caller's own PID namespace or one
  below it (setns(2)). clone3(2) fails with ENOSYS, because its
  flags sit in a struct that seccomp cannot read (seccomp(2): a filter sees the
  argument registers, not memory); glibc then falls back to clone(2), checked.
- Reaching into other processes: ptrace(2), process_vm_readv/writev(2),
  pidfd_getfd(2) (copies another process's file descriptors).
- Kernel surfaces that are a common road to a kernel exploit and that no build or
  test needs: bpf(2), perf_event_open(2), userfaultfd(2) (makes kernel races easy
  to win), io_uring (requests travel through a shared ring, not syscalls, so this
  filter never sees them: io_uring(7)), keyctl(2), add_key(2), request_key(2)
  (keyrings are not namespaced).
- Socket families a sandbox does not use. socket(2) and socketpair(2) are
  allowed only for AF_UNIX, AF_INET and AF_INET6; any other family fails with
  EAFNOSUPPORT, what a kernel built without it answers, so programs fall back.
  A stock kernel loads a module for a family on first use (AF_VSOCK's is not
  even network-namespaced), and netlink receive queues hold host memory that
  no memory cgroup counts, whatever the protocol: 1,500 NETLINK_USERSOCK
  sockets sending to themselves took 737 MiB of the host with the sandbox's
  cgroup at 5 of 128 MiB, and 50 NETLINK_ROUTE sockets queueing link dumps
  they never read took 480 MiB with it at 7 of 64 MiB. Without netlink a
  sandbox loses `ip`, ss's netlink path (it says "Cannot open netlink socket"
  and reads /proc instead), if_nameindex(3) and what is built on it (psutil's
  interfaces); glibc's getaddrinfo with AI_ADDRCONFIG assumes both IPv4 and
  IPv6 when it cannot ask. Node's os.networkInterfaces() throws: a shim that
  bastion preloads (inside/netif.js, through NODE_OPTIONS) answers with the
  loopback interface, the only one a sandbox has; it is a convenience, not a
  layer (a command that drops it gets node's error, never a socket).
  socketcall(2), i386's multiplexer, fails with ENOSYS: its arguments sit in
  memory, where no rule can read the family. A 32-bit program must use the
  direct calls (socket(2) on i386 since Linux 4.3); one whose libc only
  multiplexes (glibc built for older kernels) opens no socket here.
- fanotify_init(2): unprivileged since Linux 5.13, it would watch what the
  host and other sandboxes open in the folders they share read-only. inotify
  is left allowed (see below).
- Host administration, already refused to a process without capabilities in the
  initial user namespace, denied here too in case of a kernel bug: modules,
  kexec, reboot, swap, acct, setting clocks, quotas, port I/O (iopl, ioperm),
  syslog(2), file handles (open_by_handle_at(2) was the "shocker" container
  escape), vhangup, nfsservctl, uselib, lookup_dcookie.
- Setuid and setgid files. A workspace is a host folder, so a file made setuid
  or setgid in it stays so outside the sandbox, where anyone who can reach it
  runs it as the server's user or group. Every syscall that takes a mode refuses
  one with S_ISUID or S_ISGID: chmod, fchmod, fchmodat, fchmodat2, mkdir,
  mkdirat, mknod, mknodat, creat, and open and openat when their flags create a
  file (O_CREAT or O_TMPFILE; without them the kernel does not read the mode
  argument, which may hold anything, so it is not checked). mkdir(2) already
  drops both bits from its mode (a folder only inherits S_ISGID from its
  parent); it is refused anyway, so no kernel or file system that keeps them
  lets one through. openat2(2) fails with ENOSYS, as clone3 does: its mode sits
  in a struct; glibc and Python do not use it, and programs that do fall back to
  openat, checked. A program that asks for one of these modes gets EPERM, and
  the usual tools say so and exit non-zero (``chmod u+s``, ``install -m 4755``,
  ``mkdir -m 2775``, which then makes no folder at all, ``cp -p`` or ``tar -xpf``
  of a setuid file, Python's shutil.copy2); every other mode, the sticky bit
  included, works as before.
  These rules alone (`SETID_DENIED`) also hold a microVM's VMM (`_spawn.start_vmm`):
  QEMU's 9p server makes the workspace's files as the guest asks.
- File capabilities: setxattr, lsetxattr and fsetxattr fail with EOPNOTSUPP,
  for every attribute. Only ``security.capability`` matters, but the name sits
  in memory, which a filter cannot read. EOPNOTSUPP is what a file system
  without extended attributes answers, and what ``cp -a`` and shutil.copy2
  ignore and ``tar --xattrs`` only warns about (``cp --preserve=xattr`` fails).
  Reading, listing and removing attributes stay allowed.
- Inode attributes and device nodes. The kernel lets a file's owner set its
  ioctl_iflags(2) (no-dump, which backup tools honour; synchronous writes; no
  atime...), an fscrypt policy on an empty folder (the host could no longer
  make files in it) and fs-verity (read-only for ever), each file system's own
  attributes (ext4's inode generation, through EXT4_IOC_SETVERSION as well as
  FS_IOC_SETVERSION; btrfs subvolumes; F2FS pinning and compression), and lets
  anyone make a 0:0 character device (overlayfs's whiteout, also by renameat2's
  RENAME_WHITEOUT). A workspace's files, its folder included, are the host's, so
  the ioctls that set these (`INODE_ATTRIBUTE_IOCTLS`, by request number, bits
  above 32 masked as the kernel ignores them) and mknod of a character or block
  device fail with EPERM. Reading the flags (lsattr), FIFOs and sockets stay
  allowed; ``chattr`` fails.
- Syscalls newer than the installed libseccomp, with ENOSYS, as on an older
  kernel. libseccomp gives rules only to the syscalls its table names, so from
  the first number its table lacks (searched from 424, where every ABI here
  shares one numbering; 457 with Debian 12's libseccomp2 2.5.4-1+deb12u1) up to 1023, every number is
  refused by a few hand-written instructions in front of libseccomp's program
  (`_unknown_syscalls_prefix`: libseccomp has no range operator). That covers
  setxattrat (463), which could set ``security.capability``, and whatever
  mode-setting syscall the kernel adds next; the ones known to be dangerous
  (setxattrat, open_tree_attr) are in the table too, for a libseccomp that
  names them. Landlock's syscalls, which the
  agent makes under the filter, must lie below that range: a libseccomp too old
  to name them is refused.

A host workspace's commands get `HOST_WORKSPACE_DENIED`: all of the above, and
no write permission for other users. Its folder is an administrator's (often
root's), which other local users can reach, and its commands act as the
folder's owner on disk: a ``chmod 777`` of the workspace (``tar -xpf`` of an
archive whose ``./`` is 0777) let any local user rename the owner's files or
plant a setuid one. chmod, fchmod, fchmodat and fchmodat2 refuse a mode with
S_IWOTH (EPERM), and umask(2) with a mask lacking S_IWOTH is skipped (it returns
0, the mask stays), so the mask the sandbox starts with (`_spawn.start_sandbox`
adds S_IWOTH to it) holds for every file, folder, FIFO and socket made. A
shell's ``umask`` then prints 0000: it reads the mask with umask(0), which is
skipped too. So a script that saves the mask, tightens it (``umask 077``, allowed)
and puts the saved one back keeps the tighter one: what it makes afterwards is
private (found by review; seccomp cannot return the real mask, and skipping the
tightening too would leave a script's secrets readable). An agent sandbox's own
workspace keeps ``chmod 777``: no other user can reach it. Group write stays
allowed: where the folder's group has
members besides its owner, a command can still open it to them, and only the
next start refuses the folder (`workspace._refuse_open_to_others`).

The same rules hold for the 32-bit x86 ABI (``int 0x80``) on x86_64, so a 32-bit
syscall number cannot walk around them; any other ABI (x32, or a foreign
architecture) gets ENOSYS for every syscall, as on a kernel built without it.

What it is NOT: a boundary on its own. It is a deny-list on top of the
namespaces and the dropped capabilities that bubblewrap and the agent set up.
It does not confine file access (the mounts and Landlock do), nor the network
(the network namespace does), nor personality(2) (left allowed: its dangerous
flags are harmless with mmap_min_addr and no setuid binaries, and libseccomp
cannot express "any value except these"). It does not remove a bit that is
already there: a setuid file the host put in a workspace stays setuid, and a
folder made inside a setgid folder inherits S_ISGID from it (mkdir(2)). Nor
does it remove others' write permission a host workspace's files already have,
or that a default ACL the host set gives new ones (beneath a default ACL the
umask does not apply: acl(5)).

Nor does it hide activity in the folders sandboxes share with the host and
with each other (/usr, a template's environment): inotify(7) is allowed, and
a watch on such a folder reports the names of the files anyone opens or
reads there, the host and other sandboxes included, though not who opened
them nor anything else about the process. Refusing inotify_init would close
that and break every file watcher (node's fs.watch and chokidar, behind vite,
webpack and nodemon, report an error rather than poll).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import stat
import struct
from typing import Final, NamedTuple

from bastion.safety.errors import Unavailable

# Why ctypes and not a PyPI binding: libseccomp is the maintained C library that
# every distribution ships (Debian's libseccomp2, which systemd depends on); its
# official Python bindings come with distributions (python3-seccomp), not as a
# maintained wheel for 3.11, and `pyseccomp` (itself a ctypes shim) has had no
# release since 2021. Eight C functions do not justify a dependency.
LIBSECCOMP_SONAME: Final = "libseccomp.so.2"

# Constants from libseccomp's include/seccomp.h and linux/audit.h. libseccomp's
# architecture tokens (SCMP_ARCH_*) are the kernel's AUDIT_ARCH_* values.
SCMP_ACT_ALLOW: Final = 0x7FFF0000
SCMP_ACT_ERRNO_BASE: Final = 0x00050000
AUDIT_ARCH_X86_64: Final = 0xC000003E
AUDIT_ARCH_I386: Final = 0x40000003
AUDIT_ARCH_AARCH64: Final = 0xC00000B7
AUDIT_ARCH_RISCV64: Final = 0xC00000F3
SCMP_FLTATR_ACT_BADARCH: Final = 2
SCMP_CMP_MASKED_EQ: Final = 7
NR_SCMP_ERROR: Final = -1  # seccomp_syscall_resolve_name: a name libseccomp does not know

SCMP_CMP_NE: Final = 1
SCMP_CMP_GT: Final = 6
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
# open(2) flags: the same values on x86_64, i386, aarch64 and riscv64. O_TMPFILE is
# __O_TMPFILE | O_DIRECTORY, and O_DIRECTORY differs between them: only __O_TMPFILE is tested.
O_CREAT: Final = 0o100
O_TMPFILE_BIT: Final = 0o20000000

# The ABIs that get the rules, by the kernel's machine name, the native one first.
# Every other ABI gets ENOSYS (the filter's bad-architecture action). clone(2)
# takes its flags as argument 0 on each of these (not on s390), and the mode-taking
# syscalls take their mode and flags at the same positions on x86_64 and i386.
_ABIS: Final[dict[str, tuple[int, ...]]] = {
    "x86_64": (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386),
    "aarch64": (AUDIT_ARCH_AARCH64,),
    "riscv64": (AUDIT_ARCH_RISCV64,),
}


class Denial(NamedTuple):
    """One rule: `syscall` fails with `errno` when all its conditions hold (always, if it has none);
    `errno` 0 skips the call, which returns 0 (seccomp(2), SECCOMP_RET_ERRNO).

    Each ``(index, mask)`` of `args_have` holds when argument `index` has every bit of
    `mask`; `arg1_except`, if set, holds when argument 1 is anything but it; each of
    `args_equal` when the argument's masked bits are exactly a value; each ``(index, value)``
    of `args_above` when the argument, unsigned and all 64 bits of it on a 64-bit ABI, is above `value`.
    libseccomp ANDs the conditions of one rule and ORs rules with the same action.
    """

    syscall: str
    reason: str
    errno: int = errno.EPERM
    args_have: tuple[tuple[int, int], ...] = ()
    arg1_except: int = 0
    args_equal: tuple[tuple[int, int, int], ...] = ()
    """``(index, mask, value)``: holds when argument `index` ANDed with `mask` is `value`."""
    args_above: tuple[tuple[int, int], ...] = ()


_SETID_BITS: Final = (stat.S_ISUID, stat.S_ISGID)


def _refuse_mode_bits(
    syscall: str, mode_arg: int, bits: tuple[int, ...], reason: str, *, flags_arg: int | None = None
) -> tuple[Denial, ...]:
    """The rules that refuse `syscall` a mode (argument `mode_arg`) with any of `bits`.

    One rule per bit, since a rule's conditions are ANDed. With `flags_arg` (open,
    openat) only when the flags create a file, O_CREAT or O_TMPFILE: otherwise the
    kernel ignores the mode argument, and a caller may leave anything in it.
    """
    creating: tuple[tuple[tuple[int, int], ...], ...] = (
        ((),) if flags_arg is None else (((flags_arg, O_CREAT),), ((flags_arg, O_TMPFILE_BIT),))
    )
    return tuple(Denial(syscall, reason, args_have=(*when, (mode_arg, bit))) for when in creating for bit in bits)


def _refuse_setid_mode(syscall: str, mode_arg: int, *, flags_arg: int | None = None) -> tuple[Denial, ...]:
    """The rules that refuse `syscall` a mode (argument `mode_arg`) with S_ISUID or S_ISGID."""
    reason = "a setuid or setgid file in a workspace keeps its bit on the host"
    return _refuse_mode_bits(syscall, mode_arg, _SETID_BITS, reason, flags_arg=flags_arg)


# Setuid and setgid files (chmod(2), open(2), mknod(2), mkdir(2)); the mode's position per syscall.
SETID_DENIED: Final[tuple[Denial, ...]] = (
    *_refuse_setid_mode("chmod", 1),
    *_refuse_setid_mode("fchmod", 1),
    *_refuse_setid_mode("fchmodat", 2),
    *_refuse_setid_mode("fchmodat2", 2),
    *_refuse_setid_mode("mkdir", 1),
    *_refuse_setid_mode("mkdirat", 2),
    *_refuse_setid_mode("mknod", 1),
    *_refuse_setid_mode("mknodat", 2),
    *_refuse_setid_mode("creat", 1),
    *_refuse_setid_mode("open", 2, flags_arg=1),
    *_refuse_setid_mode("openat", 3, flags_arg=2),
    Denial("openat2", "its mode sits in a struct seccomp cannot read; ENOSYS makes libc use openat", errno.ENOSYS),
)


def _ioc(direction: int, kind: str, number: int, size: int) -> int:
    """An ioctl request number, as the kernel's _IOC macro (asm-generic/ioctl.h) makes it."""
    return direction << 30 | size << 16 | ord(kind) << 8 | number


_IOC_NONE: Final = 0
_IOC_WRITE: Final = 1
_IOC_READ: Final = 2
_BTRFS: Final = "\x94"  # BTRFS_IOCTL_MAGIC (linux/btrfs.h)
_F2FS: Final = "\xf5"  # F2FS_IOCTL_MAGIC (linux/f2fs.h)
# The ioctls that change what a file or folder is on disk, beyond its bytes, mode and owner
# (ioctl_iflags(2), fscrypt and fs-verity, and each file system's own forms of them): the kernel lets a
# file's owner (or anyone who may write it) make them, and a workspace's files, its folder included, are
# the host's. Both sizes of `long` where the request names one. The file systems' aliases of the generic
# numbers (EXT4_IOC_SETFLAGS, XFS_IOC_SETXFLAGS, XFS_IOC_FSSETXATTR, F2FS_IOC_SETFLAGS, btrfs's flags) are
# the same numbers; their set-ioctls that need a capability the sandbox lacks (EXT4_IOC_SETFSUUID,
# FS_IOC_SETFSLABEL, btrfs's labels, features and quotas) are left to the kernel; btrfs's properties
# are extended attributes (setxattr is refused).
INODE_ATTRIBUTE_IOCTLS: Final[dict[str, int]] = {
    "FS_IOC_SETFLAGS": _ioc(_IOC_WRITE, "f", 2, 8),
    "FS_IOC32_SETFLAGS": _ioc(_IOC_WRITE, "f", 2, 4),
    "FS_IOC_FSSETXATTR": _ioc(_IOC_WRITE, "X", 32, 28),
    "FS_IOC_SETVERSION": _ioc(_IOC_WRITE, "v", 2, 8),
    "FS_IOC32_SETVERSION": _ioc(_IOC_WRITE, "v", 2, 4),
    # ext4's own numbers for the inode's generation (fs/ext4/ext4.h), past FS_IOC_SETVERSION's rule.
    "EXT4_IOC_SETVERSION": _ioc(_IOC_WRITE, "f", 4, 8),
    "EXT4_IOC32_SETVERSION": _ioc(_IOC_WRITE, "f", 4, 4),
    # Sets EXT4_EXTENTS_FL for good: the inode's block map is rewritten as extents.
    "EXT4_IOC_MIGRATE": _ioc(_IOC_NONE, "f", 9, 0),
    "FS_IOC_SET_ENCRYPTION_POLICY": _ioc(_IOC_READ, "f", 19, 12),
    "FS_IOC_ADD_ENCRYPTION_KEY": _ioc(_IOC_READ | _IOC_WRITE, "f", 23, 80),
    "FS_IOC_ENABLE_VERITY": _ioc(_IOC_WRITE, "f", 133, 128),
    # btrfs: subvolumes made, snapshotted or removed, made read-only, given a received UUID. A
    # subvolume is left out of every snapshot of the folder holding it (a backup by btrfs snapshots).
    "BTRFS_IOC_SNAP_CREATE": _ioc(_IOC_WRITE, _BTRFS, 1, 4096),
    "BTRFS_IOC_SUBVOL_CREATE": _ioc(_IOC_WRITE, _BTRFS, 14, 4096),
    "BTRFS_IOC_SNAP_DESTROY": _ioc(_IOC_WRITE, _BTRFS, 15, 4096),
    "BTRFS_IOC_SNAP_CREATE_V2": _ioc(_IOC_WRITE, _BTRFS, 23, 4096),
    "BTRFS_IOC_SUBVOL_CREATE_V2": _ioc(_IOC_WRITE, _BTRFS, 24, 4096),
    "BTRFS_IOC_SUBVOL_SETFLAGS": _ioc(_IOC_WRITE, _BTRFS, 26, 8),
    "BTRFS_IOC_SET_RECEIVED_SUBVOL": _ioc(_IOC_READ | _IOC_WRITE, _BTRFS, 37, 200),
    "BTRFS_IOC_SET_RECEIVED_SUBVOL_32": _ioc(_IOC_READ | _IOC_WRITE, _BTRFS, 37, 192),
    "BTRFS_IOC_SNAP_DESTROY_V2": _ioc(_IOC_WRITE, _BTRFS, 63, 4096),
    # F2FS: a pinned file (its blocks never move), a compression setting, compressed blocks released
    # (the file is then read-only until they are reserved again).
    "F2FS_IOC_SET_PIN_FILE": _ioc(_IOC_WRITE, _F2FS, 13, 4),
    "F2FS_IOC_RELEASE_COMPRESS_BLOCKS": _ioc(_IOC_READ, _F2FS, 18, 8),
    "F2FS_IOC_SET_COMPRESS_OPTION": _ioc(_IOC_WRITE, _F2FS, 22, 2),
}
_IOCTL_REQUEST_BITS: Final = 0xFFFFFFFF
"""The kernel reads an ioctl's request as an unsigned int: bits above 32 are ignored, so they are masked."""
_FILE_TYPE_BITS: Final = 0o170000  # S_IFMT (Python's stat.S_IFMT is a function)
RENAME_WHITEOUT: Final = 1 << 2


def _refuse_ioctls(requests: dict[str, int]) -> tuple[Denial, ...]:
    return tuple(
        Denial("ioctl", f"{name} changes a host file's attributes", args_equal=((1, _IOCTL_REQUEST_BITS, value),))
        for name, value in requests.items()
    )


# The socket families a sandbox opens (address_families(7)): unix sockets (the agent, the egress proxy's
# socket), IPv4 and IPv6 (loopback, the egress forwarder). Every other family may load a kernel module on a
# stock kernel, and netlink's receive queues (NETLINK_ROUTE's dumps too) hold memory no memory cgroup counts.
AF_UNIX: Final = 1
AF_INET: Final = 2
AF_INET6: Final = 10
SOCKET_FAMILIES: Final = frozenset({AF_UNIX, AF_INET, AF_INET6})
_INT_BITS: Final = 0xFFFFFFFF


def _refuse_other_families(syscall: str) -> tuple[Denial, ...]:
    """socket(2) or socketpair(2) of a family outside `SOCKET_FAMILIES`.

    A rule holds one comparison per argument (libseccomp), so a family below the largest allowed
    gets a rule of its own; one more rule takes every number above it. That one compares all 64 bits
    on x86_64, where the kernel reads an int: a family with bits set above 32 is refused, never let
    through. EAFNOSUPPORT is what a kernel built without the family answers, so programs fall back
    (glibc's getaddrinfo, libaudit, ss).
    """
    reason = "a socket family the sandbox does not use: may load a kernel module, or queue uncounted memory"
    largest = max(SOCKET_FAMILIES)
    below = tuple(
        Denial(syscall, reason, errno.EAFNOSUPPORT, args_equal=((0, _INT_BITS, family),))
        for family in range(largest)
        if family not in SOCKET_FAMILIES
    )
    return (*below, Denial(syscall, reason, errno.EAFNOSUPPORT, args_above=((0, largest),)))


def _refuse_device_nodes(syscall: str, mode_arg: int) -> tuple[Denial, ...]:
    """mknod(2) of a character or block device: no capability is needed for 0:0, the overlayfs whiteout."""
    reason = "a device node (a 0:0 one is an overlayfs whiteout) in a workspace stays on the host"
    return tuple(
        Denial(syscall, reason, args_equal=((mode_arg, _FILE_TYPE_BITS, kind),))
        for kind in (stat.S_IFCHR, stat.S_IFBLK)
    )


DENIED: Final[tuple[Denial, ...]] = (
    # Mounts: the sandbox's file system view is bubblewrap's, final (mount(2), mount_setattr(2)).
    Denial("mount", "changes the sandbox's file system view"),
    Denial("umount", "32-bit x86 oldumount: changes the sandbox's file system view"),
    Denial("umount2", "could uncover what a mount hides"),
    Denial("pivot_root", "changes the root of the mount namespace"),
    Denial("open_tree", "new mount API: clones mount trees"),
    Denial("move_mount", "new mount API: attaches mounts"),
    Denial("fsopen", "new mount API: creates file system contexts"),
    Denial("fsconfig", "new mount API: configures file system contexts"),
    Denial("fsmount", "new mount API: creates mounts"),
    Denial("fspick", "new mount API: reconfigures mounted file systems"),
    Denial("mount_setattr", "new mount API: changes mount flags, e.g. read-only"),
    # Named for a libseccomp that knows it (newer than 2.5.4); until then the unknown-syscall range refuses it.
    Denial("open_tree_attr", "new mount API: clones mount trees and changes their flags"),
    # Namespaces (user_namespaces(7), setns(2)).
    Denial("unshare", "a nested user namespace returns every capability", args_have=((0, CLONE_NEWUSER),)),
    Denial("clone", "a nested user namespace returns every capability", args_have=((0, CLONE_NEWUSER),)),
    Denial("clone3", "flags sit in a struct seccomp cannot read; ENOSYS makes glibc use clone", errno.ENOSYS),
    Denial("setns", "enters another namespace", arg1_except=CLONE_NEWPID),
    # Other processes (ptrace(2), process_vm_readv(2), pidfd_getfd(2)).
    Denial("ptrace", "reads and rewrites other processes"),
    Denial("process_vm_readv", "reads other processes' memory"),
    Denial("process_vm_writev", "writes other processes' memory"),
    Denial("pidfd_getfd", "steals other processes' file descriptors"),
    # Kernel attack surface no command needs.
    Denial("bpf", "loads programs into the kernel"),
    Denial("perf_event_open", "large kernel surface; side channels"),
    Denial("userfaultfd", "makes kernel race conditions easy to win"),
    Denial("io_uring_setup", "io_uring operations run without passing seccomp"),
    Denial("io_uring_enter", "io_uring operations run without passing seccomp"),
    Denial("io_uring_register", "io_uring operations run without passing seccomp"),
    # fs.aio-max-nr is one count for the whole host, limited by no namespace or cgroup: one sandbox's
    # contexts refused io_setup to every other and to the host. ENOSYS: libaio's users fall back to threads.
    Denial("io_setup", "Linux AIO contexts count against one host-wide limit", errno.ENOSYS),
    # Sockets: the families a sandbox uses; netlink refused (address_families(7)).
    *_refuse_other_families("socket"),
    *_refuse_other_families("socketpair"),
    # libseccomp also turns the socket rules into socketcall rules for i386; this one refuses every call.
    Denial("socketcall", "i386's multiplexer: socket's family sits in memory, where no rule reads it", errno.ENOSYS),
    # Unprivileged since Linux 5.13; watches what the host and other sandboxes open in shared folders.
    Denial("fanotify_init", "watches the host's and other sandboxes' file access in shared folders"),
    Denial("keyctl", "kernel keyrings are not namespaced"),
    Denial("add_key", "kernel keyrings are not namespaced"),
    Denial("request_key", "kernel keyrings are not namespaced; may call a host helper"),
    # Host administration: needs capabilities the sandbox lacks; denied in case of a kernel bug.
    Denial("init_module", "loads kernel modules"),
    Denial("finit_module", "loads kernel modules"),
    Denial("delete_module", "unloads kernel modules"),
    Denial("kexec_load", "replaces the running kernel"),
    Denial("kexec_file_load", "replaces the running kernel"),
    Denial("reboot", "reboots the host"),
    Denial("swapon", "changes the host's swap"),
    Denial("swapoff", "changes the host's swap"),
    Denial("acct", "switches process accounting"),
    Denial("settimeofday", "sets the host clock"),
    Denial("clock_settime", "sets the host clock"),
    Denial("clock_adjtime", "adjusts the host clock"),
    Denial("adjtimex", "adjusts the host clock"),
    Denial("open_by_handle_at", "opens files by handle, past any mount: the 'shocker' escape"),
    Denial("name_to_handle_at", "makes file handles for open_by_handle_at"),
    Denial("iopl", "raw port I/O"),
    Denial("ioperm", "raw port I/O"),
    Denial("quotactl", "changes disk quotas"),
    Denial("quotactl_fd", "changes disk quotas"),
    Denial("lookup_dcookie", "reveals host paths (removed in Linux 6.8)"),
    Denial("syslog", "reads or clears the kernel log"),
    Denial("vhangup", "hangs up the terminal"),
    Denial("nfsservctl", "NFS server control (removed in Linux 3.1)"),
    Denial("uselib", "obsolete a.out loader"),
    *SETID_DENIED,
    # File capabilities: the attribute's name is in memory, so every setxattr is refused (xattr(7)).
    Denial("setxattr", "could set security.capability; the name is in memory", errno.EOPNOTSUPP),
    Denial("lsetxattr", "could set security.capability; the name is in memory", errno.EOPNOTSUPP),
    Denial("fsetxattr", "could set security.capability; the name is in memory", errno.EOPNOTSUPP),
    # Named for a libseccomp that knows it (newer than 2.5.4); until then the unknown-syscall range refuses it.
    Denial("setxattrat", "could set security.capability; the name is in memory", errno.EOPNOTSUPP),
    # Lasting marks on host files (no-dump, sync, encryption policies, verity) and device nodes.
    *_refuse_ioctls(INODE_ATTRIBUTE_IOCTLS),
    *_refuse_device_nodes("mknod", 1),
    *_refuse_device_nodes("mknodat", 2),
    Denial("renameat2", "RENAME_WHITEOUT leaves a 0:0 device node", args_have=((4, RENAME_WHITEOUT),)),
)

_OTHERS_WRITE_REASON: Final = "other local users could then rename, replace or plant files in the host's folder"

# A host workspace's filter: `DENIED`, and no write permission for others (chmod(2), umask(2)).
HOST_WORKSPACE_DENIED: Final[tuple[Denial, ...]] = (
    *DENIED,
    *_refuse_mode_bits("chmod", 1, (stat.S_IWOTH,), _OTHERS_WRITE_REASON),
    *_refuse_mode_bits("fchmod", 1, (stat.S_IWOTH,), _OTHERS_WRITE_REASON),
    *_refuse_mode_bits("fchmodat", 2, (stat.S_IWOTH,), _OTHERS_WRITE_REASON),
    *_refuse_mode_bits("fchmodat2", 2, (stat.S_IWOTH,), _OTHERS_WRITE_REASON),
    # Skipped, not refused: shells and libc read the mask with umask(0) and put it back, and must not fail.
    Denial(
        "umask",
        "a mask without S_IWOTH lets new files be others' to write",
        errno=0,
        args_equal=((0, stat.S_IWOTH, 0),),
    ),
)

# Syscalls the sandbox itself makes (the agent applies Landlock after the filter
# is loaded) among the numbers the unknown-syscall range could cover: a
# libseccomp too old to name them cannot build this filter.
_NEEDED_NEWER_SYSCALLS: Final = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self")


class _ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp (seccomp_rule_add(3))."""

    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


class _LibSeccomp:
    """The few libseccomp functions used, with their C signatures declared.

    seccomp_rule_add_array(3) is used instead of the variadic seccomp_rule_add:
    ctypes cannot describe a variadic call portably (aarch64 passes variadic
    arguments differently), and the array form takes the same structs.
    """

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(LIBSECCOMP_SONAME)
        except OSError as exc:
            raise Unavailable(
                f"{LIBSECCOMP_SONAME} cannot be loaded: run 'apt-get install libseccomp2'", detail=str(exc)
            ) from exc
        self._init = lib.seccomp_init
        self._init.argtypes = (ctypes.c_uint32,)
        self._init.restype = ctypes.c_void_p
        self._release = lib.seccomp_release
        self._release.argtypes = (ctypes.c_void_p,)
        self._release.restype = None
        self._arch_add = lib.seccomp_arch_add
        self._arch_add.argtypes = (ctypes.c_void_p, ctypes.c_uint32)
        self._arch_add.restype = ctypes.c_int
        self._attr_set = lib.seccomp_attr_set
        self._attr_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)
        self._attr_set.restype = ctypes.c_int
        self._resolve = lib.seccomp_syscall_resolve_name
        self._resolve.argtypes = (ctypes.c_char_p,)
        self._resolve.restype = ctypes.c_int
        self._resolve_num_arch = lib.seccomp_syscall_resolve_num_arch
        self._resolve_num_arch.argtypes = (ctypes.c_uint32, ctypes.c_int)
        self._resolve_num_arch.restype = ctypes.c_void_p  # a char * the caller frees
        self._free = ctypes.CDLL(None).free
        self._free.argtypes = (ctypes.c_void_p,)
        self._free.restype = None
        self._rule_add_array = lib.seccomp_rule_add_array
        self._rule_add_array.argtypes = (
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        )
        self._rule_add_array.restype = ctypes.c_int
        self._export_bpf = lib.seccomp_export_bpf
        self._export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
        self._export_bpf.restype = ctypes.c_int

    def init(self, default_action: int) -> int:
        ctx: int | None = self._init(default_action)
        if not ctx:
            raise Unavailable("libseccomp could not create a filter: check memory and the libseccomp2 install")
        return ctx

    def release(self, ctx: int) -> None:
        self._release(ctx)

    def arch_add(self, ctx: int, arch: int) -> int:
        rc: int = self._arch_add(ctx, arch)
        return rc

    def attr_set(self, ctx: int, attr: int, value: int) -> int:
        rc: int = self._attr_set(ctx, attr, value)
        return rc

    def resolve(self, name: str) -> int:
        nr: int = self._resolve(name.encode("ascii"))
        return nr

    def knows(self, arch: int, nr: int) -> bool:
        """Whether libseccomp's table names syscall `nr` of ABI `arch`."""
        name: int | None = self._resolve_num_arch(arch, nr)
        if not name:
            return False
        self._free(name)
        return True

    def rule_add(self, ctx: int, action: int, nr: int, cmps: tuple[_ArgCmp, ...]) -> int:
        array = (_ArgCmp * len(cmps))(*cmps)
        rc: int = self._rule_add_array(ctx, action, nr, len(cmps), array)
        return rc

    def export_bpf(self, ctx: int, fd: int) -> int:
        rc: int = self._export_bpf(ctx, fd)
        return rc


def _errno_action(code: int) -> int:
    return SCMP_ACT_ERRNO_BASE | (code & 0xFFFF)


def _check(rc: int, what: str) -> None:
    # libseccomp returns a negated errno.
    if rc < 0:
        raise Unavailable(f"libseccomp failed to {what}: {os.strerror(-rc)}: install libseccomp2 2.5 or later")


def _add_denial(lib: _LibSeccomp, ctx: int, denial: Denial) -> None:
    nr = lib.resolve(denial.syscall)
    if nr == NR_SCMP_ERROR:
        # A name this libseccomp does not know: newer than its syscall table, so in
        # the range `_unknown_syscalls_prefix` refuses.
        return
    cmps = tuple(_ArgCmp(index, SCMP_CMP_MASKED_EQ, mask, mask) for index, mask in denial.args_have)
    cmps += tuple(_ArgCmp(index, SCMP_CMP_MASKED_EQ, mask, value) for index, mask, value in denial.args_equal)
    if denial.arg1_except:
        cmps += (_ArgCmp(1, SCMP_CMP_NE, denial.arg1_except, 0),)
    cmps += tuple(_ArgCmp(index, SCMP_CMP_GT, value, 0) for index, value in denial.args_above)
    rc = lib.rule_add(ctx, _errno_action(denial.errno), nr, cmps)
    # A negative `nr` other than NR_SCMP_ERROR is libseccomp's pseudo-number for
    # a syscall the native ABI lacks (umount on x86_64); libseccomp translates
    # it per ABI, and may refuse it when no ABI in the filter has the syscall.
    if nr < 0 and rc < 0:
        return
    _check(rc, f"add the rule for {denial.syscall}")


# The unknown-syscall range. From 424 on, every ABI here (x86_64, i386, aarch64,
# riscv64) numbers syscalls alike (the kernel's unified numbering, Linux 5.1); below
# it each has its own table with gaps (x86_64 uses none of 335-423). 1024 is below
# every ABI-private range (x32's 0x40000000 bit, ARM's 0x0f0000).
UNIFIED_SYSCALLS_START: Final = 424
SYSCALL_RANGE_END: Final = 1024

# Classic BPF (linux/filter.h, linux/seccomp.h, linux/bpf_common.h).
BPF_LD_W_ABS: Final = 0x20  # A = 32-bit word at seccomp_data + k
BPF_JEQ_K: Final = 0x15  # if A == k skip jt instructions, else skip jf
BPF_JGE_K: Final = 0x35  # if A >= k (unsigned) skip jt, else skip jf
BPF_RET_K: Final = 0x06  # return k
SECCOMP_DATA_NR: Final = 0
SECCOMP_DATA_ARCH: Final = 4
SECCOMP_RET_ERRNO: Final = 0x00050000
BPF_MAXINSNS: Final = 4096


def _first_unknown_syscall(lib: _LibSeccomp, abis: tuple[int, ...]) -> int:
    """The first number from 424 on that libseccomp's table lacks for one of `abis`.

    libseccomp's tables follow the kernel's, which fills the unified numbering
    without gaps; were there one, the prefix would refuse the syscalls above it
    too, with ENOSYS: closed, not open.
    """
    nr = UNIFIED_SYSCALLS_START
    while nr < SYSCALL_RANGE_END and all(lib.knows(abi, nr) for abi in abis):
        nr += 1
    return nr


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    """One struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}, native byte order."""
    return struct.pack("HBBI", code, jt, jf, k)


def _unknown_syscalls_prefix(abis: tuple[int, ...], first_unknown: int) -> bytes:
    """Classic BPF run before libseccomp's program: ENOSYS for first_unknown <= nr < 1024 on `abis`.

    Hand-written because libseccomp has no range operator: it gives rules only to
    syscalls its table names (seccomp_rule_add refuses any other number), so a
    syscall added to the kernel after it was built would be allowed. Every path
    either returns ENOSYS or falls off the end into the instruction after the
    prefix, libseccomp's first (which loads the arch itself), so the concatenation
    is a valid program; jumps are relative and forward. Comparisons are unsigned:
    an x32 number (0x40000000 set) or -1 is above 1024 and goes to libseccomp's
    program, which refuses x32 as a foreign ABI. With abis = (A0, A1):

        0  ld  [arch]
        1  jeq #A0, jt 1 (to 3), jf 0 (to 2)
        2  jeq #A1, jt 0 (to 3), jf 4 (to 7)
        3  ld  [nr]
        4  jge #first_unknown, jt 0 (to 5), jf 2 (to 7)
        5  jge #1024, jt 1 (to 7), jf 0 (to 6)
        6  ret #ERRNO(ENOSYS)
        7  libseccomp's program
    """
    last = len(abis) - 1
    load_nr = 1 + len(abis)  # where the arch tests send a listed ABI; libseccomp's program is 4 further
    program = [_insn(BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_ARCH)]
    for i, abi in enumerate(abis):
        here = 1 + i
        program.append(_insn(BPF_JEQ_K, load_nr - here - 1, 0 if i < last else 4, abi))
    program += [
        _insn(BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_NR),
        _insn(BPF_JGE_K, 0, 2, first_unknown),
        _insn(BPF_JGE_K, 1, 0, SYSCALL_RANGE_END),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),
    ]
    return b"".join(program)


def _check_needed_syscalls_reachable(lib: _LibSeccomp, first_unknown: int) -> None:
    for name in _NEEDED_NEWER_SYSCALLS:
        nr = lib.resolve(name)
        if not 0 <= nr < first_unknown:
            raise Unavailable(
                f"libseccomp's syscall table ends before {name}, which every sandbox needs (Landlock): "
                "install libseccomp2 2.5.2 or later"
            )


@functools.cache  # the program is the same every time: compile it once per process
def build_filter(denied: tuple[Denial, ...] = DENIED) -> bytes:
    """Compile a deny-list (the sandbox's, `DENIED`, by default) to classic BPF for ``bwrap --seccomp``.

    Returns:
        The filter program: an array of struct sock_filter in native byte order.

    Raises:
        Unavailable: libseccomp is missing, too old to name Landlock's syscalls,
            or refused a rule, or the machine's architecture is not one this
            filter was written for.
    """
    machine = os.uname().machine
    abis = _ABIS.get(machine)
    if abis is None:
        raise Unavailable(f"no seccomp filter for architecture {machine}: run bastion on x86_64 or aarch64")
    lib = _LibSeccomp()
    first_unknown = _first_unknown_syscall(lib, abis)
    _check_needed_syscalls_reachable(lib, first_unknown)
    prefix = _unknown_syscalls_prefix(abis, first_unknown)
    ctx = lib.init(SCMP_ACT_ALLOW)
    try:
        for arch in abis[1:]:
            _check(lib.arch_add(ctx, arch), "add the 32-bit x86 ABI")
        _check(lib.attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, _errno_action(errno.ENOSYS)), "set the foreign ABI action")
        for denial in denied:
            _add_denial(lib, ctx, denial)
        out = os.memfd_create("bastion-seccomp-export", os.MFD_CLOEXEC)
        try:
            _check(lib.export_bpf(ctx, out), "export the filter")
            size = os.lseek(out, 0, os.SEEK_END)
            program = prefix + os.pread(out, size, 0)
        finally:
            os.close(out)
    finally:
        lib.release(ctx)
    if len(program) // 8 > BPF_MAXINSNS:
        raise Unavailable(f"the seccomp filter has {len(program) // 8} instructions, more than the kernel's 4096")
    return program


def write_filter_fd(denied: tuple[Denial, ...] = DENIED) -> int:
    """A sealed memfd holding the compiled filter of `denied`, positioned at 0.

    The fd is close-on-exec (not inheritable); pass it to bubblewrap with
    ``pass_fds=(fd,)`` and ``--seccomp <fd>``, then close it in the parent.
    Sealing makes the program immutable, so nothing holding the fd can swap
    the filter between now and bubblewrap reading it.

    Returns:
        The file descriptor, owned by the caller.

    Raises:
        Unavailable: as for `build_filter`.
    """
    program = build_filter(denied)
    fd = os.memfd_create("bastion-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(program)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
