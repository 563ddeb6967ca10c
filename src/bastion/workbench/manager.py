"""Agent-created sandboxes: a fresh workspace per sandbox, its own warm kernel sandbox and cgroup.

A sandbox's files live in `<state_dir>/sandboxes/<id>/workspace`, bound read-write at
/workspace inside; commands run as ``sh -c`` (the kernel is the boundary, so the policy
allows a shell); the file tools act from outside through the jail. Closing a sandbox
reclaims everything: processes (its PID namespaces die), its cgroup, and its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio.to_thread

from bastion.config import (
    BASTION_OPT,
    SANDBOX_ID_PREFIX,
    AllowRule,
    Config,
    LimitsConfig,
    SandboxLimitsConfig,
    TemplateConfig,
    WorkspaceConfig,
    narrow_allow,
    parse_allow_rules,
)
from bastion.egress.proxy import UNIX_PATH_MAX, EgressService
from bastion.executors import started_pool
from bastion.safety.commands import CommandPolicyConfig
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NotFound,
    PolicyDenied,
    ResourceLimit,
    SandboxNotFound,
    Unavailable,
    shown,
)
from bastion.safety.redact import Redactor
from bastion.safety.span import at_end
from bastion.safety.trees import remove_tree, tree_bytes
from bastion.sandbox import DeviceFolder, SandboxSpec, backend
from bastion.sandbox._disk import (
    STATE_FULL_ERRNOS,
    ImageFormats,
    drop_disk,
    make_disk,
    mount_disk,
    mount_tmpfs,
    state_full,
    used_bytes,
)
from bastion.sandbox.cgroups import CgroupLayout, Limits, SandboxCgroup, owner_pid, owner_token
from bastion.sandbox.identity import HostIdentity, IdentityPool
from bastion.sandbox.microvm import MicroVMBackend, MicroVMSettings, probe_microvm, recover_run_dirs
from bastion.sandbox.warm import BubblewrapBackend, WarmSandbox, destroy_left_groups
from bastion.snapshot.store import (
    OverBound,
    SnapshotInfo,
    SnapshotLimits,
    boot_clock,
    create_snapshot,
    delete_snapshot,
    list_snapshots,
    remove_leftovers,
    restore_snapshot,
)
from bastion.workbench.code import CodeRunner
from bastion.workbench.network import INSIDE_DIR, SOCKET_NAME, SandboxNetwork, proxy_environment
from bastion.workbench.settings import SandboxSettings, checked_settings
from bastion.workbench.workspace import OWN_VENV, HostWorkspace

_ID_HEX_BYTES: Final = 6
# Sandboxes the namespace pool starts at once while creates wait on it. Measured on 2 cores: 12 cold
# starts took 30 to 32 ms each one at a time, 20 to 22 ms each two at a time.
_REFILL_PARALLEL: Final = 2
NET_DIR_NAME: Final = ".net"  # in sandboxes_dir; recover() skips it (not a sandbox id)
# With a state path too long for unix sockets, the sockets are in a temp folder, named by this
# symlink in sandboxes_dir so that the next start can remove a crashed server's.
NET_TEMP_LINK: Final = ".net-temp"
NET_TEMP_PREFIX: Final = "bastion-net-"
ENV_DEST: Final = f"{BASTION_OPT}/env"
SLEEP_AFTER_S: Final = 120.0
_MAX_NAME_CHARS: Final = 64
_SHELL_POLICY: Final = CommandPolicyConfig(allow=("*",))
_NARROWABLE: Final = frozenset(SandboxLimitsConfig.model_fields)
_DISK_WALK_MAX_ENTRIES: Final = 100_000
_DISK_IMAGE: Final = "disk.img"
_FOLDER_NICE: Final = 10
_SNAPSHOT_THREADS: Final = 4  # snapshots and restores at once; more calls wait unthreaded
_SNAPSHOT_ADMIN_THREADS: Final = 2  # listing, deleting and expiring snapshots at once, beside them
_FREEZE_THREADS: Final = 4
"""Freezes and thaws at once, all sandboxes together. Found by review: a freeze waits for the kernel (up to
`FREEZE_WAIT_S`), and on the event loop one agent's sandbox held at a tiny CPU limit stopped every call of
the server for a second per pause_sandbox."""
_FOLDER_WORKERS: Final = 4  # threads making and removing sandboxes' folders (mkfs, mount, unmount, delete)
_NET_TMPFS_BYTES: Final = 1 << 20  # holds sockets and folders only
_NET_TMPFS_INODES: Final = 4 * 10_000 + 64  # a folder, a socket and a temp name per sandbox, at most
# In a sandbox's folder while a snapshot is restored into it: recovery deletes a folder holding it.
RESTORING_MARKER: Final = "restoring"

logger = logging.getLogger("bastion.sandboxes")


@dataclass
class Sandbox:
    """One live sandbox and what the manager knows about it."""

    id: str
    name: str | None
    owner: str
    limits: SandboxLimitsConfig
    root: Path
    workspace: HostWorkspace
    code: CodeRunner
    network: SandboxNetwork
    template: str = "default"
    isolation: str = "namespaces"
    settings: SandboxSettings = field(default_factory=SandboxSettings)
    created_wall: float = field(default_factory=time.time)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    freezing: anyio.Lock = field(default_factory=anyio.Lock)
    """Held while its sandbox is frozen or thawed (`SandboxManager._set_frozen`): one at a time."""
    calls: int = 0
    """Tool calls on it in flight: it is in use until they end (found by attack: a command running past
    `idle_timeout_s`, or a server stalled that long mid-call, had its sandbox closed under it as idle)."""

    def call_ended(self) -> None:
        self.calls -= 1
        self.last_used = time.monotonic()

    def summary(self) -> dict[str, object]:
        now = time.monotonic()
        return {
            "sandbox_id": self.id,
            "name": self.name,
            "template": self.template,
            "isolation": self.isolation,
            "state": _state(self.workspace.sandbox),
            "age_s": round(now - self.created, 3),
            "idle_s": round(now - self.last_used, 3),
            "network": self.network.summary(),
            "labels": dict(self.settings.labels),
        }


def narrow_limits(ceiling: SandboxLimitsConfig, requested: Mapping[str, object] | None) -> SandboxLimitsConfig:
    """The ceiling, with each requested value taken if it is not above it.

    Raises:
        InvalidRequest: an unknown limit name or a value of the wrong type.
        PolicyDenied: a value above the administrator's ceiling.
    """
    if not requested:
        return ceiling
    unknown = sorted(set(requested) - _NARROWABLE)
    if unknown:
        raise InvalidRequest(f"unknown limit {shown(unknown[0])}: use {', '.join(sorted(_NARROWABLE))}")
    try:
        narrowed = SandboxLimitsConfig.model_validate({**ceiling.model_dump(), **requested})
    except ValueError:
        raise InvalidRequest(
            "a limit has an invalid value: give positive numbers within the documented bounds"
        ) from None
    for key in requested:
        asked, allowed = getattr(narrowed, key), getattr(ceiling, key)
        if asked > allowed:
            raise PolicyDenied(f"limit {key}={asked} is above the administrator's ceiling of {allowed}: ask for less")
    return narrowed


@dataclass
class _Prepared:
    """A started sandbox waiting in the warm pool for its create_sandbox call."""

    id: str
    root: Path
    warm: backend.Sandbox
    identity: HostIdentity


class SandboxManager:
    """Creates, finds, pauses and closes sandboxes; closes idle ones when asked to reap.

    A small warm pool of started sandboxes (``warm_pool``) makes create_sandbox a handout
    rather than a boot: starting bubblewrap and the agent takes tens of milliseconds.
    """

    def __init__(
        self,
        config: Config,
        redactor: Redactor,
        cgroups: CgroupLayout | None,
        egress: EgressService | None = None,
        identities: IdentityPool | None = None,
        devices: DeviceFolder | None = None,
    ) -> None:
        self._config = config.sandboxes
        self._devices = devices
        self._identities = identities or IdentityPool(*config.sandboxes.host_ids)
        self._held: dict[str, HostIdentity] = {}  # by sandbox id, from _prepare until its folder is gone
        # A sandbox that runs as an id of its own (a root server) reaches its folders through ours:
        # they are traversable (0711), never listable, and what is inside is its own or read-only.
        self._dir_mode = 0o711 if self._identities.switches else 0o700
        self._egress = egress
        # The proxies' sockets: <sandboxes_dir>/.net/<id>/, or a temp folder where that path is
        # too long for a unix socket (108 bytes); made on first use.
        self._net_dir: Path | None = None
        self._net_hold: int | None = None
        """An fd of the temp socket folder (`NET_TEMP_LINK`), flock'd: the folder is this live server's."""
        self._templates = {t.name: t for t in config.template}
        default = config.sandboxes.default_template
        self._default_template = self._templates.get(default, TemplateConfig(name="default"))
        self._dir = config.sandboxes_dir
        self._snapshots = config.state_dir / "snapshots"
        # Snapshot work runs in threads of its own, never more than _SNAPSHOT_THREADS of anyio's
        # shared pool, which the audit log's commits need: 45 snapshot calls waiting in threads for
        # the snapshot lock held all 40 and stopped every call of every sandbox until it was free.
        self._snapshot_threads = anyio.CapacityLimiter(_SNAPSHOT_THREADS)
        # Short snapshot work (list, delete, expire) has threads of its own: behind four long restores it
        # waited, so a client could not free room with delete_snapshot, and the reaper's expiry stalled.
        self._snapshot_admin = anyio.CapacityLimiter(_SNAPSHOT_ADMIN_THREADS)
        self._snapshot_turn = anyio.Lock()  # snapshots are written one at a time: they wait here, unfrozen
        self._freeze_threads = anyio.CapacityLimiter(_FREEZE_THREADS)
        # Sandboxes whose workspace a snapshot is reading: closing one removes its files only after.
        self._archiving: dict[str, anyio.Event] = {}
        # Sandboxes a snapshot froze and will thaw at its end: a user's pause is apart (`pause`, `resume`).
        self._frozen_for_snapshot: set[str] = set()
        """Snapshot id -> `time.monotonic()` when this process recovered it (`expire_snapshots`)."""
        # Sandboxes a restore is writing (as their host id): closing one removes the files, and frees the id, after.
        self._restoring: dict[str, anyio.Event] = {}
        self._redactor = redactor
        self._cgroups = cgroups
        self._boxes: dict[str, Sandbox] = {}
        self._opening = 0  # creates past `_check_room` and not yet registered or failed (`_slot`)
        self._closing = 0  # closes whose sandbox is out of `_boxes` but whose files are not yet removed
        self._unfinished: dict[str, Sandbox] = {}
        """Closes that failed part-way (no thread to be had, say): tried again by the next `close` of the same
        id, the reaper's tick, and `close_all`."""
        self._pool: list[_Prepared] = []
        self._vm_pools: dict[str, list[_Prepared]] = {}  # booted guests by microvm template name
        self._starting: dict[str, _Prepared] = {}  # so close_all can end one mid-start
        # mkfs, mount, unmount and deleting run here, off the event loop; close_all waits for them,
        # so a server stopping mid-call never leaves a mount behind.
        self._workers = _folder_workers()
        # Making a sandbox's folders (a create waits for it) at the server's own priority, apart from the
        # background work above: niced, it waited behind the other start's agent for the only free core.
        self._builders = _folder_workers(background=False)
        self._images = ImageFormats(self._dir)  # mkfs once per disk size; each sandbox's image is a copy
        self._building: dict[str, Path] = {}  # sandboxes whose folders a worker is making, until _prepare resumes
        self._refills: set[asyncio.Task[None]] = set()  # namespace sandboxes starting for the pool
        self._refills_building: set[asyncio.Task[None]] = set()  # those of them still making their folders
        self._vm_refill: asyncio.Task[None] | None = None
        self._pool_waiters: list[asyncio.Future[bool]] = []  # creates waiting for the refill's next sandbox
        self._pool_failed = False
        """The last refill of the warm pool failed (a readiness check reads it)."""
        self._pool_filled_once = False
        self._vm_probe_lock = asyncio.Lock()
        self._vm_accel: str | None = None  # "kvm" or "tcg", once the first microvm template has probed
        self._vm_refusal: str | None = None  # why a KVM guest does not boot here, if it does not

    @property
    def enabled(self) -> bool:
        return self._config.enabled

    def owns(self, sandbox_id: str) -> bool:
        return sandbox_id in self._boxes

    def peek(self, sandbox_id: str) -> Sandbox | None:
        """The live sandbox `sandbox_id` or None, for a look that is not a use of it (a preview's liveness): unlike
        `get`, it neither counts as use for the idle reaper nor refuses a sandbox being restored."""
        return self._boxes.get(sandbox_id)

    def get(self, sandbox_id: str, *, while_restoring: bool = False) -> Sandbox:
        """The live sandbox `sandbox_id`, for a call on it.

        Raises:
            SandboxNotFound: there is none.
            Conflict: a restore is still writing its workspace, unless `while_restoring` (for its close). Found by
                attack: a snapshot taken then answered OK with a torn copy (none of 2,000 files, a 1 MiB prefix
                of a 16 MiB file: freezing the sandbox does not stop the server's restore thread), a command saw
                an empty workspace, and a write made the restore fail.
        """
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {shown(sandbox_id)}: it was closed, or never existed (list_sandboxes)")
        if sandbox_id in self._restoring and not while_restoring:
            raise Conflict(
                f"sandbox {box.id} is being restored from a snapshot: call again once restore_sandbox has returned"
            )
        box.last_used = time.monotonic()
        box.calls += 1
        if not at_end(box.call_ended):
            box.calls -= 1
        return box

    def all(self) -> list[Sandbox]:
        return sorted(self._boxes.values(), key=lambda box: box.created)

    async def create(
        self,
        *,
        owner: str,
        name: str | None = None,
        limits: Mapping[str, object] | None = None,
        template: str | None = None,
        network_allow: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Make a sandbox with a fresh, empty workspace and start it.

        `env` reaches every command, background process and code context of the sandbox; `labels`
        only describe it (see `bastion.workbench.settings`).

        Raises:
            PolicyDenied: sandboxes are disabled, a limit is above the ceiling, or env for a template
                with a command policy.
            ResourceLimit: the maximum number of sandboxes is reached.
            NotFound: no such template.
            InvalidRequest: a malformed network rule, env name or label.
        """
        if not self._config.enabled:
            raise PolicyDenied("sandboxes are disabled on this server: use a configured workspace")
        self._check_room()
        if name is not None and (len(name) > _MAX_NAME_CHARS or not name.isprintable()):
            raise InvalidRequest(f"name must be printable and at most {_MAX_NAME_CHARS} characters")
        chosen = self._template(template)
        if env and chosen.policy is not None:
            # Without a shell the agent cannot set variables; PAGER, LESSOPEN and the like would run programs
            # past the template's command policy.
            raise PolicyDenied(f"template {chosen.name!r} restricts commands, so it takes no env: leave env out")
        settings = checked_settings(env, labels, taken={*self._config.env, *chosen.env, *proxy_environment()})
        narrowed = narrow_limits(
            self._config.limits,
            {**(chosen.limits.model_dump(exclude_none=True) if chosen.limits else {}), **(limits or {})},
        )
        rules = self._network_rules(chosen, network_allow)
        binds = _binds(chosen)
        # The pool's sandboxes have the default template's binds and the ceiling's disk: others start their own.
        standard = (
            binds == _binds(self._default_template)
            and narrowed.disk_bytes == self._config.limits.disk_bytes
            and chosen.isolation == self._default_template.isolation == "namespaces"
        )
        with self._slot():
            box = await self._start(name, owner, chosen, narrowed, settings, rules, standard=standard)
        self.refill_pool()
        return box

    def _check_room(self) -> None:
        """Refuse a sandbox past `max_sandboxes`, counting those being made or closed (a close cut short too:
        found by review): each holds its disk image, mounts and host id until it is registered or its files
        are gone."""
        held = len(self._boxes) + self._opening + self._closing + len(self._unfinished)
        if held >= self._config.max_sandboxes:
            raise ResourceLimit(
                f"{self._config.max_sandboxes} sandboxes are open (or being made or closed): close one first"
            )

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """A place under `max_sandboxes` for a sandbox being made, taken before its first await and held
        until it is registered or has failed: concurrent creates all passed a check of `_boxes` alone."""
        self._check_room()
        self._opening += 1
        try:
            yield
        finally:
            self._opening -= 1

    async def _start(
        self,
        name: str | None,
        owner: str,
        chosen: TemplateConfig,
        narrowed: SandboxLimitsConfig,
        settings: SandboxSettings,
        rules: tuple[AllowRule, ...],
        *,
        standard: bool,
    ) -> Sandbox:
        """Start (or take from a pool) the sandbox `create` checked, and register it."""
        binds = _binds(chosen)
        prepared = await self._pooled(chosen, narrowed.disk_bytes, standard) or await self._prepare(
            binds, narrowed.disk_bytes, chosen
        )
        files_owner = _owner(prepared.identity)
        network = SandboxNetwork(prepared.id, self._socket_dir(prepared.id), self._egress, rules, files_owner)
        workspace: HostWorkspace | None = None
        try:
            config = self._workspace_config(prepared.id, prepared.root, narrowed, chosen, settings)
            via_sh = chosen.policy is None
            workspace = HostWorkspace(
                config,
                self._redactor,
                self._cgroups,
                via_sh=via_sh,
                sandboxed=True,
                sandbox=prepared.warm,
                path_prefix=_path(chosen),
                identity=prepared.identity,
                owner=files_owner,
            )
            python_env = ENV_DEST if chosen.python_env is not None else None
            code = CodeRunner(workspace, self._redactor, python_env=python_env)
            await network.enable(workspace)
        except BaseException:
            network.close()
            if workspace is not None:
                workspace.close()  # its jail's fd holds the disk: the unmount below would be lazy, the loop kept
            else:
                prepared.warm.close()
            self._discard_prepared(prepared.id, prepared.root)
            raise
        box = Sandbox(
            id=prepared.id,
            name=name,
            owner=owner,
            limits=narrowed,
            root=prepared.root,
            workspace=workspace,
            code=code,
            network=network,
            template=chosen.name,
            isolation=chosen.isolation,
            settings=settings,
        )
        self._boxes[box.id] = box
        return box

    async def _pooled(self, template: TemplateConfig, disk_bytes: int | None, standard: bool) -> _Prepared | None:
        """A started sandbox from a warm pool: the namespace one for the default template, a microvm
        template's own (booted with its size and the ceiling's disk) for that template."""
        if standard:
            return await self._namespace_pooled()
        booted = self._vm_pools.get(template.name)
        if template.isolation == "microvm" and booted and disk_bytes == self._config.limits.disk_bytes:
            return booted.pop()
        return None

    def _network_rules(self, template: TemplateConfig, requested: Sequence[str] | None) -> tuple[AllowRule, ...]:
        """The template's allowlist, or the requested one, which must lie within the administrator's ceiling."""
        if requested is None:
            return parse_allow_rules(template.network_allow)
        rules = narrow_allow(self._config.network.allow_rules, requested)
        if rules and self._egress is None:
            raise PolicyDenied("network egress is not available on this server")
        return rules

    def _socket_dir(self, sandbox_id: str) -> Path:
        """The host folder a sandbox sees at /run/bastion, where its egress proxy listens."""
        if self._net_dir is None:
            self._net_dir = self._make_net_dir()
        return self._net_dir / sandbox_id

    def _make_net_dir(self) -> Path:
        # Under the state folder when the socket paths fit; else a private temp folder, named by
        # a symlink in the state folder. Either way `recover` finds a crashed server's.
        preferred = self._dir / NET_DIR_NAME
        longest = preferred / (SANDBOX_ID_PREFIX + "0" * 2 * _ID_HEX_BYTES) / SOCKET_NAME
        self._make_dir(self._dir)
        if len(os.fsencode(longest)) <= UNIX_PATH_MAX:
            self._make_dir(preferred)
            if self._config.disk_quota:
                # A filesystem of its own: a bind of one of its folders shows the sandbox `/<id>` in
                # /proc/self/mountinfo, where a folder of the state filesystem would show the state path.
                mount_tmpfs(preferred, _NET_TMPFS_BYTES, _NET_TMPFS_INODES, self._dir_mode)
            return preferred
        temp = Path(tempfile.mkdtemp(prefix=NET_TEMP_PREFIX))
        try:
            os.chmod(temp, self._dir_mode)
            self._net_hold = _hold(temp)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EBADF):  # no flock on this filesystem (NFS): held by nobody
                _remove_tree(temp)
                raise
            logger.warning(
                "egress socket folder %s cannot be locked (%s): a copy of this state folder could remove it",
                temp,
                exc.strerror,
            )
        link = self._dir / NET_TEMP_LINK
        try:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.symlink(temp, link)
        except OSError as exc:  # the sockets still work; only a crash would leave the folder behind
            logger.warning("cannot name the egress socket folder %s in %s: %s", temp, link, exc)
        return temp

    def _make_dir(self, path: Path) -> None:
        """A folder of ours that the sandboxes' own ids may pass through (see _dir_mode)."""
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, self._dir_mode)

    def _discard_prepared(self, sandbox_id: str, root: Path) -> None:
        self._discard_files(sandbox_id, root)
        self._release_identity(sandbox_id)

    def _discard_files(self, sandbox_id: str, root: Path) -> None:
        """Unmount and delete a sandbox's folders. Blocking (a second or more for a tmpfs or
        workspace of many files): `close` runs it in a worker thread; it touches no shared state."""
        _discard(root)
        if self._devices is not None:
            self._devices.drop(sandbox_id)
        if self._net_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                _remove_tree(self._net_dir / sandbox_id)

    def _release_identity(self, sandbox_id: str) -> None:
        """Give the sandbox's host id back, once nothing of it is left that runs or is owned as it."""
        identity = self._held.pop(sandbox_id, None)
        if identity is not None:
            self._identities.release(identity)

    def _template(self, name: str | None) -> TemplateConfig:
        # The default is asked for by its name too ("default" when no template has it): list_templates names it.
        if name is None or name == self._default_template.name:
            return self._default_template
        found = self._templates.get(name)
        if found is None:
            known = ", ".join(sorted({*self._templates, self._default_template.name}))
            raise NotFound(f"no sandbox template {shown(name)}: use one of {known} (list_templates)")
        return found

    async def _prepare(
        self,
        binds: tuple[tuple[str, str], ...] = (),
        disk_bytes: int | None = None,
        template: TemplateConfig | None = None,
        *,
        built: Callable[[], None] | None = None,
    ) -> _Prepared:
        """A new sandbox: its folders (its own filesystem with a quota), its cgroup at the
        ceiling's limits, bubblewrap (or a microVM, for such a template) and the agent started.
        `built` is called once its folders are made, before bubblewrap runs (`_start_refills`)."""
        isolation = template.isolation if template is not None else "namespaces"
        vm_backend = await self._microvm_backend(template) if template is not None and isolation == "microvm" else None
        sandbox_id = SANDBOX_ID_PREFIX + secrets.token_hex(_ID_HEX_BYTES)
        root = self._dir / sandbox_id
        with _state_room():
            socket_dir = self._socket_dir(sandbox_id)  # first: it may fail (a full disk), and hold nothing yet
        identity = self._held[sandbox_id] = self._identities.acquire()
        ceiling = self._config.limits
        limits = None
        if self._cgroups is not None:
            limits = Limits(memory_bytes=ceiling.memory_bytes, pids=ceiling.pids, cpu_cores=ceiling.cpu_cores)
        spec = SandboxSpec(
            workspace=str(root / "workspace"),
            read_only_binds=(*binds, (str(socket_dir), INSIDE_DIR)),
            devices=str(self._devices.path / sandbox_id) if self._devices is not None else None,  # `_make_all`'s
            identity=(identity.uid, identity.gid) if identity.switch else None,
            tmp_size_bytes=self._config.tmp_bytes,
            shm_size_bytes=self._config.shm_bytes,
        )
        chosen: backend.Backend = vm_backend or BubblewrapBackend(self._cgroups)
        warm = chosen.sandbox(spec, limits=limits)
        prepared = self._starting[sandbox_id] = _Prepared(sandbox_id, root, warm, identity)
        try:
            devices = await self._build(sandbox_id, root, identity, disk_bytes, socket_dir, warm)
        except BaseException:
            self._starting.pop(sandbox_id, None)
            raise
        try:
            if devices != spec.devices:
                raise Unavailable(f"sandbox {sandbox_id}'s device folder is {devices}, not {spec.devices}")
            if built is not None:
                built()
            await warm.start()
        except BaseException:
            warm.close()
            self._discard_prepared(sandbox_id, root)
            raise
        finally:
            self._starting.pop(sandbox_id, None)
        return prepared

    async def _microvm_backend(self, template: TemplateConfig) -> MicroVMBackend:
        """The microVM backend for `template`, once a tiny KVM guest has booted here (probed once);
        where it does not, software emulation if [sandboxes.microvm] allows it, else a one-line refusal."""
        config = self._config.microvm
        async with self._vm_probe_lock:
            if self._vm_accel is None:
                kvm = MicroVMSettings(config.image_dir, accel="kvm", boot_timeout_s=config.probe_timeout_s)
                self._vm_refusal = await probe_microvm(kvm, config.probe_timeout_s)
                self._vm_accel = "kvm" if self._vm_refusal is None else "tcg"
                if self._vm_refusal is not None:
                    logger.warning("microvm: %s", self._vm_refusal)
        if self._vm_refusal is not None and not config.allow_emulation:
            raise Unavailable(
                f"template {template.name!r} needs a microVM and {self._vm_refusal} "
                "(set [sandboxes.microvm] allow_emulation = true to emulate: slow)"
            )
        settings = MicroVMSettings(
            config.image_dir,
            memory_mib=template.vm_memory_mib,
            vcpus=template.vm_vcpus,
            accel=self._vm_accel,
            boot_timeout_s=config.boot_timeout_s,
        )
        return MicroVMBackend(settings, self._cgroups)

    async def _build(
        self,
        sandbox_id: str,
        root: Path,
        identity: HostIdentity,
        disk_bytes: int | None,
        socket_dir: Path,
        warm: backend.Sandbox,
    ) -> str | None:
        """Make the sandbox's folders in a worker (mkfs and mount: tens of ms the loop would stall) while a
        namespace sandbox's start begins beside them (`WarmSandbox.hold`: its cgroup joined meanwhile);
        returns its device folder. On failure or cancellation nothing of it is left, `warm` closed."""
        self._building[sandbox_id] = root
        work = self._builders.submit(self._make_all, sandbox_id, root, identity, disk_bytes, socket_dir)
        made = asyncio.wrap_future(work)
        try:
            if isinstance(warm, WarmSandbox):
                warm.hold()
            devices = await asyncio.shield(made)
        except BaseException:
            # Cancelled: nothing awaits `made` any more. Its failure (mkfs on a failed disk) is taken
            # here, else the loop would report it, when collected, as an error of whatever runs then.
            made.add_done_callback(_taken)
            if not work.done():
                # Cancelled mid-build: the worker goes on; removing its folders under it would race.
                futures.wait([work])
            warm.close()
            self._discard_prepared(sandbox_id, root)
            raise
        finally:
            discarded = self._building.pop(sandbox_id, None) is None
        if discarded:  # close_all ran meanwhile and removed what the worker made
            warm.close()
            raise Unavailable("the server is closing its sandboxes: no new one starts")
        return devices

    def _make_all(
        self, sandbox_id: str, root: Path, identity: HostIdentity, disk_bytes: int | None, socket_dir: Path
    ) -> str | None:
        with _state_room():
            self._make_folders(root, identity, disk_bytes)
            socket_dir.mkdir(mode=self._dir_mode)
            os.chmod(socket_dir, self._dir_mode)
            return self._devices.make(sandbox_id, _owner(identity)) if self._devices is not None else None

    def _make_folders(self, root: Path, identity: HostIdentity, disk_bytes: int | None) -> None:
        """The sandbox's folder and its workspace (its own filesystem with a quota), the workspace its identity's."""
        self._make_dir(self._dir)
        root.mkdir(mode=0o700)
        os.chmod(root, self._dir_mode)
        workspace = root / "workspace"
        workspace.mkdir(mode=0o700)
        if self._config.disk_quota:
            # A few ms (mkfs once per size), in a worker (`_build`) that close_all waits for.
            formatted = self._images.get(disk_bytes or self._config.limits.disk_bytes)
            make_disk(root / _DISK_IMAGE, workspace, formatted)
        if identity.switch:
            os.chown(workspace, identity.uid, identity.gid, follow_symlinks=False)

    def refill_pool(self) -> None:
        """Start, in the background, the sandboxes the warm pools are missing."""
        if not self._config.enabled or self._config.warm_pool + self._config.microvm.warm_pool == 0:
            return
        if self._config.warm_pool:
            self._start_refills()
        # Apart: a guest boots for seconds, and the namespace pool must not wait behind it.
        if self._config.microvm.warm_pool and (self._vm_refill is None or self._vm_refill.done()):
            self._vm_refill = asyncio.get_running_loop().create_task(self._fill_vms())

    def _start_refills(self) -> None:
        """Start what the namespace pool misses, counting the creates waiting on it, at most
        `_REFILL_PARALLEL` at once: a burst of creates gets sandboxes at the rate of two starts side by side.

        A refill starts only once the one before has made its folders (`_refill_built`), so that two are never
        in step: two begun together ended together, and a burst of creates waited for them in pairs, one a
        whole start (the burst's p90: 45 to 52 ms), the next none; staggered, each waits about half of one.
        """
        wanted = min(self._config.warm_pool - len(self._pool) + len(self._pool_waiters), _REFILL_PARALLEL)
        if len(self._refills) >= wanted or self._refills_building:
            return
        refill = asyncio.get_running_loop().create_task(self._fill_one())
        self._refills.add(refill)
        self._refills_building.add(refill)
        refill.add_done_callback(self._refills.discard)
        refill.add_done_callback(self._refills_building.discard)

    def _refill_built(self) -> None:
        """A refill's folders are made (its bubblewrap starts now): the next refill may begin."""
        refill = asyncio.current_task()
        if refill is not None:
            self._refills_building.discard(refill)
        self._start_refills()

    def _vm_templates(self) -> list[TemplateConfig]:
        templates = {self._default_template.name: self._default_template, **self._templates}
        return [template for template in templates.values() if template.isolation == "microvm"]

    async def _namespace_pooled(self) -> _Prepared | None:
        """A sandbox of the namespace warm pool: a waiting one, else the first its refills start, else None.

        Waiting for the refill's sandbox costs less than starting one of its own beside it: this call
        would wait for a whole start shared with the refill's cores. Waiting also lets the refill start a
        second sandbox for the next create, which a burst of creates needs (`_start_refills`).
        """
        while not self._pool:
            if all(refill.done() for refill in self._refills):
                return None
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._pool_waiters.append(waiter)
            self._start_refills()
            try:
                watched: set[asyncio.Future[Any]] = {waiter, *self._refills}
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            finally:
                with contextlib.suppress(ValueError):
                    self._pool_waiters.remove(waiter)
            if waiter.done() and not waiter.result() and not self._pool:
                # A refill failed: a start of its own works or says why. Waiting on for the other
                # refill in flight would let each failure start another, and the create wait through them.
                return None
        return self._pool.pop()

    def _wake_pool_waiters(self, *, started: bool) -> None:
        waiters, self._pool_waiters = self._pool_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(started)

    async def _fill_one(self) -> None:
        """Start one sandbox into the namespace pool, then what the pool still misses."""
        try:
            prepared = await self._prepare(_binds(self._default_template), built=self._refill_built)
        except BaseException as exc:
            self._wake_pool_waiters(started=False)
            if not isinstance(exc, Exception):
                raise  # cancelled: the server is closing
            # Said here: nothing awaits this task (an exception left in it would be reported only
            # when it is collected, and then as an error of whatever runs at that moment).
            self._pool_failed = True
            if isinstance(exc, BastionError):
                logger.warning("warm pool not refilled: %s", exc.reason)
            elif isinstance(exc, OSError):  # e.g. EIO from a failed state filesystem
                logger.warning("warm pool not refilled: %s", exc.strerror or exc)
            else:
                logger.exception("warm pool not refilled")
            return
        self._pool.append(prepared)
        self._pool_failed = False
        self._pool_filled_once |= len(self._pool) >= self._config.warm_pool
        refill = asyncio.current_task()
        if refill is not None:
            self._refills.discard(refill)  # done: not a start in flight any more
        self._start_refills()  # before the wake-up, which takes the creates waiting off the count
        self._wake_pool_waiters(started=True)

    async def _fill_vms(self) -> None:
        try:
            for template in self._vm_templates():
                booted = self._vm_pools.setdefault(template.name, [])
                while len(booted) < self._config.microvm.warm_pool:
                    booted.append(await self._prepare(_binds(template), None, template))
        except BastionError as exc:
            logger.warning("microVM warm pool not refilled: %s", exc.reason)

    @property
    def pool_size(self) -> int:
        """Started sandboxes waiting in the warm pools."""
        return len(self._pool) + sum(map(len, self._vm_pools.values()))

    def booted_waiting(self, template: str) -> int:
        """Booted guests waiting in a microvm template's warm pool."""
        return len(self._vm_pools.get(template, ()))

    def _pooled_all(self) -> list[_Prepared]:
        return [*self._pool, *(prepared for booted in self._vm_pools.values() for prepared in booted)]

    def pool_ready(self) -> bool:
        """Whether the warm pool is full, or was filled since the start and its last refill worked.

        A pool emptied by a burst of create_sandbox is still ready: a readiness probe failing under load
        would take the server out of rotation exactly when it is used.
        """
        if not self._config.enabled or len(self._pool) >= self._config.warm_pool:
            return True
        return self._pool_filled_once and not self._pool_failed

    def census(self) -> dict[tuple[str, str], int]:
        """Live sandboxes by (state, isolation backend)."""
        counts: dict[tuple[str, str], int] = {}
        for box in list(self._boxes.values()):
            backend_name = MicroVMBackend.name if box.isolation == "microvm" else BubblewrapBackend.name
            key = (_state(box.workspace.sandbox), backend_name)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def _workspace_config(
        self,
        sandbox_id: str,
        root: Path,
        limits: SandboxLimitsConfig,
        template: TemplateConfig,
        settings: SandboxSettings,
    ) -> WorkspaceConfig:
        return WorkspaceConfig(
            id=sandbox_id.replace(SANDBOX_ID_PREFIX, "s", 1),
            path=root / "workspace",
            policy=template.policy or _SHELL_POLICY,
            # The agent's names never overlap the administrator's (`checked_settings`).
            env={**settings.env, **self._config.env, **template.env},
            timeout_s=limits.timeout_s,
            max_output_bytes=limits.max_output_bytes,
            limits=LimitsConfig(memory_bytes=limits.memory_bytes, pids=limits.pids, cpu_cores=limits.cpu_cores),
            use_cgroups=self._cgroups is not None,
            terminals=self._config.terminals,
        )

    def find(self, sandbox_id: str) -> Sandbox:
        """The sandbox, without marking it used: looking at it (the administrator's pages) is not using it.

        Raises:
            SandboxNotFound: no such sandbox.
        """
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {shown(sandbox_id)}: it was closed, or never existed")
        return box

    def status(self, sandbox_id: str) -> dict[str, object]:
        return self.detail(self.get(sandbox_id))

    def detail(self, box: Sandbox) -> dict[str, object]:
        """A sandbox's summary with its limits, env and live usage (a cgroup read and a bounded disk walk)."""
        usage = box.workspace.sandbox.usage()
        detail = box.summary()
        detail["created"] = round(box.created_wall, 3)
        detail["limits"] = box.limits.model_dump()
        detail["env"] = dict(box.settings.env)  # the agent's own, not secret; the administrator's stay unseen
        detail["usage"] = {
            "memory_bytes": usage.memory_bytes if usage else 0,
            "pids": usage.pids if usage else 0,
            "cpu_s": round(usage.cpu_usec / 1e6, 3) if usage else 0.0,
            "disk_bytes": _disk_bytes(box.root / "workspace"),
            "disk_quota_bytes": box.limits.disk_bytes if self._config.disk_quota else None,
        }
        return detail

    async def pause(self, sandbox_id: str) -> Sandbox:
        """Freeze the sandbox until `resume`. During a snapshot it is frozen already: the pause is taken,
        and the sandbox stays frozen when the snapshot ends.

        Raises:
            Conflict: it is paused already, asleep, or not running.
            Timeout: it did not freeze in time (then nothing of it stays frozen).
        """
        box = self.get(sandbox_id)
        async with box.freezing:
            if box.id in self._frozen_for_snapshot:
                self._frozen_for_snapshot.discard(box.id)  # the snapshot's end leaves it to the caller's resume
                return box
            if box.workspace.sandbox.paused:
                raise Conflict(f"sandbox {box.id} is already paused")
            await self._set_frozen(box, True)
        return box

    async def resume(self, sandbox_id: str) -> Sandbox:
        """Thaw a paused sandbox.

        Raises:
            Conflict: it is not paused, or a snapshot of it is being taken (it stays frozen while it is copied).
        """
        box = self.get(sandbox_id)
        async with box.freezing:
            if box.id in self._archiving:
                raise Conflict(
                    f"a snapshot of sandbox {box.id} is being taken and it stays frozen until the snapshot ends: "
                    "resume it after snapshot_sandbox returns"
                )
            if not box.workspace.sandbox.paused:
                raise Conflict(f"sandbox {box.id} is not paused")
            await self._set_frozen(box, False)
        return box

    async def _set_frozen(self, box: Sandbox, frozen: bool) -> None:
        """Freeze or thaw `box`'s sandbox in a worker thread (`_FREEZE_THREADS`), with `box.freezing` held. A
        caller cancelled meanwhile does not cut it short: the sandbox's state stays as the kernel has it."""
        sandbox = box.workspace.sandbox
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(sandbox.pause if frozen else sandbox.resume, limiter=self._freeze_threads)

    async def snapshot(self, sandbox_id: str, label: str | None) -> SnapshotInfo:
        """Archive a sandbox's workspace (paused meanwhile, so the copy is consistent), within the snapshot caps.

        Raises:
            ResourceLimit: a cap (count or bytes, in total or of this sandbox) or the state reserve.
        """
        box = self.get(sandbox_id)
        async with self._snapshot_turn:
            # what has expired never holds a cap
            await anyio.to_thread.run_sync(self.expire_snapshots, limiter=self._snapshot_admin)
            # Closed while this call waited? From here to _archiving there is no await, so a close
            # either came first (SandboxNotFound) or will wait for the archive.
            box = self.get(sandbox_id)
            warm = box.workspace.sandbox
            archived = self._archiving[box.id] = anyio.Event()
            try:
                if warm.asleep or warm.usage() is not None:
                    # Asleep: nothing runs to freeze, but a command would wake it mid-copy, unfrozen (and a file it
                    # made then could take a stored file's freed inode): woken, then frozen like the rest. Alive:
                    # a start under way (a command waking it) is waited for, as a freeze of it is refused.
                    await warm.start()
                async with box.freezing:
                    if not warm.paused and warm.usage() is not None:
                        await self._set_frozen(box, True)
                        self._frozen_for_snapshot.add(box.id)
                metadata = {"sandbox_id": box.id, "owner": box.owner, "name": box.name or "", "template": box.template}
                return await anyio.to_thread.run_sync(
                    functools.partial(
                        create_snapshot,
                        box.root / "workspace",
                        self._snapshots,
                        label=label,
                        metadata=metadata,
                        limits=self.snapshot_limits(),
                    ),
                    limiter=self._snapshot_threads,
                )
            finally:
                del self._archiving[box.id]
                archived.set()
                # Only the snapshot's own freeze: not one a pause during the snapshot took over (see `pause`).
                with anyio.CancelScope(shield=True):
                    async with box.freezing:
                        thaw = box.id in self._frozen_for_snapshot
                        self._frozen_for_snapshot.discard(box.id)
                        if thaw and warm.paused:  # a close meanwhile ended the sandbox: nothing to thaw
                            try:
                                await self._set_frozen(box, False)
                            except BastionError as exc:  # the snapshot is made: its answer stands (found by review)
                                logger.warning("sandbox %s not thawed after its snapshot: %s", box.id, exc.reason)

    async def restore(self, snapshot_id: str, *, owner: str) -> tuple[Sandbox, SnapshotInfo]:
        """A new sandbox whose workspace is the snapshot's, byte for byte, of the source's template
        (a microVM's snapshot comes back as a microVM) while that template exists, else the default.

        Raises:
            BastionError: as `create` and `restore_snapshot` (the new sandbox is then closed), or
                SandboxNotFound when the new sandbox was closed (a call, the reaper) during the restore.
        """
        box = await self.create(owner=owner, template=await self._template_of(snapshot_id))
        # No await since create registered the box: a close from here on waits for the restore (see close).
        restoring = self._restoring[box.id] = anyio.Event()
        try:
            try:
                restore = functools.partial(
                    restore_snapshot,
                    self._snapshots,
                    snapshot_id,
                    box.root / "workspace",
                    owner=_owner(box.workspace.identity),
                    # The workspace's blocks land in the sandbox's folder (its disk image): the state filesystem.
                    state_dir=box.root,
                    reserve_bytes=self._config.state_reserve_bytes,
                )
                info = await anyio.to_thread.run_sync(
                    _restore_marked, box.root, restore, limiter=self._snapshot_threads
                )
            finally:
                del self._restoring[box.id]
                restoring.set()
        except BaseException:
            # Closed meanwhile (a call, the reaper): that close removes the files; its absence is not the error.
            with contextlib.suppress(SandboxNotFound):
                await self.close(box.id)
            raise
        if box.id not in self._boxes:
            raise SandboxNotFound(
                f"sandbox {box.id} was closed while snapshot {snapshot_id} was restored into it: restore it again"
            )
        return box, info

    async def _template_of(self, snapshot_id: str) -> str | None:
        found = await anyio.to_thread.run_sync(list_snapshots, self._snapshots, limiter=self._snapshot_admin)
        name = next((info.metadata.get("template") for info in found if info.id == snapshot_id), None)
        return name if name in self._templates else None

    def snapshots(self) -> list[SnapshotInfo]:
        return list_snapshots(self._snapshots)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (any sandbox's, or a recovered one): its space is free at once.

        Raises:
            BastionError: InvalidRequest (bad id), NotFound, OperationFailed.
        """
        await anyio.to_thread.run_sync(delete_snapshot, self._snapshots, snapshot_id, limiter=self._snapshot_admin)

    def snapshot_limits(self) -> SnapshotLimits:
        """The caps an agent's snapshot is taken under, from the config."""
        config = self._config
        return SnapshotLimits(
            count=config.max_snapshots,
            bytes=config.snapshot_bytes,
            per_sandbox_count=config.max_snapshots_per_sandbox,
            per_sandbox_bytes=config.snapshot_bytes_per_sandbox,
            reserve_bytes=config.state_reserve_bytes,
        )

    def snapshot_expires(self, info: SnapshotInfo) -> float:
        """When a snapshot expires (unix s): after `orphan_retention_s` if recovered, else `snapshot_retention_s`."""
        recovered = info.metadata.get("recovered") == "true"
        return info.created + (self._config.orphan_retention_s if recovered else self._config.snapshot_retention_s)

    def expire_snapshots(self) -> list[str]:
        """Delete the snapshots past their retention (see `snapshot_expires`); return their ids. Blocking (unlinks).

        A snapshot taken in this boot is aged on the boot's own clock too, and kept while either clock says it
        is young (`SnapshotInfo.age_s`): a host that boots with its clock far behind (no RTC, before NTP) stamps
        them in the past, and the sync's step forward would otherwise delete them at the next reap.
        """
        now, boot = time.time(), boot_clock()
        expired = []
        for info in list_snapshots(self._snapshots):
            retention = self.snapshot_expires(info) - info.created
            if info.age_s(now, boot) > retention:
                with contextlib.suppress(NotFound):  # deleted meanwhile by a call
                    delete_snapshot(self._snapshots, info.id)
                    expired.append(info.id)
        return expired

    def recover(self, keeping: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
        """Clean what a crashed server left: its cgroups, and its sandboxes' folders, which
        are kept as snapshots (label ``recovered``) until `orphan_retention_s` passes. Expired
        snapshots and an interrupted snapshot's files go first; a workspace whose snapshot would
        eat the state reserve is kept as it is, for the next start, and one that cannot be
        snapshotted for another reason is deleted (see `_recover_sandbox`).

        `keeping` is told a sandbox's id before its workspace is snapshotted (the start's audit
        record: a crash before the snapshot is recorded still leaves it); it may raise to stop.
        Processes need no cleaning: bwrap's --die-with-parent ended them with the server, and a
        VMM's parent-death signal; a VMM that outlived it anyway is killed with its folder.
        Returns each sandbox kept, with its snapshot's id.
        """
        # First: a VMM that outlived its server is killed with its folder, and its group then holds nothing.
        for folder in recover_run_dirs():
            logger.info("a crashed server's microVM folder %s removed", folder)
        if self._cgroups is not None:
            for name in self._cgroups.existing():
                try:
                    group = self._cgroups.open(name)
                except NotFound:
                    continue  # removed meanwhile, by the live server that made it
                if _left_by_a_crash(name, group, self._cgroups.owner):
                    group.destroy()
        made: list[tuple[str, str]] = []
        self._remove_stale_sockets()
        remove_leftovers(self._snapshots)
        for snapshot_id in self.expire_snapshots():
            logger.info("snapshot %s expired: deleted", snapshot_id)
        # Not the agents' caps (a crash's leftovers are kept, whatever their number), only the reserve.
        limits = SnapshotLimits(reserve_bytes=self._config.state_reserve_bytes)
        kept = {
            info.metadata.get("sandbox_id", ""): info.id
            for info in list_snapshots(self._snapshots)
            if info.metadata.get("recovered") == "true"
        }
        if self._dir.is_dir():
            for root in sorted(self._dir.iterdir()):
                if root.name.startswith(SANDBOX_ID_PREFIX) and root.name not in self._boxes:
                    made.extend((root.name, made_id) for made_id in self._recover_sandbox(root, limits, kept, keeping))
        return made

    def _recover_sandbox(
        self, root: Path, limits: SnapshotLimits, kept: Mapping[str, str], keeping: Callable[[str], None] | None
    ) -> list[str]:
        """Keep a crashed sandbox's workspace as a snapshot, then delete its folder; returns the snapshot made
        (or, for a workspace `kept` already, that snapshot: its recovery's end was not recorded).

        Kept as it is when its image does not mount, or its snapshot fails for a reason a later start
        may not meet (no room, a file a damaged image cannot read, too many open files). A workspace
        over the snapshot bounds themselves (`OverBound`: entries, file data, depth) would be refused at
        every start, each time holding the folder's mount, loop device and image: it is deleted, with
        one line. So is one no snapshot should keep: a restore's target the crash cut short (its
        `RESTORING_MARKER` is there; the snapshot it came from is kept), or a workspace already kept
        as a `recovered` snapshot (`kept`: a crash between that snapshot and this deletion).
        """
        if os.path.lexists(root / RESTORING_MARKER):
            logger.error("sandbox %s was being restored when the server stopped: deleted, half restored", root.name)
            _discard(root)
            return []
        if root.name in kept:
            logger.error("sandbox %s left by a crash has its recovered snapshot already: deleted", root.name)
            _discard(root)
            return [kept[root.name]]
        workspace = root / "workspace"
        image = root / _DISK_IMAGE
        if image.is_file() and not os.path.ismount(workspace):
            # After a host reboot the image is no longer mounted: mount it to keep its files.
            try:
                mount_disk(image, workspace)
            except BastionError as exc:
                logger.error("sandbox %s left by a crash kept as is: %s", root.name, exc.reason)
                return []
        made = []
        # An empty workspace (a warm-pool sandbox never handed out) has nothing to keep.
        if workspace.is_dir() and not workspace.is_symlink() and _holds_files(workspace):
            metadata = {"sandbox_id": root.name, "recovered": "true"}
            if keeping is not None:
                keeping(root.name)
            try:
                info = create_snapshot(workspace, self._snapshots, label="recovered", metadata=metadata, limits=limits)
            except OverBound as exc:
                logger.error("sandbox %s left by a crash deleted without a snapshot: %s", root.name, exc.reason)
            except BastionError as exc:  # no room, a file a damaged image cannot read...: a later start may pass
                logger.error("sandbox %s left by a crash kept as is, for the next start: %s", root.name, exc.reason)
                return []
            else:
                made.append(info.id)
        _discard(root)
        return made

    def _remove_stale_sockets(self) -> None:
        """The socket folders of sandboxes this server does not run (a crashed server's)."""
        live = {*self._boxes, *(prepared.id for prepared in self._pooled_all()), *self._starting}
        net_dir = self._dir / NET_DIR_NAME
        if net_dir != self._net_dir and os.path.ismount(net_dir):
            drop_disk(net_dir)  # a crashed server's tmpfs, and every socket in it
        if net_dir.is_dir() and not net_dir.is_symlink():
            for entry in net_dir.iterdir():
                if entry.name not in live:
                    _remove_tree(entry)
        link = self._dir / NET_TEMP_LINK
        try:
            if not link.is_symlink():
                return
            target = Path(os.readlink(link))
            if target == self._net_dir:
                return
            if _is_own_temp_net_dir(target):
                _remove_unheld(target)
            link.unlink()
        except OSError as exc:
            logger.warning("cannot remove a previous server's egress socket folder (%s): %s", link, exc)

    async def close(self, sandbox_id: str) -> None:
        """End every process, remove the cgroup and the files, in that order. The waits (bwrap's
        exit, the cgroup emptying, unmounting and deleting many files: seconds for a tmpfs of
        700,000 files) run in worker threads, so other calls go on meanwhile. Once begun, it runs
        to the end even if the caller is cancelled (a half-closed sandbox would leak its mounts).
        A snapshot or restore of the sandbox under way ends before its files are removed.

        Raises:
            SandboxNotFound: no such sandbox (or it is being closed already).
        """
        box = self._take(sandbox_id)
        self._closing += 1
        with anyio.CancelScope(shield=True):
            try:
                await self._end(box)
            except BaseException:
                # Found by attack (the server's cgroup at its pids limit): a close that failed part-way had its
                # sandbox forgotten, and its disk, loop device, cgroups and host id outlived the server.
                self._unfinished[box.id] = box
                raise
            finally:
                self._closing -= 1

    async def _end(self, box: Sandbox) -> None:
        """`close`'s work, in order, once the sandbox is out of `_boxes`."""
        box.network.close()
        await box.workspace.sandbox.aclose(final=True)
        box.workspace.close()  # nothing left to wait for: its jail's fds, its records
        # A snapshot under way reads the files, a restore writes them as the sandbox's host id:
        # the files, and the id, stay until it ends.
        for busy in (self._archiving.get(box.id), self._restoring.get(box.id)):
            if busy is not None:
                await busy.wait()
        await asyncio.wrap_future(self._workers.submit(self._discard_files, box.id, box.root))
        self._release_identity(box.id)

    def close_unfinished(self, sandbox_id: str) -> bool:
        """Whether `sandbox_id`'s close was cut short part-way (`close` tries it again)."""
        return sandbox_id in self._unfinished

    def _take(self, sandbox_id: str) -> Sandbox:
        box = self._boxes.pop(sandbox_id, None) or self._unfinished.pop(sandbox_id, None)
        if box is None:
            raise SandboxNotFound(f"no sandbox {shown(sandbox_id)}: it was closed, or never existed (list_sandboxes)")
        return box

    def sleep_idle(self, sleep_after_s: float = SLEEP_AFTER_S) -> int:
        """Make idle sandboxes cheap: unused for `sleep_after_s` with nothing running and an
        empty /tmp, a sandbox's processes stop (its files stay); the next command starts it
        again (tens of ms). Returns how many went to sleep."""
        now = time.monotonic()
        return sum(
            1
            for box in self._boxes.values()
            if not box.calls and now - box.last_used >= sleep_after_s and box.workspace.sandbox.sleep()
        )

    async def reap(self) -> list[str]:
        """Close sandboxes past their idle timeout or lifetime; return their ids. Puts idle ones to sleep,
        deletes the snapshots past their retention, and removes the cgroups a close could not (EMFILE)."""
        self.sleep_idle()
        now = time.monotonic()
        expired = [
            box.id
            for box in self._boxes.values()
            if (not box.calls and now - box.last_used > self._config.idle_timeout_s)
            or now - box.created > self._config.lifetime_s
        ]
        closed = []
        for sandbox_id in expired:
            with contextlib.suppress(SandboxNotFound):  # a call closed it while an earlier one was closing
                await self.close(sandbox_id)
                closed.append(sandbox_id)
        for sandbox_id in list(self._unfinished):
            try:
                await self.close(sandbox_id)
            except SandboxNotFound:  # a call finished it meanwhile
                continue
            except Exception as exc:  # still failing: the next tick tries again; the rest of this one goes on
                logger.warning("sandbox %s: its close, cut short before, failed again: %s", sandbox_id, exc)
                continue
            logger.info("sandbox %s: its close, cut short before, is finished", sandbox_id)
        await self._expire_snapshots_logged()
        if self._cgroups is not None:
            await anyio.to_thread.run_sync(destroy_left_groups)
        return closed

    async def _expire_snapshots_logged(self) -> None:
        """The reaper's turn at `expire_snapshots`, in a worker thread; a failure is logged, never raised."""
        try:
            for snapshot_id in await anyio.to_thread.run_sync(self.expire_snapshots, limiter=self._snapshot_admin):
                logger.info("snapshot %s expired: deleted", snapshot_id)
        except BastionError as exc:
            logger.warning("expired snapshots not deleted: %s", exc.reason)

    def close_all(self) -> None:
        """Close everything, waiting here: the server is ending (its event loop has stopped), or a probe is done."""
        for refill in (*self._refills, self._vm_refill):
            if refill is not None:
                refill.cancel()
        # Folder work under way (a sandbox being made or closed) ends first; then what a stopped
        # loop will never hand back to _prepare is removed here.
        for workers in (self._builders, self._workers):
            workers.shutdown(wait=True)
        self._workers = _folder_workers(ending=True)
        self._builders = _folder_workers(background=False, ending=True)
        for sandbox_id, root in list(self._building.items()):
            self._discard_prepared(sandbox_id, root)
        self._building.clear()
        for sandbox_id in [*self._boxes, *self._unfinished]:
            box = self._take(sandbox_id)
            box.network.close(stop_proxy=False)  # the egress service then stops every proxy at once
            box.workspace.close()
            self._discard_prepared(box.id, box.root)
        for prepared in [*self._pooled_all(), *self._starting.values()]:
            prepared.warm.close()
            self._discard_prepared(prepared.id, prepared.root)
        self._pool.clear()
        self._vm_pools.clear()
        self._starting.clear()
        if self._net_dir is not None:
            if self._config.disk_quota and self._net_dir == self._dir / NET_DIR_NAME:
                drop_disk(self._net_dir)
            _remove_tree(self._net_dir)
            self._net_dir = None
            if self._net_hold is not None:
                os.close(self._net_hold)
                self._net_hold = None
            # Closing goes on even on a failed state filesystem (EIO): the folder is gone already.
            with contextlib.suppress(OSError):
                (self._dir / NET_TEMP_LINK).unlink()

    def egress_proxies(self) -> list[str]:
        """The sandboxes whose egress proxy runs now."""
        return self._egress.sandboxes() if self._egress is not None else []

    def close_egress(self) -> None:
        """Stop the egress proxies' thread (after close_all; the server is ending)."""
        if self._egress is not None:
            self._egress.close()


def _taken(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _owner(identity: HostIdentity | None) -> tuple[int, int] | None:
    """Who the host-side tools make files as in a sandbox: its identity, when it has one of its own."""
    return (identity.uid, identity.gid) if identity is not None and identity.switch else None


def _state(warm: backend.Sandbox) -> str:
    if warm.paused:
        return "paused"
    return "asleep" if warm.asleep else "running"


def _binds(template: TemplateConfig) -> tuple[tuple[str, str], ...]:
    """What a template's sandboxes see read-only beyond the system: its folders, its Python environment."""
    binds = tuple((str(b.source), b.dest) for b in template.read_only)
    if template.python_env is not None:
        binds += ((str(template.python_env), ENV_DEST),)
    return binds


def _path(template: TemplateConfig) -> tuple[str, ...]:
    """PATH entries ahead of the system's: the sandbox's own venv first, then the template's."""
    own = (f"{OWN_VENV}/bin",)
    return (*own, f"{ENV_DEST}/bin") if template.python_env is not None else own


def _folder_workers(*, background: bool = True, ending: bool = False) -> ThreadPoolExecutor:
    """Threads for folder work, all started now (`started_pool`); `background` ones at a lower priority
    (`_lower_priority`). `ending`: for a manager that has closed everything, started on demand.

    Raises:
        ConfigError: a thread cannot be started (the host is out of threads).
    """
    name = "bastion-folders" if background else "bastion-builders"
    initializer = _lower_priority if background else None
    if ending:
        return ThreadPoolExecutor(max_workers=_FOLDER_WORKERS, thread_name_prefix=name, initializer=initializer)
    try:
        return started_pool(_FOLDER_WORKERS, name, initializer=initializer)
    except RuntimeError as exc:
        raise ConfigError(f"sandboxes: the threads that make and remove their folders cannot start ({exc})") from None


def _lower_priority() -> None:
    """Folder work is background work: unmounting a tmpfs of 700,000 files is a second of kernel
    time, which must not take a core from the calls of other sandboxes. Linux's nice is per
    thread (setpriority with 0 is the calling thread); mkfs and mount inherit it."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, _FOLDER_NICE)


def _holds_files(workspace: Path) -> bool:
    """Whether a crashed sandbox's workspace has anything to keep. A disk the crash caught between
    `make_disk`'s mkfs and its removal of the empty `lost+found` holds nothing (kill -9 under load
    made such snapshots, one per crash, kept for `orphan_retention_s`)."""
    entries = []
    for entry in workspace.iterdir():
        entries.append(entry)
        if len(entries) > 1:
            return True
    if not entries:
        return False
    (only,) = entries
    if only.name != "lost+found" or only.is_symlink() or not only.is_dir():
        return True
    return any(only.iterdir())


@contextlib.contextmanager
def _state_room() -> Iterator[None]:
    """A full state filesystem (ENOSPC, EDQUOT) while a sandbox's folders are made: a typed refusal saying so."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in STATE_FULL_ERRNOS:
            raise
        raise state_full(repr(exc)) from exc


def _restore_marked(root: Path, restore: Callable[[], SnapshotInfo]) -> SnapshotInfo:
    """Run `restore` with `RESTORING_MARKER` in the sandbox's folder, removed once it succeeded.

    A kill -9 mid-restore leaves the marker, and recovery deletes the half-restored workspace
    instead of keeping it as a `recovered` snapshot. Both changes are made durable (fsync of the
    folder): a power loss must not lose the marker before the restore's files, or bring it back after.
    """
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with _state_room():
            os.close(
                os.open(RESTORING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
            )
            os.fsync(root_fd)
        info = restore()
        os.unlink(RESTORING_MARKER, dir_fd=root_fd)
        os.fsync(root_fd)
    finally:
        os.close(root_fd)
    return info


def _discard(root: Path) -> None:
    """Unmount a sandbox's workspace filesystem if it has one, then delete its folder."""
    drop_disk(root / "workspace")
    _remove_tree(root)


def _is_own_temp_net_dir(path: Path) -> bool:
    """Whether `path` is a socket folder this user made in the temp folder (never follow another link)."""
    if path.parent != Path(tempfile.gettempdir()) or not path.name.startswith(NET_TEMP_PREFIX):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _hold(folder: Path) -> int:
    """An fd of `folder` holding an exclusive flock on it, kept while the folder is in use."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _remove_unheld(folder: Path) -> None:
    """Remove a crashed server's temp socket folder: not one a live server holds (`_hold`).

    Found by attack (two servers on one host): a server started on a copy of a live server's state folder (a
    backup restored beside it, a second config made from a copy) followed the copied `NET_TEMP_LINK` and
    removed the live server's sockets; its warm pool stopped refilling, and its new sandboxes failed.
    """
    try:
        fd = _hold(folder)
    except BlockingIOError:
        logger.info("egress socket folder %s is a live server's: left as it is", folder)
        return
    except OSError as exc:  # no flock there (NFS): whose it is cannot be told
        logger.warning("egress socket folder %s left as it is: it cannot be locked (%s)", folder, exc.strerror)
        return
    try:
        _remove_tree(folder)
    finally:
        os.close(fd)


def _remove_tree(root: Path) -> None:
    # No link followed, at any depth (an agent's 1,200 nested folders made shutil.rmtree recurse past
    # Python's limit, and a close stop half done): `trees.remove_tree`.
    remove_tree(root)


def _disk_bytes(workspace: Path) -> int:
    """Allocated bytes of the workspace, counted without following symlinks (bounded walk, any depth)."""
    if os.path.ismount(workspace):
        return used_bytes(workspace)
    return tree_bytes(workspace, max_entries=_DISK_WALK_MAX_ENTRIES)


def _left_by_a_crash(name: str, group: SandboxCgroup, owner: str) -> bool:
    """Whether the sandbox group `name` is a dead server's, at this server's start (it has made none yet).

    A name with an owner token (`owner_of`) is this state folder's server's or another's. This server's
    predecessor's is dead, whatever still runs in it (killed with it: a VMM's helper that outlived it): the
    state lock says no other server runs on this folder, and a copy of the folder makes a token of its own.
    Another folder's is left to its own server. Found by review: a group's pid names a process only in its
    server's own pid namespace, and a server that is pid 1 of a container destroyed the live groups of another
    container's pid 1, taking them for its own predecessor's.

    A name without one (made before tokens, or the doctor's) is dead when it holds no process and the process
    whose pid it bears is gone, or started after the group was made (its pid reused: found by attack, a
    restarted pid 1 left its predecessor's groups for ever, and its first sandbox was refused). One holding a
    process may be a live server's whose pid this server cannot see (found by review: destroyed live).
    """
    pid = owner_pid(name)
    if pid is None:
        return False  # not a name a server makes
    token = owner_token(name)
    if token is not None:
        return token == owner
    try:
        if group.usage().pids:
            return False  # in use
    except BastionError:
        return False  # removed meanwhile
    started = _process_start(pid)
    if started is None:
        return True
    made = []
    for path in group.paths:
        with contextlib.suppress(OSError):  # a hierarchy a crash left it out of, or removed meanwhile
            made.append(os.stat(path).st_mtime)
    return bool(made) and started > min(made)


def _process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, to a clock tick), or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc_pid_stat(5); `fields` begins at field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None
    # The boot's wall time from the clocks themselves: /proc/stat's btime is cut to the second, and a server
    # restarted within that second would take its predecessor's groups for its own.
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")
