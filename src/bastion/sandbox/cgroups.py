"""The resource boundary of a sandbox: memory, pids, cpu, freeze and kill, through cgroups. DANGEROUS.

This module writes the kernel's cgroup files directly (as root, or inside a
delegated subtree). It does not spawn processes. Each sandbox gets one group
named ``<parent>/<base_name>/<name>`` in every hierarchy that matters:

- pure cgroup v2 (one ``cgroup2`` mount, with memory, pids and cpu in its
  ``cgroup.controllers``): one group carries the limits, the freezer
  (``cgroup.freeze``) and ``cgroup.kill``;
- hybrid (v1 per controller plus a ``cgroup2`` mount, often at
  ``/sys/fs/cgroup/unified``, holding no resource controller): the limits live in
  the v1 ``memory``, ``pids``, ``cpu`` (and ``cpuacct`` for usage) hierarchies and
  freeze/kill in the v2 one, so a process is attached to all of them;
- pure v1: as hybrid, freezing through the v1 ``freezer`` and killing by
  freeze, SIGKILL each pid, thaw.

Where each controller lives is read from ``/proc/self/mountinfo``, never guessed.
The parent is the server's own cgroup (``/proc/self/cgroup``) when it was
delegated to us (systemd ``Delegate=yes``: owned by our unprivileged uid, or
marked with the ``trusted.delegate``/``user.delegate`` xattr), else the hierarchy
root when we are root.

What this is and is not: a resource boundary (memory, task count, CPU
throughput) and a reliable way to stop a whole process tree, setsid'd and
double-forked children included. It is not an isolation boundary: a process that
can write to a cgroup filesystem (root in the init user namespace, or a writable
``/sys/fs/cgroup`` bound into the sandbox) can leave its group, so the sandbox
must never see cgroupfs writable. The memory limit counts page cache as well as
anonymous memory; swap is turned off for the group (``memory.swap.max`` 0 on v2,
``memory.swappiness`` 0 on v1). ``pids.max`` counts threads, not only processes.
A cpu quota bounds throughput per period, not latency. Calls block for bounded
times (freeze, kill, destroy): run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import select
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, final

from bastion.safety.errors import Conflict, InvalidRequest, NotFound, OperationFailed, Timeout, Unavailable

CPU_PERIOD_US: Final = 100_000
MIN_CPU_QUOTA_US: Final = 1_000  # the kernel refuses a cfs quota below 1 ms
FREEZE_WAIT_S: Final = 1.0
KILL_WAIT_S: Final = 2.0
DESTROY_WAIT_S: Final = 2.0
POLL_SLICE_S: Final = 0.05  # upper bound of one poll(2) on cgroup.events, in case a notification is missed
V1_POLL_INTERVAL_S: Final = 0.002  # v1 files cannot be polled: re-read this often
MAX_FILE_BYTES: Final = 1 << 20
RESOURCE_CONTROLLERS: Final = ("memory", "pids", "cpu")
V1_CONTROLLERS: Final = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer"})
DELEGATE_XATTRS: Final = ("trusted.delegate", "user.delegate")  # set by systemd >= 251 / 253 on Delegate=yes

_NAME_RE: Final = re.compile(r"[a-z0-9-]{1,64}")
_OCTAL_ESCAPE_RE: Final = re.compile(r"\\([0-7]{3})")

Mode = Literal["v2", "hybrid", "v1"]


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


@dataclass(frozen=True)
class _Mount:
    root: str
    point: str
    fstype: str
    super_options: frozenset[str]


@dataclass(frozen=True)
class _Hierarchy:
    version: Literal[1, 2]
    base: str  # absolute path of <parent>/<base_name>

    def group(self, name: str) -> str:
        return os.path.join(self.base, name)


@dataclass(frozen=True)
class _Roles:
    memory: _Hierarchy
    pids: _Hierarchy
    cpu: _Hierarchy
    cpu_usage: _Hierarchy
    freeze: _Hierarchy
    unified: _Hierarchy | None
    cgroup_kill: bool
    all: tuple[_Hierarchy, ...]  # the v2 one first: it is the kill boundary


# ---------------------------------------------------------------- file access


def _read(path: str) -> str:
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


def _write_raw(path: str, value: str) -> None:
    """One unbuffered write(2): cgroup files act on each write, so a partial or split write must not happen."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def _write(path: str, value: str) -> None:
    try:
        _write_raw(path, value)
    except FileNotFoundError as exc:
        raise NotFound(f"cgroup file {path} does not exist: the group is gone or the controller is missing") from exc
    except OSError as exc:
        raise OperationFailed(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def _keyed(text: str) -> dict[str, int]:
    """Parse a flat keyed file ("key value" per line), such as cgroup.events or memory.events."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def _procs(directory: str) -> list[int]:
    try:
        text = _read(os.path.join(directory, "cgroup.procs"))
    except NotFound:
        return []
    return [int(line) for line in text.split()]


def _wait_events(directory: str, key: str, want: int, timeout_s: float) -> bool:
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
                current = _keyed(os.pread(fd, 4096, 0).decode("ascii", errors="replace")).get(key)
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


# ---------------------------------------------------------------- discovery


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _parse_mountinfo(text: str) -> list[_Mount]:
    """Fields per proc(5): id parent dev root point options [optional...] - fstype source super-options."""
    mounts: list[_Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] in ("cgroup", "cgroup2"):
            mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], frozenset(tail[2].split(","))))
    return mounts


def _parse_self_cgroup(text: str) -> dict[str, str]:
    """Map each controller ("" for v2) to this process's cgroup path, per cgroups(7)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out[""] = path
        for controller in controllers.split(","):
            if controller and not controller.startswith("name="):
                out[controller] = path
    return out


def _own_dir(mount: _Mount, own_path: str | None) -> str | None:
    if own_path is None:
        return None
    root = mount.root.rstrip("/")
    if root and own_path != root and not own_path.startswith(root + "/"):
        return None  # our cgroup is outside what this mount shows
    relative = own_path[len(root) :].lstrip("/")
    return os.path.join(mount.point, relative) if relative else mount.point


def _delegated(directory: str) -> bool:
    """Whether this cgroup was handed to us (systemd Delegate=yes), so we may build our own subtree under it."""
    if os.geteuid() != 0:
        return os.access(directory, os.W_OK) and os.access(os.path.join(directory, "cgroup.procs"), os.W_OK)
    for attr in DELEGATE_XATTRS:
        try:
            if os.getxattr(directory, attr).strip() == b"1":
                return True
        except OSError:
            continue
    return False


def _parent_dir(mount: _Mount, own_path: str | None) -> str:
    own = _own_dir(mount, own_path)
    if own is not None and own != mount.point and _delegated(own):
        return own
    if os.geteuid() == 0:
        return mount.point
    raise Unavailable(
        f"no writable cgroup under {mount.point}: run as root or under systemd with Delegate=yes",
        detail=f"own cgroup {own_path!r} is not delegated to uid {os.geteuid()}",
    )


def _enable_v2_controllers(parent: str, base_name: str) -> None:
    """Enable memory, pids and cpu for the children of ``parent``.

    cgroup v2's "no internal process" rule (cgroup-v2.rst, "No Internal Process
    Constraint"): a non-root cgroup that holds processes cannot enable controllers
    for its children, and the write fails with EBUSY. A delegated service cgroup
    holds the server itself, so the server's processes move into a leaf
    ``<parent>/<base_name>-server`` first, as systemd's delegation guide advises.
    """
    available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
    missing = [c for c in RESOURCE_CONTROLLERS if c not in available]
    if missing:
        raise Unavailable(
            f"cgroup {parent} lacks the {' '.join(missing)} controller(s): enable them (systemd Delegate=yes)"
        )
    control = os.path.join(parent, "cgroup.subtree_control")
    wanted = " ".join(f"+{c}" for c in RESOURCE_CONTROLLERS)
    try:
        _write_raw(control, wanted)
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise Unavailable(f"cannot enable controllers in {control}: {exc.strerror}") from exc
    leaf = os.path.join(parent, f"{base_name}-server")
    try:
        os.mkdir(leaf, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        raise Unavailable(f"cannot create leaf cgroup {leaf} for the server: {exc.strerror}") from exc
    for _ in range(8):  # processes may fork while we move them; a few rounds settle it
        pids = _procs(parent)
        if not pids:
            break
        for pid in pids:
            try:
                _write_raw(os.path.join(leaf, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                continue
            except OSError as exc:
                raise Unavailable(f"cannot move pid {pid} into leaf cgroup {leaf}: {exc.strerror}") from exc
    try:
        _write_raw(control, wanted)
    except OSError as exc:
        raise Unavailable(f"cannot enable controllers in {control}: {exc.strerror}") from exc


def _discover(base_name: str, mounts: list[_Mount], own: dict[str, str], created: list[str]) -> tuple[Mode, _Roles]:
    """Pick a hierarchy per role and make the base groups, appending each new folder to ``created``."""
    v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v1_mounts: dict[str, _Mount] = {}
    for mount in mounts:
        if mount.fstype == "cgroup":
            for controller in sorted(mount.super_options & V1_CONTROLLERS):
                v1_mounts.setdefault(controller, mount)
    v2_controllers: set[str] = set()
    if v2_mount is not None:
        v2_controllers = set(_read(os.path.join(v2_mount.point, "cgroup.controllers")).split())
    v2_has_all = all(c in v2_controllers for c in RESOURCE_CONTROLLERS)
    built: dict[str, _Hierarchy] = {}  # mount point -> hierarchy

    def hierarchy(mount: _Mount) -> _Hierarchy:
        if mount.point in built:
            return built[mount.point]
        v2 = mount.fstype == "cgroup2"
        own_path = own.get("" if v2 else min(mount.super_options & V1_CONTROLLERS))
        if own_path is not None and own_path.endswith(f"/{base_name}-server"):
            own_path = own_path.rsplit("/", 1)[0]  # already moved to our leaf by an earlier detect()
        parent = _parent_dir(mount, own_path)
        if v2 and v2_has_all:
            _enable_v2_controllers(parent, base_name)
        base = os.path.join(parent, base_name)
        try:
            os.mkdir(base, 0o755)
            created.append(base)
        except FileExistsError:
            pass
        except OSError as exc:
            raise Unavailable(f"cannot create cgroup {base}: {exc.strerror}; run as root or delegate it") from exc
        if v2 and v2_has_all:
            try:
                _write_raw(os.path.join(base, "cgroup.subtree_control"), "+memory +pids +cpu")
            except OSError as exc:
                raise Unavailable(f"cannot enable controllers under {base}: {exc.strerror}") from exc
        built[mount.point] = _Hierarchy(2 if v2 else 1, base)
        return built[mount.point]

    def place(controller: str) -> _Hierarchy:
        if controller in v1_mounts:
            return hierarchy(v1_mounts[controller])
        if v2_mount is not None and controller in v2_controllers:
            return hierarchy(v2_mount)
        raise Unavailable(f"no cgroup hierarchy provides the {controller} controller: mount cgroup2 or cgroup v1")

    unified = hierarchy(v2_mount) if v2_mount is not None else None
    memory, pids, cpu = place("memory"), place("pids"), place("cpu")
    if cpu.version == 2:
        cpu_usage = cpu
    elif "cpuacct" in v1_mounts:
        cpu_usage = hierarchy(v1_mounts["cpuacct"])  # the same folder when co-mounted as cpu,cpuacct
    elif unified is not None:
        cpu_usage = unified  # v2 cpu.stat usage_usec is core: it needs no controller
    else:
        raise Unavailable("no cgroup hierarchy reports cpu usage: mount the v1 cpuacct hierarchy or cgroup2")
    if unified is not None and os.path.exists(os.path.join(unified.base, "cgroup.freeze")):
        freeze = unified
    elif "freezer" in v1_mounts:
        freeze = hierarchy(v1_mounts["freezer"])
    else:
        raise Unavailable("no cgroup freezer: needs Linux >= 5.2 with cgroup2, or the v1 freezer hierarchy")
    cgroup_kill = unified is not None and os.path.exists(os.path.join(unified.base, "cgroup.kill"))
    ordered = ([unified] if unified is not None else []) + [h for h in built.values() if h is not unified]
    roles = _Roles(memory, pids, cpu, cpu_usage, freeze, unified, cgroup_kill, tuple(ordered))
    if all(h is unified for h in (memory, pids, cpu)):
        return "v2", roles
    return ("hybrid" if unified is not None else "v1"), roles


def _validate_name(name: str, what: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"{what} {name!r} is not 1-64 of [a-z0-9-]: pick another name")


# ---------------------------------------------------------------- public API


@final
class CgroupLayout:
    """Where each controller lives on this host, and the base group of every sandbox. Detect once at start-up."""

    def __init__(self, base_name: str, mode: Mode, roles: _Roles) -> None:
        self.base_name = base_name
        self.mode: Mode = mode
        self._roles = roles

    @classmethod
    def detect(cls, base_name: str = "bastion") -> CgroupLayout:
        """Find the hierarchies, pick the parent, and create the base group in each.

        Args:
            base_name: the folder under the parent that holds every sandbox group.

        Returns:
            The layout; its base groups exist.

        Raises:
            Unavailable: a controller is missing, or no cgroup is writable by us.
        """
        _validate_name(base_name, "cgroup base name")
        try:
            with open("/proc/self/mountinfo", encoding="utf-8") as f:
                mounts = _parse_mountinfo(f.read())
            with open("/proc/self/cgroup", encoding="utf-8") as f:
                own = _parse_self_cgroup(f.read())
        except OSError as exc:
            raise Unavailable(f"cannot read /proc/self: {exc.strerror}; is /proc mounted?") from exc
        created: list[str] = []
        try:
            mode, roles = _discover(base_name, mounts, own, created)
        except BaseException as exc:
            for path in reversed(created):  # leave no half-made layout behind
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            if isinstance(exc, (NotFound, OperationFailed)):
                raise Unavailable(exc.reason, detail=exc.detail) from exc
            raise
        return cls(base_name, mode, roles)

    @property
    def locations(self) -> Mapping[str, str]:
        """The base folder serving each role: memory, pids, cpu, cpu_usage, freeze, and kill when cgroup.kill exists."""
        r = self._roles
        out = {"memory": r.memory.base, "pids": r.pids.base, "cpu": r.cpu.base}
        out |= {"cpu_usage": r.cpu_usage.base, "freeze": r.freeze.base}
        if r.cgroup_kill and r.unified is not None:
            out["kill"] = r.unified.base
        return out

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

    def __init__(self, name: str, roles: _Roles) -> None:
        self.name = name
        self._roles = roles

    @property
    def paths(self) -> tuple[str, ...]:
        """The group's folder in each hierarchy, the v2 one first."""
        return tuple(h.group(self.name) for h in self._roles.all)

    def _file(self, h: _Hierarchy, filename: str) -> str:
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
                _write_raw(path, str(pid))
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
            _write(
                self._file(r.memory, "memory.max"), "max" if limits.memory_bytes is None else str(limits.memory_bytes)
            )
            swap = self._file(r.memory, "memory.swap.max")
            if os.path.exists(swap):
                _write(swap, "0")
        else:
            _write(self._file(r.memory, "memory.limit_in_bytes"), str(limits.memory_bytes or -1))
            # v1: swappiness 0 keeps the group's anonymous memory in RAM; best-effort, some kernels refuse it.
            with contextlib.suppress(OSError):
                _write_raw(self._file(r.memory, "memory.swappiness"), "0")
        _write(self._file(r.pids, "pids.max"), "max" if limits.pids is None else str(limits.pids))
        if r.cpu.version == 2:
            _write(self._file(r.cpu, "cpu.max"), f"{'max' if quota is None else quota} {CPU_PERIOD_US}")
        else:
            _write(self._file(r.cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _write(self._file(r.cpu, "cpu.cfs_quota_us"), str(-1 if quota is None else quota))

    def usage(self) -> Usage:
        """Current memory (bytes, page cache included), task count, cumulative CPU time (µs), and frozen state."""
        r = self._roles
        if r.memory.version == 2:
            memory = int(_read(self._file(r.memory, "memory.current")))
        else:
            memory = int(_read(self._file(r.memory, "memory.usage_in_bytes")))
        pids = int(_read(self._file(r.pids, "pids.current")))
        if r.cpu_usage.version == 2:
            cpu_usec = _keyed(_read(self._file(r.cpu_usage, "cpu.stat"))).get("usage_usec", 0)
        else:
            cpu_usec = int(_read(self._file(r.cpu_usage, "cpuacct.usage"))) // 1000  # ns
        return Usage(memory, pids, cpu_usec, self._frozen())

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this group (memory limit hit)."""
        r = self._roles
        name = "memory.events" if r.memory.version == 2 else "memory.oom_control"
        return _keyed(_read(self._file(r.memory, name))).get("oom_kill", 0)

    def pids(self) -> list[int]:
        """Every process in the group, in any hierarchy."""
        found: set[int] = set()
        for h in self._roles.all:
            found.update(_procs(h.group(self.name)))
        return sorted(found)

    def _frozen(self) -> bool:
        h = self._roles.freeze
        if h.version == 2:
            return _keyed(_read(self._file(h, "cgroup.events"))).get("frozen") == 1
        return _read(self._file(h, "freezer.state")).strip() == "FROZEN"

    def _set_frozen(self, frozen: bool) -> None:
        h = self._roles.freeze
        if h.version == 2:
            _write(self._file(h, "cgroup.freeze"), "1" if frozen else "0")
            done = _wait_events(h.group(self.name), "frozen", 1 if frozen else 0, FREEZE_WAIT_S)
        else:
            want = "FROZEN" if frozen else "THAWED"
            _write(self._file(h, "freezer.state"), want)
            done = _poll_until(lambda: _read(self._file(h, "freezer.state")).strip() == want, FREEZE_WAIT_S)
        if not done:
            verb = "freeze" if frozen else "thaw"
            raise Timeout(
                f"cgroup {self.name} did not {verb} within {FREEZE_WAIT_S} s: a task may be in uninterruptible sleep"
            )

    def freeze(self) -> None:
        """Stop every process in the group (they keep their memory), waiting until the kernel reports it frozen.

        Raises:
            Timeout: not frozen within FREEZE_WAIT_S.
        """
        self._set_frozen(True)

    def thaw(self) -> None:
        """Let a frozen group run again."""
        self._set_frozen(False)

    def _empty(self) -> bool:
        unified = self._roles.unified
        if unified is not None and _keyed(_read_or_empty(self._file(unified, "cgroup.events"))).get("populated", 0):
            return False
        return not any(_procs(h.group(self.name)) for h in self._roles.all if h.version == 1)

    def _wait_empty(self, timeout_s: float) -> bool:
        unified = self._roles.unified
        deadline = time.monotonic() + timeout_s
        if unified is not None and not _wait_events(unified.group(self.name), "populated", 0, timeout_s):
            return False
        return _poll_until(self._empty, max(0.0, deadline - time.monotonic()))

    def _kill_each(self) -> None:
        """Freeze, SIGKILL each pid, thaw: frozen processes cannot fork or exit, so no pid is missed or reused."""
        # A half-created group, or a stuck task, must not stop us signalling what we can see.
        with contextlib.suppress(NotFound, Timeout):
            self._set_frozen(True)
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
                _write(self._file(r.unified, "cgroup.kill"), "1")
            if self._wait_empty(KILL_WAIT_S / 2):
                return
        self._kill_each()
        if not self._wait_empty(KILL_WAIT_S):
            raise OperationFailed(
                f"cgroup {self.name} still has processes {KILL_WAIT_S} s after SIGKILL",
                detail=f"pids: {self.pids()}",
            )

    def destroy(self) -> None:
        """Kill everything in the group, then remove it from every hierarchy. Safe to call twice.

        Raises:
            OperationFailed: the group could not be emptied or removed in time.
        """
        self.kill()
        deadline = time.monotonic() + DESTROY_WAIT_S
        for path in self.paths:
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


def _read_or_empty(path: str) -> str:
    try:
        return _read(path)
    except NotFound:
        return ""


def _poll_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(V1_POLL_INTERVAL_S)
    return True
