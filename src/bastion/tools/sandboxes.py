"""MCP wiring of the sandbox lifecycle: create, list, status, pause, resume, close, create_run_close, snapshots.

Host workspaces are the administrator's: an agent may work in them but never
pause or close them (FORBIDDEN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from mcp_types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from bastion.safety.errors import Forbidden
from bastion.safety.results import OperationResult
from bastion.snapshot.store import SnapshotInfo
from bastion.tools._call import CallRunner
from bastion.tools.server import BastionServer, to_call_result
from bastion.tools.workbench import command_result
from bastion.workbench.manager import SandboxManager
from bastion.workbench.registry import WorkspaceRegistry

Result = Annotated[CallToolResult, OperationResult]
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


def register_sandboxes(
    server: BastionServer, manager: SandboxManager, registry: WorkspaceRegistry, runner: CallRunner
) -> None:
    """Add the sandbox lifecycle tools to `server`."""

    def agent_owned(sandbox_id: str) -> None:
        if registry.is_host(sandbox_id):
            raise Forbidden(f"{sandbox_id!r} is a host workspace of the administrator: agents cannot pause or close it")

    async def on_sandbox(
        action: str, sandbox_id: str, act: Callable[[], dict[str, object]], *, mutating: bool = True
    ) -> CallToolResult:
        """One synchronous manager action on an agent's sandbox, under the call runner."""

        async def op() -> OperationResult:
            agent_owned(sandbox_id)
            return OperationResult.success(action, act())

        args = {"sandbox_id": sandbox_id}
        return to_call_result(await runner.run(action, args, op, mutating=mutating, workspace=sandbox_id))

    @server.tool(
        name="create_sandbox",
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
    ) -> Result:
        async def op() -> OperationResult:
            requested = limits.requested() if limits else None
            box = await manager.create(
                owner=runner.identity(), name=name, limits=requested, template=template, network_allow=network_allow
            )
            detail = {**box.summary(), "limits": box.limits.model_dump(), "workspace": "/workspace"}
            return OperationResult.success("create_sandbox", detail)

        args = {
            "template": template,
            "name": name,
            "limits": limits.requested() if limits else None,
            "network_allow": network_allow,
        }
        return to_call_result(await runner.run("create_sandbox", args, op, mutating=True))

    @server.tool(name="list_sandboxes", annotations=_READS, description="List the open sandboxes.")
    async def list_sandboxes() -> Result:
        async def op() -> OperationResult:
            return OperationResult.success("list_sandboxes", {"sandboxes": [box.summary() for box in manager.all()]})

        return to_call_result(await runner.run("list_sandboxes", {}, op, mutating=False))

    @server.tool(
        name="get_sandbox_status",
        annotations=_READS,
        description="State, age, idle time, limits and live memory, CPU, process and disk use of a sandbox.",
    )
    async def get_sandbox_status(sandbox_id: SandboxIdArg) -> Result:
        return await on_sandbox("get_sandbox_status", sandbox_id, lambda: manager.status(sandbox_id), mutating=False)

    @server.tool(
        name="pause_sandbox",
        annotations=_MUTATES,
        description="Freeze every process of a sandbox: it uses no CPU until resume_sandbox. Files stay reachable.",
    )
    async def pause_sandbox(sandbox_id: SandboxIdArg) -> Result:
        return await on_sandbox("pause_sandbox", sandbox_id, lambda: manager.pause(sandbox_id).summary())

    @server.tool(name="resume_sandbox", annotations=_MUTATES, description="Thaw a paused sandbox.")
    async def resume_sandbox(sandbox_id: SandboxIdArg) -> Result:
        return await on_sandbox("resume_sandbox", sandbox_id, lambda: manager.resume(sandbox_id).summary())

    @server.tool(
        name="close_sandbox",
        annotations=_MUTATES,
        description="End a sandbox: every process is killed and its files are deleted.",
    )
    async def close_sandbox(sandbox_id: SandboxIdArg) -> Result:
        async def op() -> OperationResult:
            agent_owned(sandbox_id)
            await manager.close(sandbox_id)  # the waits run in worker threads: other calls go on
            return OperationResult.success("close_sandbox", {"sandbox_id": sandbox_id, "state": "closed"})

        args = {"sandbox_id": sandbox_id}
        return to_call_result(await runner.run("close_sandbox", args, op, mutating=True, workspace=sandbox_id))

    @server.tool(
        name="snapshot_sandbox",
        annotations=_MUTATES,
        description=(
            "Save a sandbox's /workspace (files, folders, symlinks, modes) to a compressed snapshot. "
            "restore_sandbox makes a new sandbox from it. Snapshots are capped in number and size, per sandbox "
            "and in total, and expire (see 'expires'); delete_snapshot frees room. FIFOs, sockets, devices and "
            "names a restore would refuse are not stored: 'skipped' counts them."
        ),
    )
    async def snapshot_sandbox(sandbox_id: SandboxIdArg, label: str | None = None) -> Result:
        async def op() -> OperationResult:
            agent_owned(sandbox_id)
            info = await manager.snapshot(sandbox_id, label)
            return OperationResult.success("snapshot_sandbox", _snapshot_detail(info, manager))

        args = {"sandbox_id": sandbox_id, "label": label}
        return to_call_result(await runner.run("snapshot_sandbox", args, op, mutating=True, workspace=sandbox_id))

    @server.tool(
        name="restore_sandbox",
        annotations=_MUTATES,
        description="Create a new sandbox whose /workspace is a snapshot's, byte for byte.",
    )
    async def restore_sandbox(
        snapshot_id: Annotated[str, Field(description="The id from snapshot_sandbox, e.g. snap-0123456789abcdef.")],
    ) -> Result:
        async def op() -> OperationResult:
            box, info = await manager.restore(snapshot_id, owner=runner.identity())
            detail = {**box.summary(), "snapshot": _snapshot_detail(info, manager), "workspace": "/workspace"}
            return OperationResult.success("restore_sandbox", detail)

        return to_call_result(await runner.run("restore_sandbox", {"snapshot_id": snapshot_id}, op, mutating=True))

    @server.tool(
        name="list_snapshots",
        annotations=_READS,
        description="List the snapshots, including those kept from sandboxes of a server that crashed.",
    )
    async def list_snapshots() -> Result:
        async def op() -> OperationResult:
            snapshots = [_snapshot_detail(info, manager) for info in manager.snapshots()]
            return OperationResult.success("list_snapshots", {"snapshots": snapshots})

        return to_call_result(await runner.run("list_snapshots", {}, op, mutating=False))

    @server.tool(
        name="delete_snapshot",
        annotations=_DELETES,
        description="Delete a snapshot: its archive is gone and its room is free. Sandboxes restored from it keep "
        "their files.",
    )
    async def delete_snapshot(snapshot_id: SnapshotIdArg) -> Result:
        async def op() -> OperationResult:
            await manager.delete_snapshot(snapshot_id)
            return OperationResult.success("delete_snapshot", {"snapshot_id": snapshot_id, "state": "deleted"})

        return to_call_result(await runner.run("delete_snapshot", {"snapshot_id": snapshot_id}, op, mutating=True))

    @server.tool(
        name="create_run_close",
        annotations=_MUTATES,
        description=(
            "One-shot: create a sandbox, write `files` (path -> text) into /workspace, run `command` (sh -c), "
            "return its output, and close the sandbox."
        ),
    )
    async def create_run_close(
        command: str,
        files: dict[str, str] | None = None,
        timeout_s: float | None = None,
        limits: LimitsArg | None = None,
    ) -> Result:
        async def op() -> OperationResult:
            box = await manager.create(owner=runner.identity(), limits=limits.requested() if limits else None)
            try:
                for path, content in (files or {}).items():
                    box.workspace.write_file(path, content, encoding="utf-8", append=False)
                out = await box.workspace.run(command, cwd=None, timeout_s=timeout_s)
            finally:
                await manager.close(box.id)
            return command_result("create_run_close", out, {"sandbox_id": box.id})

        args = {"command": command, "files": sorted(files or {}), "timeout_s": timeout_s}
        return to_call_result(await runner.run("create_run_close", args, op, mutating=True))
