"""Assemble config -> services -> MCP server. The one place that knows every part."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from bastion import __version__
from bastion.config import Config
from bastion.safety.audit import AuditLog
from bastion.safety.errors import AuditUnavailable, BastionError, ConfigError
from bastion.safety.redact import Redactor
from bastion.sandbox._disk import quota_available
from bastion.sandbox.cgroups import CgroupLayout
from bastion.sandboxes import SandboxManager
from bastion.tools._call import CallRunner
from bastion.tools.processes import register_processes
from bastion.tools.sandboxes import register_sandboxes
from bastion.tools.server import BastionServer
from bastion.tools.workbench import register_workbench
from bastion.workspaces import WorkspaceRegistry

logger = logging.getLogger("bastion.app")

INSTRUCTIONS = (
    "bastion gives you a workbench. Every tool returns an OperationResult: ok, code, reason and detail. "
    "Without sandbox_id, tools act on the administrator's host workspace, where commands run without a shell "
    "under an allow-list (explain_command tells whether one is allowed). create_sandbox gives you a disposable "
    "Linux sandbox where any shell command runs (no network); pass its sandbox_id to the work tools and close "
    "it when done. Paths are relative to the workspace."
)


@dataclass
class Services:
    """Everything a running server holds; closed together."""

    config: Config
    redactor: Redactor
    audit: AuditLog
    registry: WorkspaceRegistry
    sandboxes: SandboxManager

    def close(self) -> None:
        self.sandboxes.close_all()
        self.registry.close()
        self.audit.close()


def build_services(config: Config) -> Services:
    """Open the audit log and the workspaces; refuse to start with one line if they cannot be used."""
    redactor = Redactor(extra_patterns=config.redaction.patterns, secret_values=config.secret_values())
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    audit = AuditLog(
        config.audit_path,
        redactor=redactor,
        rotate_bytes=config.audit.rotate_bytes,
        fail_closed=config.audit.fail_closed,
    )
    try:
        audit.open()
    except AuditUnavailable as exc:
        raise ConfigError(f"audit log {config.audit_path}: {exc.reason}") from None
    cgroups = None
    if config.sandboxes.enabled or any(ws.use_cgroups for ws in config.workspace):
        try:
            cgroups = CgroupLayout.detect()
        except BastionError as exc:
            audit.close()
            raise ConfigError(
                f"cgroups: {exc.reason} (run as root or with a delegated cgroup; 'use_cgroups = false' disables limits)"
            ) from None
    if config.sandboxes.enabled and config.sandboxes.disk_quota:
        reason = quota_available()
        if reason is not None:
            audit.close()
            raise ConfigError(f"sandbox disk quota: {reason}: run as root or set [sandboxes] disk_quota = false")
    registry = WorkspaceRegistry(config, redactor, cgroups)
    sandboxes = SandboxManager(config, redactor, cgroups)
    for snapshot_id in sandboxes.recover():
        logger.warning("a previous server left a sandbox: its workspace is snapshot %s", snapshot_id)
    registry.sandboxes = sandboxes
    return Services(config=config, redactor=redactor, audit=audit, registry=registry, sandboxes=sandboxes)


async def _reap_forever(services: Services) -> None:
    while True:
        await anyio.sleep(services.config.sandboxes.reap_interval_s)
        for sandbox_id in services.sandboxes.reap():
            logger.info("closed idle sandbox %s", sandbox_id)


def build_server(services: Services, *, caller: str) -> BastionServer:
    runner = CallRunner(services.audit, caller=caller)

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        # The idle reaper lives as long as the server does.
        async with anyio.create_task_group() as tasks:
            services.sandboxes.refill_pool()
            tasks.start_soon(_reap_forever, services)
            try:
                yield None
            finally:
                tasks.cancel_scope.cancel()

    server = BastionServer(
        runner,
        name="bastion",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level=services.config.log_level,
        lifespan=lifespan,
    )
    register_workbench(server, services.registry, runner)
    register_sandboxes(server, services.sandboxes, services.registry, runner)
    register_processes(server, services.registry, runner)
    logging.getLogger("bastion").setLevel(services.config.log_level)
    return server
