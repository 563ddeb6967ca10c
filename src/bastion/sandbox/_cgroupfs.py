"""Reading, writing and waiting on the kernel's cgroup files: the layer under `bastion.sandbox.cgroups`. DANGEROUS.

Every write acts on the kernel at once, as the server (root, or the owner of a
delegated subtree), so each is one unbuffered write(2). Reads are bounded
(`MAX_FILE_BYTES`) and every wait is bounded by its timeout. Only `cgroups` and
`_hierarchies` use it.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import Final

from bastion.safety.errors import NotFound, OperationFailed

POLL_SLICE_S: Final = 0.05  # upper bound of one poll(2) on cgroup.events, in case a notification is missed
V1_POLL_INTERVAL_S: Final = 0.002  # v1 files cannot be polled: re-read this often
MAX_FILE_BYTES: Final = 1 << 20


def read_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise NotFound(f"cgroup file {path} does not exist: the group is gone or the controller is missing") from exc
    except OSError as exc:
        raise OperationFailed(f"cannot open {path}: {exc.strerror}") from exc
    try:
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise OperationFailed(f"cgroup file {path} is larger than {MAX_FILE_BYTES} bytes")
        return b"".join(chunks).decode("ascii", errors="replace")
    except OSError as exc:
        raise OperationFailed(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def write_raw(path: str, value: str) -> None:
    """One unbuffered write(2): cgroup files act on each write, so a partial or split write must not happen."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def write_file(path: str, value: str) -> None:
    try:
        write_raw(path, value)
    except FileNotFoundError as exc:
        raise NotFound(f"cgroup file {path} does not exist: the group is gone or the controller is missing") from exc
    except OSError as exc:
        raise OperationFailed(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def keyed(text: str) -> dict[str, int]:
    """Parse a flat keyed file ("key value" per line), such as cgroup.events or memory.events."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def procs(directory: str) -> list[int]:
    try:
        text = read_file(os.path.join(directory, "cgroup.procs"))
    except NotFound:
        return []
    return [int(line) for line in text.split()]


def wait_events(directory: str, key: str, want: int, timeout_s: float) -> bool:
    """Wait until cgroup.events says ``key want``; True if it did. A vanished group counts as unpopulated.

    cgroup.events raises POLLPRI on change (Documentation/admin-guide/cgroup-v2.rst,
    "cgroup.events ... generates a file modified event"), so this sleeps in poll(2).
    """
    path = os.path.join(directory, "cgroup.events")
    deadline = time.monotonic() + timeout_s
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return key == "populated" and want == 0
    except OSError as exc:
        raise OperationFailed(f"cannot open {path}: {exc.strerror}") from exc
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while True:
            try:
                current = keyed(os.pread(fd, 4096, 0).decode("ascii", errors="replace")).get(key)
            except OSError:  # ENODEV: removed while we waited
                return key == "populated" and want == 0
            if current == want:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(max(1, int(min(remaining, POLL_SLICE_S) * 1000)))
    finally:
        os.close(fd)


def read_or_empty(path: str) -> str:
    try:
        return read_file(path)
    except NotFound:
        return ""


def poll_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(V1_POLL_INTERVAL_S)
    return True
