"""The resource boundary of a sandbox: memory, pids, cpu, freeze and kill, through cgroups. DANGEROUS.

This module writes the kernel's cgroup files directly (as root, or inside a
delegated subtree), through `bastion.sandbox._cgroupfs`. It does not spawn
processes. Each sandbox gets one group named ``<parent>/<base_name>/<name>`` in
every hierarchy that matters:

- pure cgroup v2 (one ``cgroup2`` mount, with memory, pids and cpu in its
  ``cgroup.controllers``): one group carries the limits, the freezer
  (``cgroup.freeze``) and ``cgroup.kill``;
- hybrid (v1 per controller plus a ``cgroup2`` mount, often at
  ``/sys/fs/cgroup/unified``, holding no resource controller): the limits live in
  the v1 ``memory``, ``pids``, ``cpu`` (and ``cpuacct`` for usage) hierarchies and
  freeze/kill in the v2 one, so a process is attached to all of them;
- pure v1: as hybrid, freezing through the v1 ``freezer`` and killing by
  freeze, SIGKILL each pid, thaw.

Where each controller lives, and which parent holds ``<base_name>``, is found by
`bastion.sandbox._hierarchies` (from ``/proc/self``, never guessed).

What this is and is not: a resource boundary (memory, task count, CPU
throughput) and a reliable way to stop a whole process tree, setsid'd and
double-forked children included. It is not an isolation boundary: a process that
can write to a cgroup filesystem (root in the init user namespace, or a writable
``/sys/fs/cgroup`` bound into the sandbox) can leave its group, so the sandbox
must never see cgroupfs writable. The memory limit counts page cache as well as
anonymous memory, and TCP buffers on v2; v1 counts those against a limit of
their own, ``memory.kmem.tcp.limit_in_bytes``, set to the memory limit (so they
may hold as much again). Swap is turned off for the group (``memory.swap.max``
0 on v2, ``memory.swappiness`` 0 on v1). ``pids.max`` counts threads, not only processes.
A cpu quota bounds throughput per period, not latency. Calls block for bounded
times (freeze, kill, destroy): run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import secrets
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

from bastion.safety.errors import (
    BastionError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    Timeout,
    Unavailable,
)

# The ``X as X`` imports re-export public constants of the layers below, where they are read.
from bastion.sandbox._cgroupfs import MAX_FILE_BYTES as MAX_FILE_BYTES
from bastion.sandbox._cgroupfs import POLL_SLICE_S as POLL_SLICE_S
from bastion.sandbox._cgroupfs import V1_POLL_INTERVAL_S as V1_POLL_INTERVAL_S
from bastion.sandbox._cgroupfs import (
    keyed,
    poll_until,
    procs,
    read_file,
    read_or_empty,
    wait_events,
    write_file,
    write_raw,
)
from bastion.sandbox._hierarchies import DELEGATE_XATTRS as DELEGATE_XATTRS
from bastion.sandbox._hierarchies import RESOURCE_CONTROLLERS as RESOURCE_CONTROLLERS
from bastion.sandbox._hierarchies import V1_CONTROLLERS as V1_CONTROLLERS
from bastion.sandbox._hierarchies import Hierarchy, Mode, Roles, discover, parse_mountinfo, parse_self_cgroup

CPU_PERIOD_US: Final = 100_000
MIN_CPU_QUOTA_US: Final = 1_000  # the kernel refuses a cfs quota below 1 ms
FREEZE_WAIT_S: Final = 1.0
KILL_WAIT_S: Final = 2.0
DESTROY_WAIT_S: Final = 2.0
_NAME_RE: Final = re.compile(r"[a-z0-9-]{1,64}")


_OWNER_RE: Final = re.compile(r"[0-9a-f]{8}")


def owner_pid(name: str) -> int | None:
    """The pid of the server that made sandbox group `name` (`sb-PID-N`, `vm-PID-N`, each maybe `-OWNER`), or
    None for a name of another shape."""
    parts = name.split("-")
    if len(parts) == 4 and not _OWNER_RE.fullmatch(parts[3]):
        return None
    return int(parts[1]) if len(parts) in (3, 4) and parts[1].isdigit() and parts[2].isdigit() else None


def owner_token(name: str) -> str | None:
    """The owner token in sandbox group `name` (`sb-PID-N-OWNER`: its server's state folder, `owner_of`), or
    None for a name without one (made before tokens, or by a layout without an owner: the doctor's)."""
    parts = name.split("-")
    return parts[3] if owner_pid(name) is not None and len(parts) == 4 else None


OWNER_FILE: Final = "cgroup-owner"


def owner_of(state_dir: Path) -> str:
    """The token the sandbox groups of the server on `state_dir` carry in their names, made once and kept there.

    Found by review: a group's pid names a process only in its server's own pid namespace, so a server that is
    pid 1 of a container read another container's pid-1 groups as its own dead predecessor's, and destroyed
    them, live sandboxes included. The token tells servers apart by what they own: their state folder. It is
    kept with the folder's device and inode, and made anew when they differ (found by review: a copy of the
    folder, or a backup restored beside the running server, took the original's token and its groups). The
    caller holds the state folder's lock: no other server writes the file.
    """
    path = state_dir / OWNER_FILE
    folder = os.stat(state_dir)
    here = f"{folder.st_dev}:{folder.st_ino}"
    try:
        token, _, where = path.read_text(encoding="ascii").strip().partition(" ")
    except FileNotFoundError:
        token, where = "", ""
    except (OSError, UnicodeDecodeError) as exc:
        raise Unavailable(f"cannot read {path}: {exc}") from exc
    if _OWNER_RE.fullmatch(token) and where == here:
        return token
    token = secrets.token_hex(4)
    temporary = path.with_name(f".{OWNER_FILE}.tmp")
    try:
        temporary.write_text(f"{token} {here}\n", encoding="ascii")
        os.replace(temporary, path)
    except OSError as exc:
        raise Unavailable(f"cannot write {path}: {exc.strerror}") from exc
    return token


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox; None means unlimited.

    ``cpu_cores`` is CPU time per wall time: 1.0 is one CPU (cfs quota = period), 0.5 half of one.
    """

    memory_bytes: int | None
    pids: int | None
    cpu_cores: float | None

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise InvalidRequest(f"memory limit {self.memory_bytes} is not positive: give bytes > 0 or None")
        if self.pids is not None and self.pids <= 0:
            raise InvalidRequest(f"pids limit {self.pids} is not positive: give a count > 0 or None")
        if self.cpu_cores is not None and not (math.isfinite(self.cpu_cores) and self.cpu_cores > 0):
            raise InvalidRequest(f"cpu limit {self.cpu_cores} is not a positive number of cores: give e.g. 0.5 or None")


@dataclass(frozen=True)
class Usage:
    """A point-in-time reading of one group."""

    memory_bytes: int
    pids: int
    cpu_usec: int
    frozen: bool


def fd_migration_supported(release: str | None = None) -> bool:
    """Whether the kernel checks a cgroup.procs write against the fd opener's credentials and cgroup
    namespace (Linux >= 5.16), which command groups need: the agent moves itself through fds the
    server opened. `release`: a kernel release string (default: this kernel's)."""
    numbers = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return numbers is not None and (int(numbers[1]), int(numbers[2])) >= (5, 16)


def _validate_name(name: str, what: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"{what} {name!r} is not 1-64 of [a-z0-9-]: pick another name")


@final
class CgroupLayout:
    """Where each controller lives on this host, and the base group of every sandbox. Detect once at start-up."""

    def __init__(self, base_name: str, mode: Mode, roles: Roles, owner: str = "") -> None:
        self.base_name = base_name
        self.mode: Mode = mode
        self._roles = roles
        self.owner = owner
        """The token this server's group names end with (`owner_of`); "" for none."""

    def new_name(self, kind: str, number: int) -> str:
        """A group name of this server: `KIND-PID-NUMBER`, then `-OWNER` when the layout has an owner."""
        name = f"{kind}-{os.getpid()}-{number}"
        return f"{name}-{self.owner}" if self.owner else name

    @classmethod
    def detect(cls, base_name: str = "bastion", owner: str = "") -> CgroupLayout:
        """Find the hierarchies, pick the parent, and create the base group in each.

        Args:
            base_name: the folder under the parent that holds every sandbox group.
            owner: the token of the server's groups (`owner_of`), or "" for names without one.

        Returns:
            The layout; its base groups exist.

        Raises:
            Unavailable: a controller is missing, or no cgroup is writable by us.
        """
        _validate_name(base_name, "cgroup base name")
        try:
            with open("/proc/self/mountinfo", encoding="utf-8") as f:
                mounts = parse_mountinfo(f.read())
            with open("/proc/self/cgroup", encoding="utf-8") as f:
                own = parse_self_cgroup(f.read())
        except OSError as exc:
            raise Unavailable(f"cannot read /proc/self: {exc.strerror}; is /proc mounted?") from exc
        created: list[str] = []
        try:
            mode, roles = discover(base_name, mounts, own, created)
        except BaseException as exc:
            for path in reversed(created):  # leave no half-made layout behind
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            if isinstance(exc, (NotFound, OperationFailed)):
                raise Unavailable(exc.reason, detail=exc.detail) from exc
            raise
        return cls(base_name, mode, roles, owner)

    @property
    def locations(self) -> Mapping[str, str]:
        """The base folder serving each role: memory, pids, cpu, cpu_usage, freeze, and kill when cgroup.kill exists."""
        r = self._roles
        out = {"memory": r.memory.base, "pids": r.pids.base, "cpu": r.cpu.base}
        out |= {"cpu_usage": r.cpu_usage.base, "freeze": r.freeze.base}
        if r.cgroup_kill and r.unified is not None:
            out["kill"] = r.unified.base
        return out

    def usable(self) -> bool:
        """Whether every base folder is still there and writable by us (point-in-time, for a readiness probe)."""
        return all(os.access(base, os.W_OK | os.X_OK) for base in set(self.locations.values()))

    @property
    def has_cgroup_kill(self) -> bool:
        return self._roles.cgroup_kill

    def create(self, name: str, limits: Limits) -> SandboxCgroup:
        """Create the sandbox's group in every hierarchy and apply ``limits``.

        Raises:
            InvalidRequest: the name is not 1-64 of [a-z0-9-].
            Conflict: a group of that name exists in some hierarchy (nothing is reused).
            OperationFailed: the kernel refused; nothing is left behind.
        """
        _validate_name(name, "sandbox cgroup name")
        if any(os.path.lexists(h.group(name)) for h in self._roles.all):
            raise Conflict(f"cgroup {name} already exists: destroy it or pick another name")
        made: list[str] = []
        try:
            for h in self._roles.all:
                try:
                    os.mkdir(h.group(name), 0o755)
                except FileExistsError as exc:
                    raise Conflict(f"cgroup {name} already exists: destroy it or pick another name") from exc
                except OSError as exc:
                    raise OperationFailed(f"cannot create cgroup {h.group(name)}: {exc.strerror}") from exc
                made.append(h.group(name))
            group = SandboxCgroup(name, self._roles)
            group.set_limits(limits)
        except BaseException:
            for path in reversed(made):
                try:
                    os.rmdir(path)
                except OSError:
                    continue
            raise
        return group

    def existing(self) -> list[str]:
        """Names of the sandbox groups present in any hierarchy (left behind by a crash, or still live)."""
        names: set[str] = set()
        for h in self._roles.all:
            try:
                with os.scandir(h.base) as entries:
                    names.update(
                        e.name for e in entries if e.is_dir(follow_symlinks=False) and _NAME_RE.fullmatch(e.name)
                    )
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise OperationFailed(f"cannot list {h.base}: {exc.strerror}") from exc
        return sorted(names)

    def open(self, name: str) -> SandboxCgroup:
        """The existing group ``name``, even if a crash left it in only some hierarchies.

        Raises:
            NotFound: no hierarchy has it.
        """
        _validate_name(name, "sandbox cgroup name")
        if not any(os.path.isdir(h.group(name)) for h in self._roles.all):
            raise NotFound(f"cgroup {name} does not exist: create it first")
        return SandboxCgroup(name, self._roles)

    def release(self) -> None:
        """Remove the (empty) base groups; for shutdown and tests. A server leaf made on pure v2 stays.

        Raises:
            Conflict: sandbox groups are still there: destroy them first.
        """
        for h in self._roles.all:
            try:
                os.rmdir(h.base)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                    raise Conflict(f"cgroup {h.base} still holds sandbox groups: destroy them first") from exc
                raise OperationFailed(f"cannot remove cgroup {h.base}: {exc.strerror}") from exc


@final
class SandboxCgroup:
    """One sandbox's group across every hierarchy. Obtained from `CgroupLayout.create` or `CgroupLayout.open`."""

    def __init__(self, name: str, roles: Roles) -> None:
        self.name = name
        self._roles = roles

    @property
    def paths(self) -> tuple[str, ...]:
        """The group's folder in each hierarchy, the v2 one first."""
        return tuple(h.group(self.name) for h in self._roles.all)

    def _file(self, h: Hierarchy, filename: str) -> str:
        return os.path.join(h.group(self.name), filename)

    def attach(self, pid: int) -> None:
        """Move process ``pid`` (0: the calling process) into the group in every hierarchy.

        Its future children start inside. Children it forked before this call do
        not follow: attach before the process starts work (or call attach(0) in
        the child before exec). If this raises, the process may already be in some
        hierarchies: destroy the group.

        Raises:
            NotFound: the process or the group is gone.
            OperationFailed: the kernel refused the move.
        """
        if pid < 0:
            raise InvalidRequest(f"pid {pid} is negative: give a process id")
        for h in self._roles.all:
            path = self._file(h, "cgroup.procs")
            try:
                write_raw(path, str(pid))
            except ProcessLookupError as exc:
                raise NotFound(f"process {pid} is gone: it cannot join cgroup {self.name}") from exc
            except FileNotFoundError as exc:
                raise NotFound(f"cgroup {self.name} is gone from {h.base}: create it again") from exc
            except OSError as exc:
                raise OperationFailed(f"cannot move pid {pid} into {path}: {exc.strerror}") from exc

    def set_limits(self, limits: Limits) -> None:
        """Apply ``limits`` (None: unlimited) and turn swap off for the group.

        Raises:
            OperationFailed: the kernel refused (e.g. v1 cannot lower memory below current use).
        """
        r = self._roles
        quota = None
        if limits.cpu_cores is not None:
            quota = max(MIN_CPU_QUOTA_US, round(limits.cpu_cores * CPU_PERIOD_US))
        if r.memory.version == 2:
            write_file(
                self._file(r.memory, "memory.max"), "max" if limits.memory_bytes is None else str(limits.memory_bytes)
            )
            swap = self._file(r.memory, "memory.swap.max")
            if os.path.exists(swap):
                write_file(swap, "0")
        else:
            write_file(self._file(r.memory, "memory.limit_in_bytes"), str(limits.memory_bytes or -1))
            self._limit_tcp_buffers(str(limits.memory_bytes or -1))
            # v1: swappiness 0 keeps the group's anonymous memory in RAM; best-effort, some kernels refuse it.
            with contextlib.suppress(OSError):
                write_raw(self._file(r.memory, "memory.swappiness"), "0")
        write_file(self._file(r.pids, "pids.max"), "max" if limits.pids is None else str(limits.pids))
        if r.cpu.version == 2:
            write_file(self._file(r.cpu, "cpu.max"), f"{'max' if quota is None else quota} {CPU_PERIOD_US}")
        else:
            write_file(self._file(r.cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            write_file(self._file(r.cpu, "cpu.cfs_quota_us"), str(-1 if quota is None else quota))

    def _limit_tcp_buffers(self, value: str) -> None:
        """v1: charge the group's TCP buffers, up to `value` bytes.

        v1 counts them apart from the memory limit, and only once ``memory.kmem.tcp.limit_in_bytes``
        is written (Documentation/admin-guide/cgroup-v1/memory.rst, kmem.tcp); until then they are the
        host's, and ``tcp_mem`` is one budget for every socket on it: a sandbox's loopback connections
        held 402 MB with its group at 4 of 128 MiB. v2 counts them in memory.max (``sock`` in memory.stat).
        A kernel without the file (no kmem accounting) is left as it is.

        Raises:
            OperationFailed: the file is there but the kernel refused the limit.
        """
        path = self._file(self._roles.memory, "memory.kmem.tcp.limit_in_bytes")
        if not os.path.exists(path):
            return
        try:
            write_raw(path, value)
        except OSError as exc:
            raise OperationFailed(
                f"cannot limit the TCP buffers of cgroup {self.name} ({path}): {exc.strerror}; "
                "without the limit they are charged to no group: fix the v1 memory controller or use cgroup v2"
            ) from exc

    def usage(self) -> Usage:
        """Current memory (bytes, page cache included), task count, cumulative CPU time (µs), and frozen state."""
        r = self._roles
        if r.memory.version == 2:
            memory = int(read_file(self._file(r.memory, "memory.current")))
        else:
            memory = int(read_file(self._file(r.memory, "memory.usage_in_bytes")))
        pids = int(read_file(self._file(r.pids, "pids.current")))
        if r.cpu_usage.version == 2:
            cpu_usec = keyed(read_file(self._file(r.cpu_usage, "cpu.stat"))).get("usage_usec", 0)
        else:
            cpu_usec = int(read_file(self._file(r.cpu_usage, "cpuacct.usage"))) // 1000  # ns
        return Usage(memory, pids, cpu_usec, self._frozen())

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this group (memory limit hit)."""
        r = self._roles
        name = "memory.events" if r.memory.version == 2 else "memory.oom_control"
        return keyed(read_file(self._file(r.memory, name))).get("oom_kill", 0)

    def shmem_bytes(self) -> int:
        """Memory of the group held by files in tmpfs (its /tmp and /dev/shm) and shared memory."""
        return keyed(read_file(self._file(self._roles.memory, "memory.stat"))).get("shmem", 0)

    def pids(self) -> list[int]:
        """Every process in the group or its command groups, in any hierarchy."""
        found: set[int] = set()
        for h in self._roles.all:
            for directory in _tree(h.group(self.name)):
                found.update(procs(directory))
        return sorted(found)

    @property
    def _command_hierarchy(self) -> Hierarchy:
        """Where command groups live: the hierarchy that kills (cgroup.kill), else the freezer's."""
        r = self._roles
        return r.unified if r.cgroup_kill and r.unified is not None else r.freeze

    def home_procs(self) -> str:
        """The group's cgroup.procs in the command groups' hierarchy: where the agent returns after a spawn."""
        return self._file(self._command_hierarchy, "cgroup.procs")

    def command_group(self, name: str) -> CommandCgroup:
        """Create the child group ``name`` for one command's processes (no controller: limits stay here).

        Raises:
            InvalidRequest: the name is not 1-64 of [a-z0-9-].
            OperationFailed: the kernel refused.
        """
        _validate_name(name, "command cgroup name")
        path = os.path.join(self._command_hierarchy.group(self.name), name)
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass  # left by an earlier start of this sandbox: reused
        except OSError as exc:
            raise OperationFailed(f"cannot create cgroup {path}: {exc.strerror}") from exc
        return CommandCgroup(path, self._command_hierarchy.version, self._roles.cgroup_kill)

    def _frozen(self) -> bool:
        h = self._roles.freeze
        if h.version == 2:
            return keyed(read_file(self._file(h, "cgroup.events"))).get("frozen") == 1
        return read_file(self._file(h, "freezer.state")).strip() == "FROZEN"

    def _set_frozen(self, frozen: bool, *, thaw_on_failure: bool = True) -> None:
        """`thaw_on_failure`: a freeze that fails or times out thaws what it froze (a kill, which signals what it
        froze next, keeps it frozen)."""
        h = self._roles.freeze
        try:
            done = self._freeze_v2(h, frozen) if h.version == 2 else self._freeze_v1(h, frozen)
        except BastionError:
            if frozen and thaw_on_failure:
                with contextlib.suppress(BastionError):
                    self._set_frozen(False)
            raise
        if not done and frozen and thaw_on_failure:
            # Found by review: a freeze that timed out left some command groups (or the whole group) frozen while
            # the sandbox was not paused, and no resume could thaw them. All of it is thawed again.
            self._set_frozen(False)
            raise Timeout(
                f"cgroup {self.name} did not freeze within {FREEZE_WAIT_S} s (a task may be in uninterruptible "
                "sleep, or held by its CPU limit): it was thawed again"
            )
        if not done:
            verb = "freeze" if frozen else "thaw"
            raise Timeout(
                f"cgroup {self.name} did not {verb} within {FREEZE_WAIT_S} s: a task may be in uninterruptible sleep"
            )

    def _freeze_v1(self, h: Hierarchy, frozen: bool) -> bool:
        want = "FROZEN" if frozen else "THAWED"
        write_file(self._file(h, "freezer.state"), want)
        return poll_until(lambda: read_file(self._file(h, "freezer.state")).strip() == want, FREEZE_WAIT_S)

    def _freeze_v2(self, h: Hierarchy, frozen: bool) -> bool:
        """Freeze (children first) or thaw (children first, then the group); whether the kernel said done in time.

        The group holds processes of its own (bubblewrap, the agent) beside its command groups, and the kernel
        reports "frozen 1" for such a group as soon as either its own processes or all its child groups are
        frozen (kernel/cgroup/freezer.c: cgroup_propagate_frozen checks the children only, cgroup_update_frozen
        its own processes only). Frozen at once together, the empty command groups made it report frozen while
        the agent still ran. Each command group is frozen first, by its own cgroup.freeze: then only the
        group's own processes move its state, and "frozen 1" means all of them are stopped too.

        Found by review: a command group made after the listing (a command starting during the freeze) froze
        with the group, unwaited for: the group's report counted its own processes only, or that command
        group's freezing, and freeze() returned while the command still ran. The children are listed again
        after the group's report; when one was added, it is frozen on its own and the group frozen afresh.
        """
        deadline = time.monotonic() + FREEZE_WAIT_S
        group = h.group(self.name)
        if not frozen:
            return _thaw_v2(group, deadline)
        listed = _tree(group)[1:]
        while _freeze_each(listed, deadline):
            write_file(os.path.join(group, "cgroup.freeze"), "1")
            if not wait_events(group, "frozen", 1, _left(deadline)):
                return False
            again = _tree(group)[1:]
            if set(again) <= set(listed):  # none added (one removed meanwhile changes nothing)
                return True
            # The report may have been the new group's: it is frozen on its own (before the thaw, so it stays
            # frozen), and the group thawed to be frozen again with every child already frozen.
            if not _freeze_each(again, deadline) or time.monotonic() >= deadline:
                return False
            write_file(os.path.join(group, "cgroup.freeze"), "0")
            listed = again
        return False

    def freeze(self) -> None:
        """Stop every process in the group (they keep their memory), waiting until the kernel reports it frozen.

        Raises:
            Timeout: not frozen within FREEZE_WAIT_S (then it is thawed again: nothing stays frozen).
        """
        self._set_frozen(True)

    def thaw(self) -> None:
        """Let a frozen group run again."""
        self._set_frozen(False)

    def _empty(self) -> bool:
        unified = self._roles.unified
        if unified is not None and keyed(read_or_empty(self._file(unified, "cgroup.events"))).get("populated", 0):
            return False
        return not any(procs(d) for h in self._roles.all if h.version == 1 for d in _tree(h.group(self.name)))

    def _wait_empty(self, timeout_s: float) -> bool:
        unified = self._roles.unified
        deadline = time.monotonic() + timeout_s
        if unified is not None and not wait_events(unified.group(self.name), "populated", 0, timeout_s):
            return False
        return poll_until(self._empty, max(0.0, deadline - time.monotonic()))

    def _kill_each(self) -> None:
        """Freeze, SIGKILL each pid, thaw: frozen processes cannot fork or exit, so no pid is missed or reused."""
        # A half-created group, or a stuck task, must not stop us signalling what we can see.
        with contextlib.suppress(NotFound, Timeout):
            self._set_frozen(True, thaw_on_failure=False)  # what froze in time stays frozen while it is signalled
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        with contextlib.suppress(NotFound, Timeout):
            self._set_frozen(False)

    def kill(self) -> None:
        """SIGKILL every process in the group, setsid'd and double-forked ones included, and wait until it is empty.

        Raises:
            OperationFailed: processes remain after KILL_WAIT_S.
        """
        r = self._roles
        if r.cgroup_kill and r.unified is not None:
            with contextlib.suppress(NotFound):  # half-created: the fallback below still runs
                write_file(self._file(r.unified, "cgroup.kill"), "1")
            if self._wait_empty(KILL_WAIT_S / 2):
                return
        self._kill_each()
        if not self._wait_empty(KILL_WAIT_S):
            raise OperationFailed(
                f"cgroup {self.name} still has processes {KILL_WAIT_S} s after SIGKILL",
                detail=f"pids: {self.pids()}",
            )

    def _release_memory(self) -> None:
        """Reclaim the page cache charged to the emptied group, best effort, before it is removed: a removed memory
        cgroup stays in the kernel ("dying", in /proc/cgroups, out of the tree) as long as pages charged to it stay
        cached. Found by attack: an agent's create, read of host files nobody had cached, close, left one such
        group a cycle with no bound until memory pressure (200 cycles, 200 groups; a sleep and wake alike, held by
        the disk image's pages), and the kernel's reclaim walks every one. The use the kernel documents for v1's
        `memory.force_empty` (cgroup-v1/memory.rst); v2's `memory.reclaim` alike (5.19 on)."""
        memory = self._roles.memory
        with contextlib.suppress(OSError, NotFound, OperationFailed):  # no such file, or pages it could not reclaim
            if memory.version == 1:
                write_raw(self._file(memory, "memory.force_empty"), "0")
                return
            current = read_file(self._file(memory, "memory.current")).strip()
            if current != "0":
                write_raw(self._file(memory, "memory.reclaim"), current)

    def destroy(self) -> None:
        """Kill everything in the group, then remove it from every hierarchy. Safe to call twice.

        Raises:
            OperationFailed: the group could not be emptied or removed in time.
        """
        self.kill()
        self._release_memory()
        deadline = time.monotonic() + DESTROY_WAIT_S
        # Command groups first: a group with children cannot be removed.
        children = [d for path in self.paths for d in _tree(path)[1:]]
        for path in [*reversed(children), *self.paths]:
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise OperationFailed(f"cannot remove cgroup {path}: {exc.strerror}") from exc
                    # EBUSY right after cgroup.kill: the last tasks are still exiting.
                    self._wait_empty(max(0.0, deadline - time.monotonic()))
                    time.sleep(V1_POLL_INTERVAL_S)


@final
class CommandCgroup:
    """One command's child group of a sandbox's group, in the hierarchy that kills.

    It carries no controller (the sandbox's group, which counts its descendants, holds the
    limits), so it exists to name one command's process tree: `kill` ends that tree,
    setsid'd, double-forked and daemonized processes included, and nothing else.
    From `SandboxCgroup.command_group`.
    """

    def __init__(self, path: str, version: int, has_kill_file: bool) -> None:
        self.path = path
        self._version = version
        self._has_kill_file = has_kill_file and version == 2

    def open_procs(self) -> int:
        """An O_WRONLY fd of its cgroup.procs: whoever writes "0" to it moves in, checked against the
        opener's (the server's) credentials and cgroup namespace (Linux >= 5.16).

        Raises:
            NotFound: the group is gone.
            OperationFailed: it cannot be opened.
        """
        path = os.path.join(self.path, "cgroup.procs")
        try:
            return os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"cgroup {self.path} is gone") from exc
        except OSError as exc:
            raise OperationFailed(f"cannot open {path}: {exc.strerror}") from exc

    def pids(self) -> list[int]:
        """Its processes, as the server's PID namespace numbers them."""
        return procs(self.path)

    def populated(self) -> bool:
        if self._version == 2:
            return keyed(read_or_empty(os.path.join(self.path, "cgroup.events"))).get("populated", 0) != 0
        return bool(self.pids())

    def kill(self) -> None:
        """SIGKILL every process in it (cgroup.kill, else freeze, SIGKILL each, thaw). Does not wait for the exits.

        Raises:
            OperationFailed: the kernel refused.
        """
        if self._has_kill_file:
            with contextlib.suppress(NotFound):
                write_file(os.path.join(self.path, "cgroup.kill"), "1")
            return
        frozen = ("cgroup.freeze", "1", "0") if self._version == 2 else ("freezer.state", "FROZEN", "THAWED")
        name, on, off = frozen
        with contextlib.suppress(NotFound):
            write_file(os.path.join(self.path, name), on)
            # Frozen processes cannot fork: a pid read now is one to signal (a few ms to settle on v1).
            if self._version == 1:
                poll_until(lambda: read_or_empty(os.path.join(self.path, name)).strip() != "FREEZING", FREEZE_WAIT_S)
            else:
                wait_events(self.path, "frozen", 1, FREEZE_WAIT_S)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            write_file(os.path.join(self.path, name), off)

    def wait_empty(self, timeout_s: float) -> bool:
        """Wait (blocking, at most `timeout_s`) until no process is left in it; whether none is."""
        if self._version == 2:
            return wait_events(self.path, "populated", 0, timeout_s)
        return poll_until(lambda: not self.pids(), timeout_s)

    def remove(self) -> bool:
        """Remove it if it is empty; whether it is gone."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _thaw_v2(group: str, deadline: float) -> bool:
    for child in _tree(group)[1:]:
        with contextlib.suppress(NotFound):  # removed meanwhile: nothing of it to thaw
            write_file(os.path.join(child, "cgroup.freeze"), "0")
    write_file(os.path.join(group, "cgroup.freeze"), "0")
    return wait_events(group, "frozen", 0, _left(deadline))


def _freeze_each(children: list[str], deadline: float) -> bool:
    """Freeze each command group by its own cgroup.freeze and wait for its report, which counts its own processes
    only (it has no child groups); whether all did by `deadline`. A group removed meanwhile is skipped."""
    for child in children:
        try:
            write_file(os.path.join(child, "cgroup.freeze"), "1")
        except NotFound:
            continue
        if not wait_events(child, "frozen", 1, _left(deadline)) and os.path.isdir(child):
            return False
    return True


def _tree(directory: str) -> list[str]:
    """`directory` and its child groups (command groups are one level deep), the parent first."""
    try:
        with os.scandir(directory) as entries:
            children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return [directory]
    return [directory, *sorted(children)]
