"""MCP wiring of the sandbox lifecycle: create, list, status, pause, resume, close, create_run_close, snapshots.

Host workspaces are the administrator's: an agent may work in them but never
pause or close them (FORBIDDEN).
"""

from __future__ import annotations

from typing import Annotated

from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from bastion.safety.results import OperationResult
from bastion.snapshot.store import SnapshotInfo
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.workbench import command_result
from bastion.workbench.manager import SandboxManager
from bastion.workbench.registry import WorkspaceRegistry

SandboxIdArg = Annotated[str, Field(description="The sandbox id from create_sandbox, e.g. sb-1a2b3c4d5e6f.")]

_MUTATES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)
_READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Deleting twice leaves the same state (the second call answers NOT_FOUND).
_DELETES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)
SnapshotIdArg = Annotated[str, Field(description="A snapshot id from snapshot_sandbox or list_snapshots.")]


class LimitsArg(BaseModel):
    """Narrower limits than the administrator's ceiling; omitted ones take the ceiling."""

    model_config = ConfigDict(extra="forbid")

    memory_bytes: int | None = None
    pids: int | None = None
    cpu_cores: float | None = None
    timeout_s: float | None = None
    max_output_bytes: int | None = None
    disk_bytes: int | None = None

    def requested(self) -> dict[str, object]:
        return {key: value for key, value in self.model_dump().items() if value is not None}


def _snapshot_detail(info: SnapshotInfo, manager: SandboxManager) -> dict[str, object]:
    return {
        "snapshot_id": info.id,
        "label": info.label,
        "created": info.created,
        "files": info.files,
        # Entries not stored (FIFOs, sockets, devices, names or links a restore would refuse): never silently.
        "skipped": _count(info.metadata.get("skipped")),
        "bytes": info.bytes,
        "archive_bytes": info.archive_bytes,
        "sha256": info.sha256,
        "sandbox_id": info.metadata.get("sandbox_id"),
        "recovered": info.metadata.get("recovered") == "true",
        "expires": round(manager.snapshot_expires(info), 3),
    }


def _count(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def register_sandboxes(server: BastionServer, manager: SandboxManager, registry: WorkspaceRegistry) -> None:
    """Add the sandbox lifecycle tools to `server`."""
    runner = server.runner
    in_sandbox = workspace_of("sandbox_id")

    def agent_owned(sandbox_id: str, what: str) -> None:
        # FORBIDDEN for a host workspace: the one decision, `HostWorkspace.require_sandbox`.
        registry.resolve(sandbox_id).workspace.require_sandbox(what)

    @audited_tool(
        server,
        "create_sandbox",
        mutating=True,
        annotations=_MUTATES,
        description=(
            "Create a disposable Linux sandbox with an empty /workspace. Inside, run_command runs any shell command "
            "(sh -c). There is no network unless network_allow names destinations the administrator allows; "
            "they are reached through a proxy (HTTP(S)_PROXY is set) and every attempt is recorded. Pass its "
            "sandbox_id to the work tools. Close it when done."
        ),
    )
    async def create_sandbox(
        template: Annotated[str | None, Field(description="A template configured by the administrator.")] = None,
        name: str | None = None,
        limits: LimitsArg | None = None,
        network_allow: Annotated[
            list[str] | None,
            Field(
                description="Destinations to allow, e.g. ['api.github.com', '*.example.org:8443']; each must be "
                "within the administrator's allowlist. Default: the template's (usually none).",
                max_length=256,
            ),
        ] = None,
    ) -> dict[str, object]:
        requested = limits.requested() if limits else None
        box = await manager.create(
            owner=runner.identity(), name=name, limits=requested, template=template, network_allow=network_allow
        )
        return {**box.summary(), "limits": box.limits.model_dump(), "workspace": "/workspace"}

    @audited_tool(server, "list_sandboxes", mutating=False, annotations=_READS, description="List the open sandboxes.")
    async def list_sandboxes() -> dict[str, object]:
        return {"sandboxes": [box.summary() for box in manager.all()]}

    @audited_tool(
        server,
        "get_sandbox_status",
        mutating=False,
        annotations=_READS,
        workspace=in_sandbox,
        description="State, age, idle time, limits and live memory, CPU, process and disk use of a sandbox.",
    )
    async def get_sandbox_status(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "get_sandbox_status")
        return manager.status(sandbox_id)

    @audited_tool(
        server,
        "pause_sandbox",
        mutating=True,
        annotations=_MUTATES,
        workspace=in_sandbox,
        description="Freeze every process of a sandbox: it uses no CPU until resume_sandbox. Files stay reachable.",
    )
    async def pause_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "pause_sandbox")
        return manager.pause(sandbox_id).summary()

    @audited_tool(
        server,
        "resume_sandbox",
        mutating=True,
        annotations=_MUTATES,
        workspace=in_sandbox,
        description="Thaw a paused sandbox.",
    )
    async def resume_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "resume_sandbox")
        return manager.resume(sandbox_id).summary()

    @audited_tool(
        server,
        "close_sandbox",
        mutating=True,
        annotations=_MUTATES,
        workspace=in_sandbox,
        description="End a sandbox: every process is killed and its files are deleted.",
    )
    async def close_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "close_sandbox")
        await manager.close(sandbox_id)  # the waits run in worker threads: other calls go on
        return {"sandbox_id": sandbox_id, "state": "closed"}

    @audited_tool(
        server,
        "snapshot_sandbox",
        mutating=True,
        annotations=_MUTATES,
        workspace=in_sandbox,
        description=(
            "Save a sandbox's /workspace (files, folders, symlinks, modes) to a compressed snapshot. "
            "restore_sandbox makes a new sandbox from it. Snapshots are capped in number and size, per sandbox "
            "and in total, and expire (see 'expires'); delete_snapshot frees room. FIFOs, sockets, devices and "
            "names a restore would refuse are not stored: 'skipped' counts them."
        ),
    )
    async def snapshot_sandbox(sandbox_id: SandboxIdArg, label: str | None = None) -> dict[str, object]:
        agent_owned(sandbox_id, "snapshot_sandbox")
        return _snapshot_detail(await manager.snapshot(sandbox_id, label), manager)

    @audited_tool(
        server,
        "restore_sandbox",
        mutating=True,
        annotations=_MUTATES,
        description="Create a new sandbox whose /workspace is a snapshot's, byte for byte.",
    )
    async def restore_sandbox(
        snapshot_id: Annotated[str, Field(description="The id from snapshot_sandbox, e.g. snap-0123456789abcdef.")],
    ) -> dict[str, object]:
        box, info = await manager.restore(snapshot_id, owner=runner.identity())
        return {**box.summary(), "snapshot": _snapshot_detail(info, manager), "workspace": "/workspace"}

    @audited_tool(
        server,
        "list_snapshots",
        mutating=False,
        annotations=_READS,
        description="List the snapshots, including those kept from sandboxes of a server that crashed.",
    )
    async def list_snapshots() -> dict[str, object]:
        return {"snapshots": [_snapshot_detail(info, manager) for info in manager.snapshots()]}

    @audited_tool(
        server,
        "delete_snapshot",
        mutating=True,
        annotations=_DELETES,
        description="Delete a snapshot: its archive is gone and its room is free. Sandboxes restored from it keep "
        "their files.",
    )
    async def delete_snapshot(snapshot_id: SnapshotIdArg) -> dict[str, object]:
        await manager.delete_snapshot(snapshot_id)
        return {"snapshot_id": snapshot_id, "state": "deleted"}

    @audited_tool(
        server,
        "create_run_close",
        mutating=True,
        annotations=_MUTATES,
        description=(
            "One-shot: create a sandbox, write `files` (path -> text) into /workspace, run `command` (sh -c), "
            "return its output, and close the sandbox."
        ),
    )
    async def create_run_close(
        command: str,
        files: Annotated[dict[str, str] | None, Audit.KEYS] = None,
        timeout_s: float | None = None,
        limits: LimitsArg | None = None,
    ) -> OperationResult:
        box = await manager.create(owner=runner.identity(), limits=limits.requested() if limits else None)
        try:
            for path, content in (files or {}).items():
                box.workspace.write_file(path, content, encoding="utf-8", append=False)
            out = await box.workspace.run(command, cwd=None, timeout_s=timeout_s)
        finally:
            await manager.close(box.id)
        return command_result(out, {"sandbox_id": box.id})
