"""`bastion doctor`: what this machine and this config will enforce, checked before an agent connects.

Each check is one line: ``ok``, ``warn`` or ``FAIL``, its name, and what it means or how to fix
it. FAIL means the server would refuse to start, or a sandbox cannot start. The checks are real,
not guessed from versions: bubblewrap runs, the seccomp filter compiles, the cgroup layout is
detected as `build_services` detects it, and one sandbox starts through the server's own
`SandboxManager`, runs a command and a canary the kernel must refuse, and is closed.

Side effects, all undone: a temporary file in the audit log's folder (written, fsynced, removed);
one sandbox under a temporary state folder, with its cgroup and, with a disk quota, its mounted
filesystem (all removed, and checked gone). `CgroupLayout.detect` leaves the empty base groups
the server itself makes and keeps. Nothing secret is printed: no password hash, no key material.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

from bastion.app import check_disk_quota, detect_cgroups, identity_problem, state_problem
from bastion.config import Config, GatewayConfig, WorkspaceConfig, load_config, resolve_config_path
from bastion.organizer.folder import Folder
from bastion.safety.audit import open_problem
from bastion.safety.errors import BastionError, ConfigError
from bastion.safety.paths import secret_file_problem
from bastion.safety.redact import Redactor
from bastion.sandbox import idmap_supported
from bastion.sandbox._spawn import SANDBOX_WORKSPACE, bwrap_path, probe_bwrap, sandbox_python, system_binds
from bastion.sandbox.cgroups import CgroupLayout, owner_pid
from bastion.sandbox.inside.landlock import landlock_abi, landlock_missing  # the agent's own wording
from bastion.sandbox.microvm import MicroVMSettings, boot_files_problem, missing_boot_files, probe_microvm
from bastion.sandbox.seccomp import DENIED, write_filter_fd
from bastion.serve import is_loopback, tls_cert_problem, tls_key_problem
from bastion.transports.http.observe import scrape_token_problem
from bastion.workbench.manager import SandboxManager
from bastion.workbench.workspace import HostWorkspace, host_workspace_problem

Status = Literal["ok", "warn", "FAIL"]

RUN_TIMEOUT_S: Final = 10.0
_MAX_OUTPUT_BYTES: Final = 4096
_CLONE_NEWUSER: Final = 0x10000000
CANARY_FILE: Final = ".bastion-doctor-canary"
# Run inside the sandbox by its Python: all must be refused by the kernel. unshare(CLONE_NEWUSER)
# succeeds there without the seccomp filter; mkdir / succeeds without Landlock (bwrap's / is a
# tmpfs the sandbox owns). The directory, if made, lives in that tmpfs and dies with the sandbox.
# chmod 04755 of its own file succeeds without the mode filter; chmod of the host's /dev/null
# succeeds when the sandbox is the host's root (0666 is its mode already: allowed, it changes nothing).
CANARY: Final = f"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {{"unshare": "allowed" if libc.unshare({_CLONE_NEWUSER}) == 0 else errno.errorcode[ctypes.get_errno()]}}
def attempt(name, call, *args):
    try:
        call(*args)
        out[name] = "allowed"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
attempt("mkdir", os.mkdir, "/bastion-doctor-canary")
open("/workspace/{CANARY_FILE}", "w").close()
attempt("setuid", os.chmod, "/workspace/{CANARY_FILE}", 0o4755)
attempt("dev-null", os.chmod, "/dev/null", 0o666)
print(json.dumps(out))
"""
_DO_NOT_CONNECT: Final = "do not connect an agent to this server"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    check: str
    status: Status
    detail: str


def run_doctor(config_arg: str | None, *, as_json: bool = False) -> int:
    """Run every check, print the report, and return the exit status (1 if any FAIL)."""
    checks = run_checks(config_arg)
    print(render_json(checks) if as_json else render_text(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def run_checks(config_arg: str | None) -> list[Check]:
    """The checks in report order. The kernel's are made even when the config does not load."""
    config, path, loaded = _load(config_arg)
    checks = [loaded, *_bwrap_checks(), _landlock_check(), _seccomp_check()]
    if config is None:
        return checks
    secrets = config.exposed_secrets()
    if secrets is not None:
        checks.insert(1, Check("config-secrets", "warn", secrets))
    cgroups, cgroup_check = _cgroup_check(config)
    checks.append(cgroup_check)
    checks += _quota_checks(config)
    file_table = _file_table_check(config)
    if file_table is not None:
        checks.append(file_table)
    checks += _identity_checks(config)
    git = _git_check(config)
    if git is not None:
        checks.append(git)
    state = _state_check(config)
    checks.append(state)
    if state.status == "ok":  # no test file is written where someone else could swap the folder
        checks.append(_audit_check(config))
        checks.append(_audit_room_check(config))
    checks += _sandbox_checks(config, cgroups, ready=not any(c.status == "FAIL" for c in checks))
    checks.append(_microvm_check(config))
    checks += _http_checks(config, path)
    token = _metrics_token_check(config)
    if token is not None:
        checks.append(token)
    checks += [_gateway_check(gateway) for gateway in config.gateway]
    return checks


def render_text(checks: list[Check]) -> str:
    width = max(len(c.check) for c in checks)
    lines = [f"{c.status:<4}  {c.check:<{width}}  {c.detail}" for c in checks]
    failed = sum(c.status == "FAIL" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    if failed:
        lines.append(f"bastion doctor: {failed} FAIL, {warned} warn: fix each FAIL before connecting an agent")
    else:
        lines.append(f"bastion doctor: no FAIL, {warned} warn: each warn names what is not enforced")
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    return json.dumps([dataclasses.asdict(c) for c in checks], indent=2)


# -- config and kernel -----------------------------------------------------------------------


def _load(config_arg: str | None) -> tuple[Config | None, str, Check]:
    try:
        path = resolve_config_path(config_arg)
        config = load_config(path)
    except ConfigError as exc:
        return None, "", Check("config", "FAIL", str(exc))
    return config, path, Check("config", "ok", f"{os.path.abspath(path)} loads")


def _bwrap_checks() -> list[Check]:
    try:
        path = bwrap_path()
        _, version = probe_bwrap(["--version"])
    except BastionError as exc:
        return [Check("bwrap", "FAIL", f"{exc.reason}: no command or sandbox can run")]
    return [Check("bwrap", "ok", f"{version or 'bubblewrap (version unknown)'} at {path}"), userns_check()]


def userns_check() -> Check:
    """Whether bwrap can make a user namespace and run a command in it."""
    try:
        # The system folders a sandbox sees, not the host's whole root: bwrap remounts each mount under a
        # bound folder read-only, and on a busy host (sandboxes starting and ending) one gone meanwhile made
        # the probe fail ("Can't bind mount /oldroot/ on /newroot/").
        status, last = probe_bwrap(["--unshare-user", *system_binds(), "true"])
    except BastionError as exc:
        status, last = -1, exc.reason
    if status == 0:
        return Check("userns", "ok", "user namespaces work: 'bwrap --unshare-user' ran a command")
    why = last or f"exit status {status}"
    fix = (
        "allow user namespaces (sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also "
        "kernel.unprivileged_userns_clone = 1, or kernel.apparmor_restrict_unprivileged_userns = 0)"
    )
    return Check("userns", "FAIL", f"'bwrap --unshare-user' failed ({why}): {fix}")


def _landlock_check() -> Check:
    abi = landlock_abi()
    if abi == 0:
        return Check(
            "landlock",
            "warn",
            "not applied (kernel has no Landlock, or it is left out of the boot's lsm= list): only the bubblewrap "
            "namespaces and seccomp confine a sandbox, and a command may write anywhere bubblewrap left writable",
        )
    missing = landlock_missing(abi)
    if missing:
        return Check("landlock", "warn", f"landlock ABI {abi}: " + "; ".join(missing))
    return Check(
        "landlock",
        "ok",
        f"ABI {abi}: commands write only beneath /workspace, /tmp and /dev/shm (and to /dev/null, the terminals...);"
        " signals and sockets scoped",
    )


def _seccomp_check() -> Check:
    try:
        fd = write_filter_fd()
    except (BastionError, OSError) as exc:
        reason = exc.reason if isinstance(exc, BastionError) else str(exc)
        return Check("seccomp", "FAIL", f"{reason}: no sandbox can start without its filter (install libseccomp2)")
    os.close(fd)
    names = len({denial.syscall for denial in DENIED})
    return Check("seccomp", "ok", f"the filter compiles: {names} syscalls are refused in every sandbox")


# -- resources -------------------------------------------------------------------------------


def _cgroup_check(config: Config) -> tuple[CgroupLayout | None, Check]:
    """The server's own decision (`detect_cgroups`), explained."""
    try:
        layout = detect_cgroups(config)
    except ConfigError as exc:
        return None, Check("cgroups", "FAIL", str(exc))
    if layout is None:
        return None, Check(
            "cgroups",
            "warn",
            "not used (sandboxes off, use_cgroups = false): commands run without memory/pids/CPU limits",
        )
    mode = {"v2": "cgroup v2", "hybrid": "hybrid (limits in cgroup v1, freezer in v2)", "v1": "cgroup v1"}[layout.mode]
    kill = "cgroup.kill" if layout.has_cgroup_kill else "freeze, then SIGKILL each process"
    detail = f"{mode}: memory, pids and CPU limits apply; a sandbox's whole tree is stopped by {kill}"
    unlimited = [ws.id for ws in config.workspace if not ws.use_cgroups]
    if unlimited:
        return layout, Check(
            "cgroups", "warn", f"{detail}; but NOT for workspace {', '.join(unlimited)} (use_cgroups = false)"
        )
    return layout, Check("cgroups", "ok", detail)


def _git_check(config: Config) -> Check | None:
    """Which host workspaces are git repositories, and whether their `.git` is the agent's to write
    (`protect_git`): git runs the hooks and config programs there as whoever next runs git in the folder."""
    repos = [ws for ws in config.workspace if os.path.lexists(os.path.join(ws.path, ".git"))]
    if not repos:
        return None
    open_to_agent = [ws.id for ws in repos if not ws.protect_git]
    linked = [ws.id for ws in repos if ws.protect_git and os.path.islink(os.path.join(ws.path, ".git"))]
    if open_to_agent or linked:
        parts = []
        if open_to_agent:
            parts.append(f"workspace {', '.join(open_to_agent)}: .git is the agent's to write (protect_git = false)")
        if linked:
            parts.append(f"workspace {', '.join(linked)}: .git is a symbolic link, which is not protected")
        return Check("git", "warn", "; ".join(parts) + ": git there runs the hooks and config programs it writes")
    names = ", ".join(ws.id for ws in repos)
    return Check("git", "ok", f"the .git of workspace {names} is read-only to agents (protect_git)")


def _quota_checks(config: Config) -> list[Check]:
    """The server's own decision (`check_disk_quota`), explained."""
    sandboxes = config.sandboxes
    if not sandboxes.enabled:
        return []
    if not sandboxes.disk_quota:
        why = "off ([sandboxes] disk_quota = false): /workspace is a plain folder; one sandbox can fill the disk"
        return [Check("disk-quota", "warn", why)]
    try:
        check_disk_quota(config)
    except ConfigError as exc:
        return [Check("disk-quota", "FAIL", str(exc))]
    size = _size(sandboxes.limits.disk_bytes)
    quota = Check("disk-quota", "ok", f"each sandbox's /workspace is a filesystem of {size}: writes past it fail")
    return [quota, _state_room_check(config)]


_FILE_MAX: Final = "/proc/sys/fs/file-max"
_LONG_MAX: Final = (1 << 63) - 1
_BYTES_PER_OPEN_FILE: Final = 384  # what an open file (O_PATH) cost a sandbox's memory cgroup here: the fewest


def _file_table_check(config: Config) -> Check | None:
    """Whether the sandboxes, within their memory limits, could fill the host's table of open files: one
    count for the whole host (fs.file-max), in no namespace; past it, opens fail for the other sandboxes and
    for every host process without CAP_SYS_ADMIN (the server keeps it). systemd 240+ raises it at boot."""
    sandboxes = config.sandboxes
    if not sandboxes.enabled:
        return None
    try:
        with open(_FILE_MAX, encoding="ascii") as file:
            file_max = int(file.read())
    except (OSError, ValueError) as exc:
        return Check("file-table", "warn", f"{_FILE_MAX} cannot be read: {exc}")
    per_sandbox = sandboxes.limits.memory_bytes // _BYTES_PER_OPEN_FILE
    needed = sandboxes.max_sandboxes * per_sandbox
    memory = _size(sandboxes.limits.memory_bytes)
    summary = f"{sandboxes.max_sandboxes} sandboxes x {memory} of memory can hold {needed:,} open files"
    if needed <= file_max:
        return Check("file-table", "ok", f"{summary}: the host's fs.file-max is {file_max:,}")
    return Check(
        "file-table",
        "warn",
        f"{summary}, more than the host's fs.file-max of {file_max:,}: past it, opens fail in the other "
        "sandboxes and host services; raise it as systemd 240+ does at boot (sysctl -w "
        f"fs.file-max={_LONG_MAX}) or lower memory_bytes or max_sandboxes",
    )


def _state_room_check(config: Config) -> Check:
    """Whether every sandbox's disk and the snapshots allowed fit on the state filesystem. The images are
    sparse: disks that do not fit let one agent fill that filesystem, and the audit log too if it is there
    (SECURITY.md). Snapshots count: each passes the reserve when it is taken, and the disks filled after it
    then found the room gone (found by attack: sized for the disks and the reserve alone, two snapshots and
    two full disks left the state filesystem with 0 bytes free and every call AUDIT_UNAVAILABLE)."""
    sandboxes = config.sandboxes
    count = sandboxes.max_sandboxes + sandboxes.warm_pool
    needed = count * sandboxes.limits.disk_bytes + sandboxes.snapshot_bytes + sandboxes.state_reserve_bytes
    folder = _existing_ancestor(config.sandboxes_dir)
    try:
        st = os.statvfs(folder)
        shared = os.stat(folder).st_dev == os.stat(_existing_ancestor(config.audit_path.parent)).st_dev
    except OSError as exc:
        return Check("state-room", "warn", f"{folder} cannot be examined: {exc.strerror or exc}")
    free = st.f_bavail * st.f_frsize
    summary = (
        f"{count} sandboxes x {_size(sandboxes.limits.disk_bytes)} + {_size(sandboxes.snapshot_bytes)} of "
        f"snapshots + the {_size(sandboxes.state_reserve_bytes)} reserve = {_size(needed)}"
    )
    if needed <= free:
        return Check("state-room", "ok", f"{summary}: fits in the {_size(free)} free under {folder}")
    harm = (
        "which holds the audit log too: one agent filling its disk can stop every call"
        if shared
        else "so one agent filling its disk can stop the others' disk writes"
    )
    fix = (
        "give it more room, lower disk_bytes, max_sandboxes or max_snapshot_bytes, or move [audit] path to "
        "another filesystem"
    )
    return Check("state-room", "warn", f"{summary}, more than the {_size(free)} free under {folder}, {harm}: {fix}")


def _identity_checks(config: Config) -> list[Check]:
    """Who sandboxes and host workspaces are on the host; the server's own decision (`open_identities`)."""
    if os.geteuid() != 0:
        detail = (
            f"the server runs as uid {os.geteuid()}: every sandbox and host workspace acts as that user, never root"
        )
        return [Check("identity", "ok", detail)]
    problem = identity_problem(config)
    if problem is not None:
        return [Check("identity", "FAIL", problem)]
    first, count = config.sandboxes.host_ids
    detail = (
        f"sandboxes and host workspaces run as uids {first}-{first + count - 1}, one each, never root; "
        "no account or subordinate range is in that range"
    )
    return [
        Check("identity", "ok", detail),
        *(_idmap_check(ws) for ws in config.workspace),
        *(_inbox_check(inbox.id, inbox.path) for inbox in config.inbox),
    ]


def _inbox_check(inbox_id: str, path: Path) -> Check:
    """Whether a root server's organizer will open an inbox (`Folder`: no link on its path, nobody else able to
    replace it or, root-owned, to write it)."""
    name = f"inbox:{inbox_id}"
    try:
        Folder(path).close()
    except BastionError as exc:
        return Check(name, "FAIL", exc.reason)
    return Check(name, "ok", f"{path}: only root and its owner can replace it; the organizer acts as its owner")


def _idmap_check(workspace: WorkspaceConfig) -> Check:
    """How a root server will bind a host workspace (as `workspaces._open_host`, whose folder checks it runs);
    probed with a real idmapped mount."""
    name, path = f"idmap:{workspace.id}", workspace.path
    problem = host_workspace_problem(workspace)
    if problem is not None:
        return Check(name, "FAIL", problem)
    reason = idmap_supported(path)
    if reason is None:
        return Check(name, "ok", f"{path} is bound through an idmapped mount: commands' files are its owner's")
    try:
        owner = path.stat().st_uid
    except OSError as exc:
        return Check(name, "FAIL", f"{path} cannot be examined: {exc.strerror}")
    if owner == 0:
        return Check(name, "FAIL", f"{path} is root's and idmapped mounts are unavailable ({reason}): chown it")
    return Check(name, "warn", f"no idmapped mount ({reason}): commands run as the folder's owner, uid {owner}")


def _size(count: int) -> str:
    return f"{count / 1024**3:.4g} GiB" if count >= 1024**3 else f"{count / 1024**2:.4g} MiB"


# -- state folder and audit log --------------------------------------------------------------


def _state_check(config: Config) -> Check:
    """The server's own refusal (`state_problem`): a state folder or audit folder another user could replace."""
    problem = state_problem(config)
    if problem is not None:
        return Check("state", "FAIL", problem)
    who = "root" if os.geteuid() == 0 else f"root and uid {os.geteuid()}"
    detail = f"{config.state_dir} and the audit log's folder: only {who} can replace them or a folder above"
    return Check("state", "ok", detail)


def _audit_check(config: Config) -> Check:
    path = config.audit_path
    folder, note = path.parent, ""
    if not folder.is_dir():
        if folder != config.state_dir:
            return Check("audit", "FAIL", f"audit log folder {folder} does not exist: create it or fix [audit] path")
        # build_services makes the state folder: test where it will be made.
        folder, note = _existing_ancestor(folder), f" ({folder} is made at start)"
    try:
        _write_and_fsync(folder)
    except OSError as exc:
        return Check("audit", "FAIL", f"cannot write and fsync a file in {folder}: {exc.strerror or exc}")
    problem = open_problem(path)
    if problem is not None:
        return Check("audit", "FAIL", problem)
    if not config.audit.fail_closed:
        return Check("audit", "warn", f"{path}: writable, but fail_closed = false: operations may run unrecorded")
    return Check("audit", "ok", f"{path}: its folder is writable and fsync works{note}")


AUDIT_ROOM_BURSTS: Final = 4
"""Callers' bursts the audit log's filesystem should hold: a client spends its burst in seconds, and a full
audit filesystem stops every call (found by attack, twenty-sixth session: 64 MiB filled a 48 MiB one in 5 s)."""


def _audit_room_check(config: Config) -> Check:
    """Whether the audit log's free space holds a few callers' audit bursts (`[audit] caller_burst_bytes`)."""
    folder = _existing_ancestor(config.audit_path.parent)
    burst = config.audit.caller_burst_bytes
    try:
        st = os.statvfs(folder)
    except OSError as exc:
        return Check("audit-room", "warn", f"{folder} cannot be examined: {exc.strerror or exc}")
    free = st.f_bavail * st.f_frsize
    summary = f"{AUDIT_ROOM_BURSTS} callers' audit bursts of {_size(burst)} ([audit] caller_burst_bytes)"
    if AUDIT_ROOM_BURSTS * burst <= free:
        return Check("audit-room", "ok", f"{summary} fit in the {_size(free)} free under {folder}")
    return Check(
        "audit-room",
        "warn",
        f"{summary} are more than the {_size(free)} free under {folder}: one client can fill it in seconds, and "
        "then every call is refused: lower caller_burst_bytes or give the audit log more room",
    )


def _existing_ancestor(path: Path) -> Path:
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def _write_and_fsync(folder: Path) -> None:
    """Create (O_EXCL, 0600), write, fsync and remove a file of our own; the real log is not touched."""
    fd, name = tempfile.mkstemp(prefix=".bastion-doctor-", dir=folder)
    try:
        os.write(fd, b"bastion doctor\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(name)


def _microvm_check(config: Config) -> Check:
    """Which isolation the templates ask for, and whether a microVM boots here (a tiny KVM guest, with a timeout)."""
    names = [t.name for t in config.template if t.isolation == "microvm"]
    if not names:
        return Check("microvm", "ok", "no template asks for a microVM: every sandbox is isolation = namespaces")
    which = ", ".join(names)
    vm = config.sandboxes.microvm
    settings = MicroVMSettings(vm.image_dir, accel="kvm", boot_timeout_s=vm.probe_timeout_s)
    missing = missing_boot_files(settings) or boot_files_problem(vm.image_dir)
    if missing is not None:
        return Check("microvm", "FAIL", f"templates {which} are refused: {missing}")
    reason = asyncio.run(probe_microvm(settings, vm.probe_timeout_s))
    if reason is None:
        return Check("microvm", "ok", f"a KVM guest boots: templates {which} run as microVMs")
    if vm.allow_emulation:
        return Check("microvm", "warn", f"{reason}: templates {which} run under software emulation (slow)")
    return Check("microvm", "FAIL", f"{reason}: templates {which} are refused (or set allow_emulation = true)")


# -- one real sandbox ------------------------------------------------------------------------


def _sandbox_checks(config: Config, cgroups: CgroupLayout | None, *, ready: bool) -> list[Check]:
    if not config.sandboxes.enabled:
        return [Check("sandboxes", "ok", "disabled ([sandboxes] enabled = false): create_sandbox is refused")]
    if not ready:
        return [Check("sandbox", "warn", "not started: fix the FAIL lines above first")]
    with tempfile.TemporaryDirectory(prefix="bastion-doctor-") as state, _quiet_logs() as errors:
        # The sandbox's own id passes through it, as through the server's state folder (0711).
        os.chmod(state, 0o711)  # noqa: S103 - passable, not listable
        checks = asyncio.run(_probe(config, cgroups, Path(state)))
    if errors:
        checks.append(Check("sandbox-log", "FAIL", "; ".join(errors)))
    return checks


class _ErrorCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage())


@contextlib.contextmanager
def _quiet_logs() -> Iterator[list[str]]:
    """Collect what bastion logs meanwhile: warnings repeat the checks above; errors are reported."""
    handler = _ErrorCollector()
    logger = logging.getLogger("bastion")
    logger.addHandler(handler)
    try:
        yield handler.errors
    finally:
        logger.removeHandler(handler)


async def _probe(config: Config, cgroups: CgroupLayout | None, state: Path) -> list[Check]:
    """Start one sandbox as create_sandbox does, under `state`; run `true` and the canary; close it."""
    # The server's config, with its own state folder and no warm pool (one sandbox, made here).
    probe_config = config.model_copy(
        update={"state_dir": state, "sandboxes": config.sandboxes.model_copy(update={"warm_pool": 0})}
    )
    redactor = Redactor(extra_patterns=config.redaction.patterns, secret_values=config.secret_values())
    manager = SandboxManager(probe_config, redactor, cgroups)
    groups_before = set(cgroups.existing()) if cgroups is not None else set()
    children_before = set(child_pids())  # a caller's own children are not the sandbox's
    started = time.monotonic()
    try:
        box = await manager.create(owner="bastion-doctor", network_allow=())
        start_ms = (time.monotonic() - started) * 1000
        checks = await _run_in(box.workspace)
        checks.append(_owner_check(box.root / "workspace" / CANARY_FILE))
    except (BastionError, OSError) as exc:
        reason = exc.reason if isinstance(exc, BastionError) else str(exc)
        checks = [Check("sandbox", "FAIL", f"a sandbox cannot start: {reason}")]
        start_ms = None
    finally:
        manager.close_all()
    left = leftovers(cgroups, groups_before, probe_config.sandboxes_dir, children_before)
    if left:
        return [*checks, Check("cleanup", "FAIL", f"closing the sandbox left {left}: report this as a bug")]
    if start_ms is not None and checks[0].status == "ok":
        detail = f"started in {start_ms:.0f} ms, {checks[0].detail}; closed, leaving no process, cgroup or file"
        checks[0] = Check("sandbox", "ok", detail)
    return checks


async def _run_in(workspace: HostWorkspace) -> list[Check]:
    warm, env = workspace.sandbox, workspace.environment()
    done = await warm.run(
        "/bin/true",
        ["true"],
        cwd=SANDBOX_WORKSPACE,
        env=env,
        timeout_s=RUN_TIMEOUT_S,
        max_output_bytes=_MAX_OUTPUT_BYTES,
    )
    if done.status != 0:
        tail = done.stderr.decode(errors="replace").strip()
        ran = Check("sandbox", "FAIL", f"'true' exited {done.status} in a sandbox: {tail or 'no message'}")
    else:
        ran = Check("sandbox", "ok", "'true' exited 0")
    python = sandbox_python()
    canary = await warm.run(
        python,
        [python, "-I", "-S", "-c", CANARY],
        cwd=SANDBOX_WORKSPACE,
        env=env,
        timeout_s=RUN_TIMEOUT_S,
        max_output_bytes=_MAX_OUTPUT_BYTES,
    )
    try:
        result = json.loads(canary.stdout)
    except ValueError:
        result = None
    if not isinstance(result, dict):
        lines = canary.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1] if lines else f"exit status {canary.status}"
        return [ran, Check("canary", "FAIL", f"the canary did not run ({why}): {_DO_NOT_CONNECT} until it does")]
    return [ran, canary_check({str(k): str(v) for k, v in result.items()})]


def _owner_check(made: Path) -> Check:
    """Whose, on the host, is a file the canary made: never root's."""
    try:
        owner = os.lstat(made).st_uid
    except OSError as exc:
        return Check("sandbox-owner", "FAIL", f"the canary's file is not on the host ({exc.strerror}): report this")
    if owner == 0:
        why = "files a sandbox makes are root's on the host: a sandbox acts as the host's root"
        return Check("sandbox-owner", "FAIL", f"{why}; {_DO_NOT_CONNECT}")
    return Check("sandbox-owner", "ok", f"files a sandbox makes are uid {owner}'s on the host, never root's")


def canary_check(result: dict[str, str]) -> Check:
    unshare, mkdir = result.get("unshare", "?"), result.get("mkdir", "?")
    setuid, dev_null = result.get("setuid", "?"), result.get("dev-null", "?")
    if setuid == "allowed":
        why = "a sandbox command set a setuid bit: the seccomp mode filter is NOT in force"
        return Check("canary", "FAIL", f"ALLOWED: {why}; {_DO_NOT_CONNECT}")
    if dev_null == "allowed":
        why = "a sandbox command changed the host's /dev/null: the sandbox acts as the node's owner (root)"
        return Check("canary", "FAIL", f"ALLOWED: {why}; {_DO_NOT_CONNECT}")
    if unshare == "allowed":
        why = "a sandbox command created a user namespace: the seccomp filter is NOT in force"
        return Check("canary", "FAIL", f"ALLOWED: {why}; {_DO_NOT_CONNECT}")
    if mkdir == "allowed" and landlock_abi() > 0:
        why = f"a sandbox command wrote outside /workspace and /tmp: Landlock (ABI {landlock_abi()}) is NOT in force"
        return Check("canary", "FAIL", f"ALLOWED: {why}; {_DO_NOT_CONNECT}")
    detail = f"unshare(CLONE_NEWUSER) -> {unshare}, mkdir / -> {mkdir}, chmod 04755 -> {setuid}"
    detail += f", chmod /dev/null -> {dev_null}"
    if mkdir == "allowed":
        return Check("canary", "warn", f"{detail}: seccomp refuses; writes are not confined (no Landlock)")
    if unshare != "EPERM":
        return Check("canary", "warn", f"{detail}: refused, but not with seccomp's EPERM: check the seccomp line")
    return Check("canary", "ok", f"refused by the kernel: {detail}")


def leftovers(
    cgroups: CgroupLayout | None, groups_before: set[str], sandboxes_dir: Path, children_before: set[int]
) -> str:
    """What the probe left: new cgroups of this process, anything in its sandboxes folder, new child processes.

    A group's name carries the pid of the process that made it (`sb-PID-N`, `vm-PID-N`): a server
    running beside the doctor makes and removes its own meanwhile, and they are not the probe's.
    """
    left = []
    if cgroups is not None:
        new = sorted(set(cgroups.existing()) - groups_before)
        left += [f"cgroup {name}" for name in new if owner_pid(name) == os.getpid()]
    with contextlib.suppress(FileNotFoundError):
        left += [f"folder {entry}" for entry in sorted(sandboxes_dir.iterdir())]
    left += [f"process {pid}" for pid in child_pids() if pid not in children_before]
    return ", ".join(left)


def child_pids() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children", encoding="ascii") as handle:
            pids += [int(pid) for pid in handle.read().split()]
    return pids


# -- HTTP and gateways -----------------------------------------------------------------------


def _http_checks(config: Config, path: str) -> list[Check]:
    """Only when the file has an [http] section: a stdio-only server needs none of this."""
    try:
        has_http = "http" in tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        has_http = True
    if not has_http:
        return []
    checks = [_http_auth_check(config, path), _http_url_check(config)]
    tls = _http_tls_check(config)
    return checks if tls is None else [checks[0], tls, checks[1]]


def _listen_host(listen: str) -> str:
    return listen.rpartition(":")[0].strip("[]")


def _http_auth_check(config: Config, path: str) -> Check:
    http = config.http
    if not http.auth:
        if not is_loopback(_listen_host(http.listen)):
            return Check("http-auth", "FAIL", "[http] auth = false is only allowed on a loopback listen address")
        return Check("http-auth", "warn", f"auth = false: anyone who reaches {http.listen} can call every tool")
    if config.admin_hash_path.exists():
        return Check("http-auth", "ok", "an admin password is set (serve --http asks it before approving a client)")
    how = f"'bastion admin set-password --config {path}' ('make run' sets one)"
    return Check("http-auth", "warn", f"no admin password is set: 'serve --http' refuses to start until you run {how}")


def _http_tls_check(config: Config) -> Check | None:
    cert, key = config.http.tls_cert, config.http.tls_key
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        return Check("http-tls", "FAIL", "[http] tls_cert and tls_key go together: set both or neither")
    # Judged before they are opened: a FIFO planted at either path would hang the open.
    problem = tls_key_problem(key) or tls_cert_problem(cert)
    if problem is not None:
        return Check("http-tls", "FAIL", problem)
    for name, file in (("tls_cert", cert), ("tls_key", key)):
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # opened, never read: no key material
        except OSError as exc:
            return Check("http-tls", "FAIL", f"{name} {file} cannot be read: {exc.strerror}")
        os.close(fd)
    return Check("http-tls", "ok", "tls_cert and tls_key are readable: serve --http speaks https itself")


def _metrics_token_check(config: Config) -> Check | None:
    """Serve's refusal of `[metrics] token_file`, judged without opening it (a FIFO there would hang us)."""
    token_file = config.metrics.token_file
    if token_file is None:
        return None
    problem = scrape_token_problem(token_file)
    if problem is not None:
        return Check("metrics-token", "FAIL", problem)
    return Check("metrics-token", "ok", f"{token_file} is the server's alone: /metrics wants its token")


def _http_url_check(config: Config) -> Check:
    http = config.http
    loopback_listen = is_loopback(_listen_host(http.listen))
    if http.public_url is None and not loopback_listen:
        return Check("http-url", "FAIL", '[http] public_url is not set: add it (e.g. "https://bastion.example.com")')
    url = http.public_url or f"http://{http.listen}"
    parts = urlsplit(url)
    if parts.scheme == "https":
        return Check("http-url", "ok", f"{url}: clients connect over https")
    if not is_loopback(parts.hostname or ""):
        return Check(
            "http-url", "warn", f"{url} is plain http on a network address: tokens cross it in clear; use https"
        )
    if not loopback_listen and http.tls_cert is None:
        why = f"listens on {http.listen} in plain http: put it behind a TLS proxy or set tls_cert/tls_key"
        return Check("http-url", "warn", why)
    return Check("http-url", "ok", f"{url}: loopback only (claude.ai and remote clients need a public https URL)")


def _gateway_check(gateway: GatewayConfig) -> Check:
    name = f"gateway:{gateway.name}"
    problems = []
    try:
        problem = secret_file_problem(str(gateway.key_path), (os.geteuid(), os.getegid()))
    except OSError:
        problems.append(f"no key at {gateway.key_path} (bastion gateway keygen --config PATH {gateway.name})")
    else:
        if problem is not None:
            problems.append(f"key {gateway.key_path} is not the server's alone ({problem}): chmod 600 it")
    if gateway.host_key is None:
        problems.append("no pinned host_key (ssh-keyscan -t ed25519 HOST)")
    if problems:
        return Check(name, "warn", "; ".join(problems) + ": its calls are refused until fixed")
    kind = gateway.host_key.split()[0] if gateway.host_key else ""
    return Check(name, "ok", f"key {gateway.key_path} is the server's alone; host key pinned ({kind})")
