"""The raw openat2(2) system call through ctypes. DANGEROUS: no checks here.

Only `bastion.safety.paths` may use it; the jail there is what makes it safe.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from typing import Final

from bastion.safety.errors import Unavailable

# include/uapi/linux/openat2.h
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_BENEATH: Final = 0x08
RESOLVE: Final = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS

# openat2 was added after the syscall tables were unified: it is 437 on every architecture
# below (arch/x86/entry/syscalls/*.tbl, include/uapi/asm-generic/unistd.h). MIPS, alpha and
# ia64 use other numbers and are refused rather than guessed.
_SYS_OPENAT2: Final = 437
_UNIFIED_TABLE_MACHINES: Final = frozenset(
    {"x86_64", "amd64", "aarch64", "arm64", "i386", "i686", "armv7l", "armv6l", "riscv64", "ppc64le", "s390x"}
)


class _OpenHow(ctypes.Structure):
    """``struct open_how`` from include/uapi/linux/openat2.h."""

    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


Openat2 = Callable[[int, bytes, int, int, int], int]


@functools.cache
def load_openat2() -> Openat2:
    """Return a raw ``openat2`` caller returning the fd or ``-errno``, or raise `Unavailable`.

    Loaded once: `ctypes.CDLL` builds a class at each call, about 14 us here, and a host workspace's every
    call opens its folder with this (`paths.open_real_folder`)."""
    machine = platform.machine().lower()
    if machine not in _UNIFIED_TABLE_MACHINES:
        raise Unavailable(f"openat2 is not known on machine type '{machine}': run bastion on x86_64 or aarch64 Linux")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError) as exc:
        raise Unavailable("the C library's syscall() is not available: run bastion on Linux") from exc
    syscall.restype = ctypes.c_long
    syscall.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)

    def openat2(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        how = _OpenHow(flags, mode, resolve)
        result = int(syscall(_SYS_OPENAT2, dirfd, path, ctypes.byref(how), ctypes.sizeof(how)))
        return result if result >= 0 else -ctypes.get_errno()

    return openat2
