"""Landlock self-restriction for the sandbox agent. DANGEROUS: raw syscalls through _ctypes.

A security layer under bubblewrap, not instead of it. bwrap decides what the
mount namespace shows; Landlock decides what may be changed there. Inside the
sandbox the agent owns what bwrap made for it (its uid is the sandbox's) and could
write any tmpfs or writable bind there; after `restrict()`, it and every process it later
starts (the domain is inherited across fork and execve, and cannot be left) may:

- read, list and execute anything beneath "/" (``read_all=True``, the default);
- create, write, truncate, rename, link and remove only beneath ``write_dirs``
  and /dev/shm;
- write (and, from ABI 5, ioctl) only the character devices programs need:
  /dev/null, /dev/zero, /dev/full, /dev/tty, /dev/random, /dev/urandom, /dev/pts;
- from ABI 6, signal only processes in its own or a nested domain, and connect
  only to abstract unix sockets made inside it.

Not restricted: TCP (left unhandled: the sandbox has its own empty network
namespace), fds received or inherited (pipes, sockets), named unix socket
connect, chroot. Landlock also forbids mount, umount and pivot_root once a
filesystem ruleset is in force: do those before calling `restrict()`.

It degrades on older kernels, never silently: the result's ``warning`` names what
the running kernel cannot enforce (ABI 0: nothing at all). Kernel reference:
https://docs.kernel.org/userspace-api/landlock.html

This file runs inside the sandbox with its source prepended to the agent's:
standard library only, Python 3.9 syntax, no ``from __future__`` import, no
``X | Y`` in evaluated annotations, and every private name prefixed ``_landlock``
so that it cannot collide with the agent's. Its public C types and `Libc` serve the agent too.
"""

# The C modules under ctypes, os and stat, not those packages: this file runs at every sandbox
# start, where their Python (with struct, types, abc, posixpath...) cost about 6 ms of about 30.
import _ctypes
import _stat
import posix

# mypy takes MYPY as true, as it does TYPE_CHECKING, which the agent (this file's sequel) binds.
MYPY = False
if MYPY:
    _landlock_IntData = _ctypes._SimpleCData[int]
    _landlock_PointerData = _ctypes._SimpleCData[int | None]
else:
    _landlock_IntData = _landlock_PointerData = _ctypes._SimpleCData


# ctypes' own definitions of the types used here (the codes are struct's; Linux, LP64).
class c_int(_landlock_IntData):
    _type_ = "i"


class c_uint32(_landlock_IntData):
    _type_ = "I"


class c_long(_landlock_IntData):
    _type_ = "l"


class c_ulong(_landlock_IntData):
    _type_ = "L"


class c_uint64(_landlock_IntData):
    _type_ = "Q"


class c_void_p(_landlock_PointerData):
    _type_ = "P"


c_int32 = c_int
byref = _ctypes.byref
get_errno = _ctypes.get_errno


class Libc:
    """What `ctypes.CDLL(None, use_errno=True)` gives: the process's C library, each function found
    by name at first use and returning a C int unless given a `restype`; errno kept for `get_errno`."""

    def __init__(self) -> None:
        # CFuncPtr((name, library)) looks the name up in library._handle.
        self._handle = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)  # type: ignore[arg-type]  # None: the process

    def function(self, name: str, restype: "type[_ctypes._SimpleCData[int]]" = c_int) -> "_ctypes.CFuncPtr":
        class Function(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = restype

        return Function((name, self))  # type: ignore[arg-type]  # a CDLL, as far as it looks (_handle)

    def __getattr__(self, name: str) -> "_ctypes.CFuncPtr":
        found = self.function(name)
        setattr(self, name, found)
        return found


# Syscall numbers: the same on x86_64 and aarch64 (asm-generic numbering since 5.13).
_landlock_CREATE_RULESET, _landlock_ADD_RULE, _landlock_RESTRICT_SELF = 0, 1, 2
_landlock_SYSCALLS = {
    "x86_64": (444, 445, 446),
    "aarch64": (444, 445, 446),
}

LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1

LANDLOCK_ACCESS_FS_EXECUTE = 1 << 0
LANDLOCK_ACCESS_FS_WRITE_FILE = 1 << 1
LANDLOCK_ACCESS_FS_READ_FILE = 1 << 2
LANDLOCK_ACCESS_FS_READ_DIR = 1 << 3
LANDLOCK_ACCESS_FS_REMOVE_DIR = 1 << 4
LANDLOCK_ACCESS_FS_REMOVE_FILE = 1 << 5
LANDLOCK_ACCESS_FS_MAKE_CHAR = 1 << 6
LANDLOCK_ACCESS_FS_MAKE_DIR = 1 << 7
LANDLOCK_ACCESS_FS_MAKE_REG = 1 << 8
LANDLOCK_ACCESS_FS_MAKE_SOCK = 1 << 9
LANDLOCK_ACCESS_FS_MAKE_FIFO = 1 << 10
LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11
LANDLOCK_ACCESS_FS_MAKE_SYM = 1 << 12
LANDLOCK_ACCESS_FS_REFER = 1 << 13  # ABI 2
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
LANDLOCK_ACCESS_FS_IOCTL_DEV = 1 << 15  # ABI 5

LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
LANDLOCK_SCOPE_SIGNAL = 1 << 1  # ABI 6

_landlock_PR_SET_NO_NEW_PRIVS = 38

_landlock_FS_ABI1 = (1 << 13) - 1
_landlock_READ = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR
# The only rights the kernel accepts on a rule whose fd is not a directory (EINVAL otherwise).
_landlock_FILE_ONLY = (
    LANDLOCK_ACCESS_FS_EXECUTE
    | LANDLOCK_ACCESS_FS_WRITE_FILE
    | LANDLOCK_ACCESS_FS_READ_FILE
    | LANDLOCK_ACCESS_FS_TRUNCATE
    | LANDLOCK_ACCESS_FS_IOCTL_DEV
)
_landlock_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/random", "/dev/urandom", "/dev/pts")
_landlock_DEV_SHM = "/dev/shm"  # noqa: S108 - in the sandbox's own /dev (a root server's folder, else bwrap --dev)
# Read beneath only these (plus write_dirs and devices) when read_all is False.
_landlock_SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc", "/proc", "/dev")

_landlock_libc = Libc()
_landlock_syscall_function = _landlock_libc.function("syscall", c_long)


class _landlock_RulesetAttr(_ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", c_uint64),
        ("handled_access_net", c_uint64),
        ("scoped", c_uint64),
    )


class _landlock_PathBeneathAttr(_ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in <linux/landlock.h>: 12 bytes
    _fields_ = (("allowed_access", c_uint64), ("parent_fd", c_int32))


def _landlock_syscall(index: int, *args: object) -> int:
    # syscall(2) is variadic: ctypes would pass a bare int as a 32-bit C int, so widen them.
    number = _landlock_SYSCALLS[posix.uname().machine][index]
    wide = [c_long(a) if isinstance(a, int) else a for a in args]
    return int(_landlock_syscall_function(c_long(number), *wide))


def landlock_abi() -> int:
    """The Landlock ABI version the running kernel offers.

    Returns:
        The version (1 and up), or 0 when Landlock is missing, disabled at boot,
        or this machine's syscall numbers are unknown here.
    """
    if posix.uname().machine not in _landlock_SYSCALLS:
        return 0
    abi = _landlock_syscall(
        _landlock_CREATE_RULESET,
        c_void_p(None),
        0,
        LANDLOCK_CREATE_RULESET_VERSION,
    )
    return max(abi, 0)


def _landlock_fs_rights(abi: int) -> int:
    rights = _landlock_FS_ABI1
    if abi >= 2:
        rights |= LANDLOCK_ACCESS_FS_REFER
    if abi >= 3:
        rights |= LANDLOCK_ACCESS_FS_TRUNCATE
    if abi >= 5:
        rights |= LANDLOCK_ACCESS_FS_IOCTL_DEV
    return rights


def landlock_missing(abi: int) -> list[str]:
    missing: list[str] = []
    if abi < 2:
        missing.append("renames and links across directories are always refused (ABI 2 adds refer)")
    if abi < 3:
        missing.append("truncate is not restricted (ABI 3)")
    if abi < 5:
        missing.append("device ioctls are not restricted (ABI 5)")
    if abi < 6:
        missing.append("signals and abstract unix sockets are not scoped (ABI 6)")
    return missing


def _landlock_add_path(ruleset_fd: int, path: str, allowed: int) -> None:
    try:
        fd = posix.open(path, posix.O_PATH | posix.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not _stat.S_ISDIR(posix.fstat(fd).st_mode):
            allowed &= _landlock_FILE_ONLY
        attr = _landlock_PathBeneathAttr(allowed, fd)
        rc = _landlock_syscall(_landlock_ADD_RULE, ruleset_fd, LANDLOCK_RULE_PATH_BENEATH, byref(attr), 0)
        if rc != 0:
            err = get_errno()
            raise OSError(err, f"landlock_add_rule({path!r}) failed: {posix.strerror(err)}")
    finally:
        posix.close(fd)


def restrict(write_dirs: list[str], *, read_all: bool = True) -> dict[str, object]:
    """Landlock the calling thread, and every process it starts from now on, for good.

    Call it while the process has a single thread, before it starts any command:
    Landlock binds the calling thread only, and children inherit its domain.
    Also sets no_new_privs, which children inherit too.

    Args:
        write_dirs: directories beneath which every write-type right is allowed,
            e.g. ``["/workspace", "/tmp"]``; those that do not exist are skipped.
        read_all: allow read and execute beneath "/" (everything bwrap chose to
            show); if False, only beneath the system folders, /proc, /dev and
            ``write_dirs``.

    Returns:
        ``{"abi": int, "applied": bool, "scoped": bool, "warning": str | None}``:
        ``applied`` is False only when the kernel has no Landlock (ABI 0), and then
        ``warning`` says so; ``warning`` also names what an older ABI cannot enforce.
        The caller must log any warning.

    Raises:
        OSError: the kernel offers Landlock but the ruleset could not be built or
            enforced; the caller must not go on unconfined.
    """
    abi = landlock_abi()
    if abi == 0:
        machine = posix.uname().machine
        why = "unknown machine " + machine if machine not in _landlock_SYSCALLS else "kernel has no Landlock"
        unapplied = f"landlock: not applied ({why}): only the bubblewrap namespaces confine this sandbox"
        return {"abi": 0, "applied": False, "scoped": False, "warning": unapplied}

    handled = _landlock_fs_rights(abi)
    scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0
    # The attr grew per ABI (fs; + net at 4; + scoped at 6); pass the size this kernel knows.
    attr = _landlock_RulesetAttr(handled, 0, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset_fd = _landlock_syscall(_landlock_CREATE_RULESET, byref(attr), size, 0)
    if ruleset_fd < 0:
        err = get_errno()
        raise OSError(err, f"landlock_create_ruleset failed: {posix.strerror(err)}")
    try:
        device = LANDLOCK_ACCESS_FS_WRITE_FILE | (
            handled & (LANDLOCK_ACCESS_FS_TRUNCATE | LANDLOCK_ACCESS_FS_IOCTL_DEV)
        )
        if read_all:
            _landlock_add_path(ruleset_fd, "/", _landlock_READ)
        else:
            device |= LANDLOCK_ACCESS_FS_READ_FILE
            for path in _landlock_SYSTEM_READ:
                _landlock_add_path(ruleset_fd, path, _landlock_READ)
        for path in _landlock_DEVICES:
            _landlock_add_path(ruleset_fd, path, device)
        for path in [*write_dirs, _landlock_DEV_SHM]:
            _landlock_add_path(ruleset_fd, path, handled)
        if _landlock_libc.prctl(
            c_int(_landlock_PR_SET_NO_NEW_PRIVS),
            c_ulong(1),
            c_ulong(0),
            c_ulong(0),
            c_ulong(0),
        ):
            err = get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {posix.strerror(err)}")
        if _landlock_syscall(_landlock_RESTRICT_SELF, ruleset_fd, 0) != 0:
            err = get_errno()
            raise OSError(err, f"landlock_restrict_self failed: {posix.strerror(err)}")
    finally:
        posix.close(ruleset_fd)

    missing = landlock_missing(abi)
    warning = f"landlock ABI {abi}: " + "; ".join(missing) if missing else None
    return {"abi": abi, "applied": True, "scoped": bool(scoped), "warning": warning}
