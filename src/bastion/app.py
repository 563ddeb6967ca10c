"""Assemble config -> services -> MCP server. The one place that knows every part."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from bastion import __version__
from bastion.config import Config
from bastion.egress.proxy import EgressService
from bastion.metrics import Metrics
from bastion.organizer import Organizer
from bastion.safety.approvals import ApprovalQueue
from bastion.safety.audit import AuditLog
from bastion.safety.errors import AuditUnavailable, BastionError, ConfigError
from bastion.safety.paths import folder_changeable_by
from bastion.safety.redact import Redactor
from bastion.sandbox import DeviceFolder, ScratchSizes, quota_available
from bastion.sandbox.cgroups import CgroupLayout, owner_of
from bastion.sandbox.identity import IdentityPool, range_conflict, unreachable_folder
from bastion.state_lock import StateLock, replaceable_problem
from bastion.tools import CallRunner
from bastion.tools.code import register_code
from bastion.tools.gateway import register_gateway
from bastion.tools.organizer import Inboxes, register_organizer
from bastion.tools.previews import register_previews
from bastion.tools.processes import register_processes
from bastion.tools.sandboxes import register_sandboxes
from bastion.tools.server import BastionServer
from bastion.tools.terminals import register_terminals
from bastion.tools.threads import ThreadShares
from bastion.tools.workbench import register_workbench
from bastion.workbench.catalog import template_catalog
from bastion.workbench.manager import SandboxManager
from bastion.workbench.previews import PreviewRegistry
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.workspace import HostWorkspace, open_host_workspaces

if TYPE_CHECKING:
    from bastion.gateway.client import GatewayClient

logger = logging.getLogger("bastion.app")
DEVICES_DIR = "dev"  # in state_dir: the sandboxes' own device nodes, on a tmpfs, while the server runs

INSTRUCTIONS = (
    "bastion gives you a workbench. Every tool returns an OperationResult: ok, code, reason and detail. "
    "Without sandbox_id, tools act on the administrator's host workspace, where commands run without a shell "
    "under an allow-list (explain_command tells whether one is allowed)."
)
SANDBOX_INSTRUCTIONS = (
    "create_sandbox gives you a disposable Linux sandbox where any shell command runs (sh -c); its description "
    "lists the templates; pass its sandbox_id to the work tools and close it when done; execute_code runs Python "
    "there in a persistent context (figures come back as images); open_terminal gives a real terminal for "
    "what needs a TTY (a REPL, a password prompt, less, vim)."
)
PATHS_INSTRUCTIONS = "Paths are relative to the workspace."


def toolsets_off(config: Config, *, caller: str) -> list[str]:
    """The tools this config (served over `caller`'s transport) can never serve, each with why (they are
    not listed, and `instructions` says so)."""
    off = []
    if not config.sandboxes.enabled:
        off.append("the sandbox, process, terminal, preview and code tools ([sandboxes] enabled = false)")
    else:
        if not config.sandboxes.network.registry:
            off.append("install_package ([sandboxes.network] registry is empty)")
        if not config.sandboxes.snapshots_allowed:
            off.append("snapshot_sandbox (a [sandboxes] snapshot cap is 0)")
        preview_off = previews_off(config)
        if preview_off is not None:
            off.append(f"expose_port and the other preview tools ({preview_off})")
    if not config.inbox:
        off.append("the organizer tools (no [[inbox]] is configured)")
    off += [
        f"the {gateway.name}_* gateway tools (gateway {gateway.name!r} has no pinned host_key)"
        for gateway in config.gateway
        if gateway.host_key is None
    ]
    return off


def previews_off(config: Config) -> str | None:
    """Why preview URLs cannot work here, or None. They are served by the HTTP front's second listener
    in the process that owns the sandboxes: `serve --http`, or `serve --stdio`, which then runs the HTTP
    front beside stdio."""
    if config.http.preview_listen is None:
        return "[http] preview_listen is not set: an administrator sets it, and an admin password, to serve them"
    return None


def server_instructions(config: Config, *, caller: str) -> str:
    """The MCP initialize result's instructions: how to start, and which toolsets are off and why."""
    parts = [INSTRUCTIONS]
    if config.sandboxes.enabled:
        parts.append(SANDBOX_INSTRUCTIONS)
    parts.append(PATHS_INSTRUCTIONS)
    off = toolsets_off(config, caller=caller)
    if off:
        parts.append(f"Not offered by this server's configuration: {'; '.join(off)}.")
    return " ".join(parts)


@dataclass
class Services:
    """Everything a running server holds; closed together."""

    config: Config
    redactor: Redactor
    audit: AuditLog
    registry: WorkspaceRegistry
    sandboxes: SandboxManager
    approvals: ApprovalQueue | None = None
    """The approval queue (`<state_dir>/bastion.db`); build_services always sets it."""
    gateways: dict[str, GatewayClient] = field(default_factory=dict)
    """Gateway name -> its SSH client (connections open on first use, close with the server's lifespan)."""
    organizers: dict[str, Organizer] = field(default_factory=dict)
    """Inbox id -> its organizer (journal recovered at start), in config order."""
    devices: DeviceFolder | None = None
    """The sandboxes' own device nodes (a root server's)."""
    identities: IdentityPool | None = None
    """The host ids handed out; closed once nothing runs as them."""
    state_lock: StateLock | None = None
    """This server's exclusive hold on the state folder; released last."""
    previews: PreviewRegistry | None = None
    """Preview URLs of this process's sandboxes (served by the HTTP preview listener, if any)."""
    metrics: Metrics | None = None
    """This server's Prometheus metrics; None when `[metrics] enabled = false`."""
    cgroups: CgroupLayout | None = None
    """The cgroup layout, when sandboxes or a workspace use cgroups (a readiness check reads it)."""

    def close(self) -> None:
        for organizer in self.organizers.values():
            organizer.close()
        self.sandboxes.close_all()
        self.sandboxes.close_egress()
        self.registry.close()
        if self.devices is not None:
            self.devices.close()
        if self.identities is not None:
            self.identities.close()
        self.audit.close()
        if self.state_lock is not None:
            self.state_lock.release()


def detect_cgroups(config: Config, owner: str = "") -> CgroupLayout | None:
    """The cgroup layout, when sandboxes are on or a workspace uses cgroups; else None. `owner`: the token of
    this server's group names (`owner_of`; the doctor's trial sandboxes have none).

    Raises:
        ConfigError: cgroups are needed and cannot be used here.
    """
    if not config.sandboxes.enabled and not any(ws.use_cgroups for ws in config.workspace):
        return None
    try:
        return CgroupLayout.detect(owner=owner)
    except BastionError as exc:
        raise ConfigError(f"cgroups: {exc.reason} ({without_cgroups(config)})") from None


def owner_token(config: Config) -> str:
    """This server's cgroup owner token (`owner_of`), read or made under the state folder's lock.

    Raises:
        ConfigError: the state folder's token file cannot be read or written.
    """
    try:
        return owner_of(config.state_dir)
    except BastionError as exc:
        raise ConfigError(f"cgroups: {exc.reason}") from None


def without_cgroups(config: Config) -> str:
    """What to change when cgroups cannot be used: the setting that actually helps here."""
    fix = "run as root or in a delegated cgroup (see docs/configuration.md)"
    if config.sandboxes.enabled:  # sandboxes always need cgroups: only turning them off helps
        return f"{fix}; or serve host workspaces only: [sandboxes] enabled = false"
    limited = ", ".join(ws.id for ws in config.workspace if ws.use_cgroups)
    return f"{fix}; or set use_cgroups = false on workspace {limited} (its commands then run without limits)"


def check_disk_quota(config: Config) -> None:
    """Raise ConfigError if sandboxes need a disk quota that this machine cannot give."""
    if config.sandboxes.enabled and config.sandboxes.disk_quota:
        reason = quota_available()
        if reason is not None:
            raise ConfigError(f"sandbox disk quota: {reason}: run as root or set [sandboxes] disk_quota = false")


def identity_problem(config: Config) -> str | None:
    """Why a root server could not hand out `host_id_range` (one line), else None; changes nothing."""
    first, count = config.sandboxes.host_ids
    vm_templates = sum(template.isolation == "microvm" for template in config.template)
    pools = config.sandboxes.warm_pool + config.sandboxes.microvm.warm_pool * vm_templates
    needed = config.sandboxes.max_sandboxes + pools + len(config.workspace)
    if count < needed:
        return (
            f"[sandboxes] host_id_range has {count} ids, fewer than max_sandboxes + warm_pool + host workspaces "
            f"({needed}): widen it"
        )
    conflict = range_conflict(first, count)
    if conflict is not None:
        return f"[sandboxes] host_id_range: {conflict}: choose a range no account uses"
    # The state folder itself is bastion's, made passable at start; the folders above it are not.
    blocked = unreachable_folder(config.state_dir.parent)
    if blocked is not None:
        return (
            f"state_dir {config.state_dir}: {blocked} cannot be passed through by the sandboxes' ids "
            "(no o+x): run 'chmod o+x' on it or choose a state_dir elsewhere"
        )
    for template in config.template:
        sources = [bind.source for bind in template.read_only]
        sources += [template.python_env] if template.python_env is not None else []
        for source in sources:
            blocked = unreachable_folder(source / "x")  # the folder itself must be passable too
            if blocked is not None:
                return (
                    f"template {template.name!r}: {blocked} cannot be passed through by the sandboxes' ids "
                    f"(no o+x), so {source} cannot be shown in its sandboxes: run 'chmod o+x' on it"
                )
    return None


def state_problem(config: Config) -> str | None:
    """Why another user could replace the state folder or change the audit log's folder (one line), or None.

    The state folder holds the database, the admin password's hash and the mounts a root server
    unmounts by path at stop; the audit log's folder (the state folder, or a custom [audit] path's)
    holds the log and its rotated files. Judged where they will be made when they do not exist yet.
    """
    problem = replaceable_problem(config.state_dir, "state folder", "choose a state_dir elsewhere")
    if problem is not None:
        return problem
    folder = config.audit_path.parent
    if folder != config.state_dir and not os.path.lexists(folder):
        # Found by review: judged by the sticky folder above it, a missing one passed, and the log was then
        # opened there by name: another user could make the folder first. The server makes no folder but its
        # state folder (judged again once made: `StateLock.acquire`).
        return (
            f"the audit log's folder {folder} does not exist: make it (not writable by others) or choose another "
            "[audit] path"
        )
    return audit_folder_problem(folder)


def audit_folder_problem(folder: Path) -> str | None:
    """Why a user besides root and this process's could change what `folder` holds (one line), or None.

    Stricter than the state folder's check: a sticky folder others may write (/tmp) is refused too, since
    they may still add the names that are missing there, and the log trusts its rotated files by name:
    a FIFO as the newest ``audit.jsonl.N`` hung the start, a chain forged from genesis passed `audit verify`.
    """
    return replaceable_problem(folder, "the audit log's folder", "choose another [audit] path", folder_changeable_by)


def open_identities(config: Config) -> IdentityPool:
    """The host ids sandboxes and host workspaces run as; checked when the server is root (it hands them out).

    Raises:
        ConfigError: the range holds an account or a subordinate range, or the state folder
            cannot be passed through by an id of the range.
    """
    pool = IdentityPool(*config.sandboxes.host_ids)
    if not pool.switches:
        return pool
    problem = identity_problem(config)
    if problem is not None:
        raise ConfigError(problem)
    # Passable, never listable: a sandbox's bubblewrap finds its own folders by name.
    config.state_dir.chmod(0o711)
    return pool


def scratch_sizes(config: Config) -> ScratchSizes:
    """Caps of every sandbox's /tmp and /dev/shm (host workspaces' too)."""
    box = config.sandboxes
    return ScratchSizes(tmp_bytes=box.tmp_bytes, shm_bytes=box.shm_bytes, inodes=box.scratch_inodes)


def _gateway_clients(config: Config, redactor: Redactor) -> dict[str, GatewayClient]:
    """A client per gateway with a pinned host key (one without has no tools: it would refuse every call)."""
    pinned = [gateway for gateway in config.gateway if gateway.host_key is not None]
    if not pinned:
        return {}
    from bastion.gateway.client import GatewayClient  # asyncssh: a seventh of the start, for gateways only

    return {gateway.name: GatewayClient(gateway, redactor) for gateway in pinned}


def build_services(config: Config) -> Services:
    """Lock the state folder, open the audit log and the workspaces; refuse to start with one line if unusable.

    Everything is opened under one `ExitStack`: a refusal part-way closes what was opened before
    it, in reverse order (a held journal lock, state lock or mount would stop the next start).
    """
    redactor = Redactor(extra_patterns=config.redaction.patterns, secret_values=config.secret_values())
    problem = state_problem(config)
    if problem is not None:
        raise ConfigError(problem)
    warning = config.exposed_secrets()
    if warning is not None:
        logger.warning("%s", warning)
    # Made only where no one else could replace it; `StateLock.acquire` judges it again as made.
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    metrics = Metrics() if config.metrics.enabled else None
    with contextlib.ExitStack() as opened:
        # First: a second server would take the first one's live sandboxes and mounts for a crash's leftovers.
        state_lock = StateLock(config.state_dir)
        state_lock.acquire()
        opened.callback(state_lock.release)
        audit = open_audit(config, redactor, opened, metrics)
        organizers = open_organizers(config, audit)
        for organizer in organizers.values():
            opened.callback(organizer.close)
        cgroups = detect_cgroups(config, owner_token(config))
        check_disk_quota(config)
        identities = open_identities(config)
        opened.callback(identities.close)
        devices = open_devices(config, identities, opened)
        hosts = open_hosts(config, redactor, cgroups, identities, devices, opened)
        # One event loop thread serves every sandbox's egress proxy; it starts only if sandboxes are on.
        network = config.sandboxes.network
        egress = EgressService.from_config(audit, network, metrics) if config.sandboxes.enabled else None
        if egress is not None:
            opened.callback(egress.close)
        sandboxes = SandboxManager(config, redactor, cgroups, egress, identities, devices)
        opened.callback(sandboxes.close_all)
        recover(sandboxes, audit)
        if metrics is not None:
            metrics.watch_sandboxes(sandboxes)
        registry = WorkspaceRegistry(hosts, sandboxes, default=config.default_workspace)
        services = Services(
            config=config,
            redactor=redactor,
            audit=audit,
            registry=registry,
            sandboxes=sandboxes,
            previews=PreviewRegistry(
                sandboxes,
                lifetime_s=config.http.preview_lifetime_s,
                public_allowed=config.http.preview_public_allowed,
            ),
            approvals=ApprovalQueue(config.db_path, webhook_url=config.approvals.webhook_url),
            gateways=_gateway_clients(config, redactor),
            organizers=organizers,
            devices=devices,
            identities=identities,
            state_lock=state_lock,
            metrics=metrics,
            cgroups=cgroups,
        )
        opened.pop_all()  # from here `Services.close` owns them
    return services


def open_audit(
    config: Config, redactor: Redactor, opened: contextlib.ExitStack, metrics: Metrics | None = None
) -> AuditLog:
    """The audit log, open for appending, closed by `opened`."""
    audit = AuditLog(
        config.audit_path,
        redactor=redactor,
        rotate_bytes=config.audit.rotate_bytes,
        reserve_bytes=config.audit.reserve_bytes,
        fail_closed=config.audit.fail_closed,
        metrics=metrics,
    )
    try:
        audit.open()
    except AuditUnavailable as exc:
        # Each reason names its file, the log's or a rotated one's (`<log>.N`): not twice.
        reason = exc.reason if str(config.audit_path) in exc.reason else f"audit log {config.audit_path}: {exc.reason}"
        raise ConfigError(reason) from None
    opened.callback(audit.close)
    return audit


def open_devices(config: Config, identities: IdentityPool, opened: contextlib.ExitStack) -> DeviceFolder | None:
    """The sandboxes' own device nodes (a root server's, which hands out ids), closed by `opened`."""
    if not identities.switches:
        return None
    devices = DeviceFolder(config.state_dir / DEVICES_DIR, scratch_sizes(config))
    devices.open()
    opened.callback(devices.close)
    return devices


def open_hosts(
    config: Config,
    redactor: Redactor,
    cgroups: CgroupLayout | None,
    identities: IdentityPool,
    devices: DeviceFolder | None,
    opened: contextlib.ExitStack,
) -> dict[str, HostWorkspace]:
    """The configured host workspaces, closed by `opened`.

    Raises:
        ConfigError: one cannot be served (see `open_host_workspaces`).
    """
    try:
        hosts = open_host_workspaces(config, redactor, cgroups, identities, devices)
    except BastionError as exc:
        raise ConfigError(f"workspaces: {exc.reason}") from None
    for host in hosts.values():
        opened.callback(host.close)
    return hosts


def recover(sandboxes: SandboxManager, audit: AuditLog) -> None:
    """Keep what a crashed server's sandboxes left as snapshots (`SandboxManager.recover`), each in the audit log.

    Raises:
        ConfigError: the state folder's sandboxes or snapshots cannot be read, or the audit log written.
    """

    def keeping(sandbox_id: str) -> None:
        message = f"a previous server left sandbox {sandbox_id}: keeping its workspace as a snapshot"
        record_recovery(audit, {"what": "sandbox", "phase": "start", "sandbox_id": sandbox_id, "message": message})

    try:
        made = sandboxes.recover(keeping)
    except BastionError as exc:
        # The administrator's line: the detail names what the client's reason leaves out (host paths).
        detail = f" ({exc.detail})" if exc.detail else ""
        raise ConfigError(f"sandbox recovery: {exc.reason}{detail}") from None
    for sandbox_id, snapshot_id in made:
        message = f"a previous server left a sandbox: its workspace is snapshot {snapshot_id}"
        logger.warning("%s", message)
        record = {"what": "sandbox", "phase": "end", "sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        record_recovery(audit, {**record, "message": message})


def record_recovery(audit: AuditLog, record: dict[str, object]) -> None:
    """An audit record of what a start did about a crash. Found by attack: recovery's rollbacks and kept
    sandboxes were told only on stderr, and the chain showed a start record with no end and nothing after.
    Each comes in two: ``phase`` "start" before the recovery acts, "end" after (found by review: a crash
    between the act and a single record after it left nothing in the chain).

    Raises:
        ConfigError: the record cannot be written (fail-closed: the start stops).
    """
    try:
        audit.append({"event": "recovery", "tool": "server_start", **record})
    except BastionError as exc:
        raise ConfigError(f"audit log {audit.path}: the crash recovery cannot be recorded: {exc.reason}") from None


def open_organizers(config: Config, audit: AuditLog) -> dict[str, Organizer]:
    """One organizer per inbox, each after rolling back what a crash left unfinished in its journal (recorded
    in the audit log)."""
    organizers: dict[str, Organizer] = {}
    try:
        for inbox in config.inbox:
            try:
                organizer = Organizer(inbox, config.state_dir)
            except BastionError as exc:
                raise ConfigError(f"inbox {inbox.id!r} ({inbox.path}): {exc.reason}") from None
            organizers[inbox.id] = organizer
            recovery: dict[str, object] = {"what": "organizer", "inbox": inbox.id}

            def rolling_back(message: str, recovery: dict[str, object] = recovery) -> None:
                record_recovery(audit, {**recovery, "phase": "start", "message": message})

            message = organizer.open(rolling_back)
            if message is not None:
                logger.warning("%s", message)
                record_recovery(audit, {**recovery, "phase": "end", "message": message})
    except BaseException:
        for organizer in organizers.values():
            organizer.close()
        raise
    return organizers


async def reap_forever(services: Services) -> None:
    failed = ""
    while True:
        await anyio.sleep(services.config.sandboxes.reap_interval_s)
        try:
            reaped = await services.sandboxes.reap()
        except Exception as exc:
            # Found by attack (the server's cgroup at its pids limit): a tick that could not start a thread ended
            # the whole server, its task group cancelled. The next tick tries again; the same failure is said once.
            if str(exc) != failed:
                logger.error(
                    "the idle sandbox reaper failed, tried again in %s s: %s",
                    services.config.sandboxes.reap_interval_s,
                    exc,
                )
            failed = str(exc)
            continue
        failed = ""
        for sandbox_id in reaped:
            logger.info("closed idle sandbox %s", sandbox_id)


def build_server(services: Services, *, caller: str) -> BastionServer:
    audit = services.config.audit
    runner = CallRunner(
        services.audit,
        caller=caller,
        metrics=services.metrics,
        caller_bytes_per_s=audit.caller_bytes_per_s,
        caller_burst_bytes=audit.caller_burst_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        # The idle reaper lives as long as the server does.
        async with anyio.create_task_group() as tasks:
            services.sandboxes.refill_pool()
            tasks.start_soon(reap_forever, services)
            try:
                yield None
            finally:
                tasks.cancel_scope.cancel()
                for gateway in services.gateways.values():
                    with anyio.CancelScope(shield=True):
                        await gateway.close()

    server = BastionServer(
        runner,
        name="bastion",
        version=__version__,
        instructions=server_instructions(services.config, caller=caller),
        log_level=services.config.log_level,
        lifespan=lifespan,
        # bastion sends no list_changed or resource events: a `subscriptions/listen` stream (2026-07-28) would
        # only hold a connection. Found by attack: one token's 1,024 of them took every connection slot, and
        # revoking it ended none.
        subscriptions=False,
    )
    register_toolsets(server, services, caller=caller)
    logging.getLogger("bastion").setLevel(services.config.log_level)
    return server


def register_toolsets(server: BastionServer, services: Services, *, caller: str) -> None:
    """Every toolset the config can serve (see `toolsets_off` for the rest)."""
    config = services.config
    sandboxes = config.sandboxes.enabled
    network = sandboxes and bool(config.sandboxes.network.allow)
    threads = ThreadShares()
    register_workbench(server, services.registry, threads, sandboxes=sandboxes, network=network)
    if config.inbox:
        register_organizer(server, Inboxes(services.organizers), threads)
    if sandboxes:
        catalog = template_catalog(config.sandboxes, config.template)
        packages = bool(config.sandboxes.network.registry)
        register_sandboxes(
            server,
            services.sandboxes,
            services.registry,
            catalog,
            threads=threads,
            network=network,
            package_registry=packages,
            snapshots=config.sandboxes.snapshots_allowed,
        )
        register_processes(server, services.registry, threads)
        register_terminals(server, services.registry, threads)
        register_code(server, services.sandboxes, services.registry, config.sandboxes, threads)
        if services.previews is not None and previews_off(config) is None:
            register_previews(server, services.previews, services.registry)
    if services.approvals is not None and services.gateways:  # only gateways with a pinned key have clients
        register_gateway(server, services.gateways, services.approvals, config.approvals)
