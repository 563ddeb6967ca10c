"""The sandbox's seccomp filter, compiled with libseccomp. DANGEROUS.

A change to the table below changes what every sandboxed process may ask of the
kernel: review it as a security change. This module only compiles the filter to
classic BPF; bubblewrap loads it (``bwrap --seccomp FD``) just before it execs the
agent, so the agent and every command it starts run under it, and no process in
the sandbox can remove it (seccomp(2): filters are inherited and only ever added).

What it denies, with EPERM (EPERM rather than a kill: programs that probe a
feature then degrade, and the refusal reaches the client as a plain error):

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
- Host administration, already refused to a process without capabilities in the
  initial user namespace, denied here too in case of a kernel bug: modules,
  kexec, reboot, swap, acct, setting clocks, quotas, port I/O (iopl, ioperm),
  syslog(2), file handles (open_by_handle_at(2) was the "shocker" container
  escape), vhangup, nfsservctl, uselib, lookup_dcookie.

The same rules hold for the 32-bit x86 ABI (``int 0x80``) on x86_64, so a 32-bit
syscall number cannot walk around them; any other ABI (x32, or a foreign
architecture) gets ENOSYS for every syscall, as on a kernel built without it.

What it is NOT: a boundary on its own. It is a deny-list on top of the
namespaces and the dropped capabilities that bubblewrap and the agent set up; a
syscall newer than the installed libseccomp cannot be named here and is allowed.
It does not confine file access (the mounts and Landlock do), nor the network
(the network namespace does), nor personality(2) (left allowed: its dangerous
flags are harmless with mmap_min_addr and no setuid binaries, and libseccomp
cannot express "any value except these").
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
from typing import Final, NamedTuple

from bastion.safety.errors import Unavailable

# Why ctypes and not a PyPI binding: libseccomp is the maintained C library that
# every distribution ships (Debian's libseccomp2, which systemd depends on); its
# official Python bindings come with distributions (python3-seccomp), not as a
# maintained wheel for 3.11, and `pyseccomp` (itself a ctypes shim) has had no
# release since 2021. Seven C functions do not justify a dependency.
LIBSECCOMP_SONAME: Final = "libseccomp.so.2"

# Constants from libseccomp's include/seccomp.h and linux/audit.h.
SCMP_ACT_ALLOW: Final = 0x7FFF0000
SCMP_ACT_ERRNO_BASE: Final = 0x00050000
SCMP_ARCH_X86: Final = 0x40000003
SCMP_FLTATR_ACT_BADARCH: Final = 2
SCMP_CMP_MASKED_EQ: Final = 7
NR_SCMP_ERROR: Final = -1  # seccomp_syscall_resolve_name: a name libseccomp does not know

SCMP_CMP_NE: Final = 1
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000

# Extra ABIs that get the same rules as the native one, by the kernel's machine
# name. Every other ABI gets ENOSYS (the filter's bad-architecture action).
# clone(2) takes its flags as argument 0 on each of these (not on s390).
_EXTRA_ARCHES: Final[dict[str, tuple[int, ...]]] = {
    "x86_64": (SCMP_ARCH_X86,),
    "aarch64": (),
    "riscv64": (),
}


class Denial(NamedTuple):
    """One rule: `syscall` fails with `errno`; only when argument 0 has every bit of
    `arg0_has`, if that is set; only when argument 1 is not `arg1_except`, if that is set."""

    syscall: str
    reason: str
    errno: int = errno.EPERM
    arg0_has: int = 0
    arg1_except: int = 0


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
    # Namespaces (user_namespaces(7), setns(2)).
    Denial("unshare", "a nested user namespace returns every capability", arg0_has=CLONE_NEWUSER),
    Denial("clone", "a nested user namespace returns every capability", arg0_has=CLONE_NEWUSER),
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
)


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
        # A name this libseccomp does not know: newer than its syscall table.
        return
    cmps: tuple[_ArgCmp, ...] = ()
    if denial.arg0_has:
        cmps += (_ArgCmp(0, SCMP_CMP_MASKED_EQ, denial.arg0_has, denial.arg0_has),)
    if denial.arg1_except:
        cmps += (_ArgCmp(1, SCMP_CMP_NE, denial.arg1_except, 0),)
    rc = lib.rule_add(ctx, _errno_action(denial.errno), nr, cmps)
    # A negative `nr` other than NR_SCMP_ERROR is libseccomp's pseudo-number for
    # a syscall the native ABI lacks (umount on x86_64); libseccomp translates
    # it per ABI, and may refuse it when no ABI in the filter has the syscall.
    if nr < 0 and rc < 0:
        return
    _check(rc, f"add the rule for {denial.syscall}")


@functools.cache  # the program is the same every time: compile it once per process
def build_filter() -> bytes:
    """Compile the deny-list to classic BPF for ``bwrap --seccomp``.

    Returns:
        The filter program: an array of struct sock_filter in native byte order.

    Raises:
        Unavailable: libseccomp is missing or refused a rule, or the machine's
            architecture is not one this filter was written for.
    """
    machine = os.uname().machine
    extra_arches = _EXTRA_ARCHES.get(machine)
    if extra_arches is None:
        raise Unavailable(f"no seccomp filter for architecture {machine}: run bastion on x86_64 or aarch64")
    lib = _LibSeccomp()
    ctx = lib.init(SCMP_ACT_ALLOW)
    try:
        for arch in extra_arches:
            _check(lib.arch_add(ctx, arch), "add the 32-bit x86 ABI")
        _check(lib.attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, _errno_action(errno.ENOSYS)), "set the foreign ABI action")
        for denial in DENIED:
            _add_denial(lib, ctx, denial)
        out = os.memfd_create("bastion-seccomp-export", os.MFD_CLOEXEC)
        try:
            _check(lib.export_bpf(ctx, out), "export the filter")
            size = os.lseek(out, 0, os.SEEK_END)
            return os.pread(out, size, 0)
        finally:
            os.close(out)
    finally:
        lib.release(ctx)


def write_filter_fd() -> int:
    """A sealed memfd holding the compiled filter, positioned at 0.

    The fd is close-on-exec (not inheritable); pass it to bubblewrap with
    ``pass_fds=(fd,)`` and ``--seccomp <fd>``, then close it in the parent.
    Sealing makes the program immutable, so nothing holding the fd can swap
    the filter between now and bubblewrap reading it.

    Returns:
        The file descriptor, owned by the caller.

    Raises:
        Unavailable: as for `build_filter`.
    """
    program = build_filter()
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
