"""The raw renameat2(2) call through ctypes. DANGEROUS: no checks here.

Only `bastion.organizer.folder` may use it; the folder there is what makes it safe.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

from bastion.safety.errors import Unavailable

# include/uapi/linux/fs.h: fail with EEXIST instead of replacing an existing destination.
RENAME_NOREPLACE: Final = 1

Renameat2 = Callable[[int, bytes, int, bytes, int], int]


def load_renameat2() -> Renameat2:
    """Return a raw ``renameat2`` caller returning 0 or ``-errno``, or raise `Unavailable`.

    glibc has exported ``renameat2`` since 2.28; there is no fallback to rename(2), which
    would silently replace an existing destination.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError) as exc:
        raise Unavailable("the C library has no renameat2 (glibc 2.28 or newer is needed)") from exc
    function.restype = ctypes.c_int
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)

    def renameat2(olddirfd: int, oldpath: bytes, newdirfd: int, newpath: bytes, flags: int) -> int:
        result = int(function(olddirfd, oldpath, newdirfd, newpath, flags))
        return 0 if result == 0 else -ctypes.get_errno()

    return renameat2
