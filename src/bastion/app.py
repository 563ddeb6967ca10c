"""Assemble config -> services -> MCP server. The one place that knows every part."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bastion import __version__
from bastion.config import Config
from bastion.safety.audit import AuditLog
from bastion.safety.errors import AuditUnavailable, BastionError, ConfigError
from bastion.safety.redact import Redactor
from bastion.sandbox.cgroups import CgroupLayout
from bastion.tools._call import CallRunner
from bastion.tools.server import BastionServer
from bastion.tools.workbench import register_workbench
from bastion.workspaces import WorkspaceRegistry

INSTRUCTIONS = (
    "bastion gives you a workbench in jailed workspaces. Every tool returns an OperationResult: "
    "ok, code, reason and detail. Commands run without a shell; use explain_command to see whether a "
    "command is allowed before running it. Paths are relative to the workspace."
)


@dataclass
class Services:
    """Everything a running server holds; closed together."""

    config: Config
    redactor: Redactor
    audit: AuditLog
    registry: WorkspaceRegistry

    def close(self) -> None:
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
    if any(ws.use_cgroups for ws in config.workspace):
        try:
            cgroups = CgroupLayout.detect()
        except BastionError as exc:
            audit.close()
            raise ConfigError(
                f"cgroups: {exc.reason} (run as root or with a delegated cgroup; 'use_cgroups = false' disables limits)"
            ) from None
    registry = WorkspaceRegistry(config, redactor, cgroups)
    return Services(config=config, redactor=redactor, audit=audit, registry=registry)


def build_server(services: Services, *, caller: str) -> BastionServer:
    runner = CallRunner(services.audit, caller=caller)

    server = BastionServer(
        runner,
        name="bastion",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level=services.config.log_level,
    )
    register_workbench(server, services.registry, runner)
    logging.getLogger("bastion").setLevel(services.config.log_level)
    return server
