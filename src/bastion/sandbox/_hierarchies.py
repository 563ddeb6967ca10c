"""Where each cgroup controller lives on this host, and the base groups of the sandboxes. DANGEROUS.

Where each controller lives is read from ``/proc/self/mountinfo``, never guessed.
The parent is the server's own cgroup (``/proc/self/cgroup``) when it was
delegated to us (systemd ``Delegate=yes``: owned by our unprivileged uid, or
marked with the ``trusted.delegate``/``user.delegate`` xattr), else the hierarchy
root when we are root.

`CgroupLayout.detect` runs this once at start-up: it creates ``<parent>/<base_name>``
in each hierarchy, enables memory, pids and cpu for it on cgroup v2, and may move
the server's own processes into a leaf ``<parent>/<base_name>-server`` to do so.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Final, Literal

from bastion.safety.errors import Unavailable
from bastion.sandbox._cgroupfs import procs, read_file, write_raw

Mode = Literal["v2", "hybrid", "v1"]
"""How this host's cgroups are laid out (`cgroups.CgroupLayout.mode`)."""

RESOURCE_CONTROLLERS: Final = ("memory", "pids", "cpu")
V1_CONTROLLERS: Final = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer"})
DELEGATE_XATTRS: Final = ("trusted.delegate", "user.delegate")  # set by systemd >= 251 / 253 on Delegate=yes

_OCTAL_ESCAPE_RE: Final = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class _Mount:
    root: str
    point: str
    fstype: str
    super_options: frozenset[str]


@dataclass(frozen=True)
class Hierarchy:
    version: Literal[1, 2]
    base: str  # absolute path of <parent>/<base_name>

    def group(self, name: str) -> str:
        return os.path.join(self.base, name)


@dataclass(frozen=True)
class Roles:
    memory: Hierarchy
    pids: Hierarchy
    cpu: Hierarchy
    cpu_usage: Hierarchy
    freeze: Hierarchy
    unified: Hierarchy | None
    cgroup_kill: bool
    all: tuple[Hierarchy, ...]  # the v2 one first: it is the kill boundary


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[_Mount]:
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


def parse_self_cgroup(text: str) -> dict[str, str]:
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


def own_dir(mount: _Mount, own_path: str | None) -> str | None:
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
    own = own_dir(mount, own_path)
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
    available = set(read_file(os.path.join(parent, "cgroup.controllers")).split())
    missing = [c for c in RESOURCE_CONTROLLERS if c not in available]
    if missing:
        raise Unavailable(
            f"cgroup {parent} lacks the {' '.join(missing)} controller(s): enable them (systemd Delegate=yes)"
        )
    control = os.path.join(parent, "cgroup.subtree_control")
    wanted = " ".join(f"+{c}" for c in RESOURCE_CONTROLLERS)
    try:
        write_raw(control, wanted)
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
        pids = procs(parent)
        if not pids:
            break
        for pid in pids:
            try:
                write_raw(os.path.join(leaf, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                continue
            except OSError as exc:
                raise Unavailable(f"cannot move pid {pid} into leaf cgroup {leaf}: {exc.strerror}") from exc
    try:
        write_raw(control, wanted)
    except OSError as exc:
        raise Unavailable(f"cannot enable controllers in {control}: {exc.strerror}") from exc


def discover(base_name: str, mounts: list[_Mount], own: dict[str, str], created: list[str]) -> tuple[Mode, Roles]:
    """Pick a hierarchy per role and make the base groups, appending each new folder to ``created``."""
    v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v1_mounts: dict[str, _Mount] = {}
    for mount in mounts:
        if mount.fstype == "cgroup":
            for controller in sorted(mount.super_options & V1_CONTROLLERS):
                v1_mounts.setdefault(controller, mount)
    v2_controllers: set[str] = set()
    if v2_mount is not None:
        v2_controllers = set(read_file(os.path.join(v2_mount.point, "cgroup.controllers")).split())
    v2_has_all = all(c in v2_controllers for c in RESOURCE_CONTROLLERS)
    built: dict[str, Hierarchy] = {}  # mount point -> hierarchy

    def hierarchy(mount: _Mount) -> Hierarchy:
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
                write_raw(os.path.join(base, "cgroup.subtree_control"), "+memory +pids +cpu")
            except OSError as exc:
                raise Unavailable(f"cannot enable controllers under {base}: {exc.strerror}") from exc
        built[mount.point] = Hierarchy(2 if v2 else 1, base)
        return built[mount.point]

    def place(controller: str) -> Hierarchy:
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
    roles = Roles(memory, pids, cpu, cpu_usage, freeze, unified, cgroup_kill, tuple(ordered))
    if all(h is unified for h in (memory, pids, cpu)):
        return "v2", roles
    return ("hybrid" if unified is not None else "v1"), roles
