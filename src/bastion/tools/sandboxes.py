"""MCP wiring of the sandbox lifecycle: templates, create, list, status, pause, resume, close,
create_run_close, snapshots.

Host workspaces are the administrator's: an agent may work in them but never
pause or close them (FORBIDDEN). create_sandbox's description is written from the config's
templates when the server is built, so a model learns their names and contents before a call.
"""

from __future__ import annotations

import functools
from typing import Annotated, Final

from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from bastion.safety.errors import InvalidRequest
from bastion.safety.paths import MAX_WRITE_BYTES
from bastion.safety.results import OperationResult
from bastion.snapshot.store import SnapshotInfo
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.threads import ThreadShares
from bastion.tools.workbench import command_result
from bastion.workbench.catalog import TemplateInfo
from bastion.workbench.manager import SandboxManager
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.settings import (
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    label_filter,
)
from bastion.workbench.workspace import HostWorkspace

MAX_SEED_FILES: Final = 1000
"""create_run_close's `files`: at most this many, of `MAX_WRITE_BYTES` in all. Unbounded, 8,000 files 120 folders
deep (2 MB of JSON) took 28 to 41 s to write."""
SandboxIdArg = Annotated[str, Field(description="The sandbox id from create_sandbox, e.g. sb-1a2b3c4d5e6f.")]

# Creating a sandbox, a snapshot or a restored sandbox adds; nothing existing is changed or lost.
_ADDS = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
# Pausing (resuming) twice leaves the same state (the second call answers CONFLICT); files and processes stay.
_FREEZES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
_READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Deleting twice leaves the same state (the second call answers NOT_FOUND).
_DELETES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)
SnapshotIdArg = Annotated[str, Field(description="A snapshot id from snapshot_sandbox or list_snapshots.")]
NetworkAllowArg = Annotated[
    list[str] | None,
    Field(
        description="Destinations to allow, e.g. ['api.github.com', '*.example.org:8443']; each must be "
        "within the administrator's allowlist. Default: the template's (usually none).",
        max_length=256,
    ),
]
EnvArg = Annotated[
    dict[str, str] | None,
    Field(
        description="Environment variables for everything that runs in the sandbox, e.g. {'APP_ENV': 'test'}. "
        "Not secret: shown by get_sandbox_status. Names the administrator sets, PATH, HOME, LANG and those "
        f"that change how code loads (LD_*, PYTHON*, GIT_*, NODE_*...) are refused; at most {MAX_ENV_VARS} "
        f"variables of {MAX_ENV_VALUE_CHARS} characters. Not for a template that restricts commands.",
        max_length=MAX_ENV_VARS,
    ),
    Audit.KEYS,  # names only: values are bounded but may be long
]
LabelsArg = Annotated[
    dict[str, str] | None,
    Field(
        description="Tags to find the sandbox by, e.g. {'project': 'blog'}: list_sandboxes(label=...). Keys: "
        f"letters, digits, '.', '_', '-'; at most {MAX_LABELS}, values of {MAX_LABEL_VALUE_CHARS} characters.",
        max_length=MAX_LABELS,
    ),
]


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


def _seed_files(files: dict[str, str]) -> list[tuple[str, str]]:
    """create_run_close's files, refused before any sandbox is made if they are more than `MAX_WRITE_BYTES` in all.

    Raises:
        InvalidRequest: they are too large together.
    """
    total = sum(len(content.encode("utf-8")) for content in files.values())
    if total > MAX_WRITE_BYTES:
        raise InvalidRequest(
            f"files hold {total} bytes in all, over {MAX_WRITE_BYTES}: write the rest with write_file or upload_file"
        )
    return list(files.items())


def _write_seeds(ws: HostWorkspace, seeds: list[tuple[str, str]]) -> None:
    for path, content in seeds:
        ws.write_file(path, content, encoding="utf-8", append=False)


def _count(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def create_description(catalog: list[TemplateInfo], *, network: bool, registry: bool) -> str:
    """create_sandbox's description: what a sandbox is, and each template's name and contents."""
    templates = "\n".join(f"- {info.line()}" for info in catalog)
    egress = (
        "There is no network unless network_allow names destinations the administrator allows; they are "
        "reached through a proxy (HTTP(S)_PROXY is set) and every attempt is recorded."
        if network
        else "There is no network (the administrator allows no destination)."
    )
    if registry:
        egress += " install_package reaches the package registry for the install only."
    return (
        "Create a disposable Linux sandbox with an empty /workspace (its working folder and HOME). Inside, "
        "run_command runs any shell command with sh -c (pipes, redirections, && and globs work) unless the "
        f"template restricts commands. {egress} Templates (pass one as template; the default is marked):\n"
        f"{templates}\n"
        "env gives every command, background process and code context of the sandbox extra variables (not "
        "secret: get_sandbox_status shows them); labels tag it for list_sandboxes(label=...). Pass its "
        "sandbox_id to the work tools. Close it when done."
    )


def _template_field(catalog: list[TemplateInfo]) -> str:
    names = ", ".join(f"{info.name}{' (default)' if info.default else ''}" for info in catalog)
    return f"One of: {names}. What each holds: this tool's description, or list_templates."


def register_sandboxes(
    server: BastionServer,
    manager: SandboxManager,
    registry: WorkspaceRegistry,
    catalog: list[TemplateInfo],
    *,
    threads: ThreadShares,
    network: bool,
    package_registry: bool,
    snapshots: bool,
) -> None:
    """Add the sandbox lifecycle tools to `server`; `catalog` is the config's templates, `threads` the file
    tools' shares (a status's disk walk and create_run_close's files take them too), `network` whether
    the administrator allows any destination at all (else commands can never reach one),
    `package_registry` whether install_package has a package registry, `snapshots` whether a
    snapshot could ever be kept (`SandboxesConfig.snapshots_allowed`)."""
    runner = server.runner
    in_sandbox = workspace_of("sandbox_id")
    # A command of a sandbox reaches the network only through the administrator's allowlist.
    runs = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=network)

    def agent_owned(sandbox_id: str, what: str, *, while_restoring: bool = False) -> None:
        # FORBIDDEN for a host workspace: the one decision, `HostWorkspace.require_sandbox`.
        registry.resolve(sandbox_id, while_restoring=while_restoring).workspace.require_sandbox(what)

    @audited_tool(
        server,
        "list_templates",
        mutating=False,
        annotations=_READS,
        title="List sandbox templates",
        description=(
            "The templates create_sandbox accepts, the default marked: each one's Python packages (name and "
            "version), read-only folders, network allowance, environment variable names and limits."
        ),
    )
    async def list_templates() -> dict[str, object]:
        return {"templates": [info.as_detail() for info in catalog]}

    async def create_sandbox(
        template: str | None = None,
        name: str | None = None,
        limits: LimitsArg | None = None,
        network_allow: NetworkAllowArg = None,
        env: EnvArg = None,
        labels: LabelsArg = None,
    ) -> dict[str, object]:
        requested = limits.requested() if limits else None
        box = await manager.create(
            owner=runner.identity(),
            name=name,
            limits=requested,
            template=template,
            network_allow=network_allow,
            env=env,
            labels=labels,
        )
        return {
            **box.summary(),
            "env": dict(box.settings.env),
            "limits": box.limits.model_dump(),
            "workspace": "/workspace",
        }

    # The template names are the config's: the annotation is made here, not written in the signature.
    create_sandbox.__annotations__["template"] = Annotated[str | None, Field(description=_template_field(catalog))]
    audited_tool(
        server,
        "create_sandbox",
        mutating=True,
        annotations=_ADDS,
        title="Create sandbox",
        description=create_description(catalog, network=network, registry=package_registry),
    )(create_sandbox)

    @audited_tool(
        server,
        "list_sandboxes",
        mutating=False,
        annotations=_READS,
        title="List sandboxes",
        description="List the open sandboxes, with their labels; label='key=value' (or 'key') keeps the matching ones.",
    )
    async def list_sandboxes(
        label: Annotated[
            str | None, Field(description="'key=value': that label with that value; 'key': that label, any value.")
        ] = None,
    ) -> dict[str, object]:
        wanted = label_filter(label) if label is not None else None
        boxes = [box for box in manager.all() if wanted is None or box.settings.matches(wanted)]
        return {"sandboxes": [box.summary() for box in boxes]}

    @audited_tool(
        server,
        "get_sandbox_status",
        mutating=False,
        annotations=_READS,
        workspace=in_sandbox,
        title="Sandbox status",
        description=(
            "State, template, age, idle time, labels, the env given at creation, limits and live memory, CPU, "
            "process and disk use of a sandbox."
        ),
    )
    async def get_sandbox_status(sandbox_id: SandboxIdArg) -> dict[str, object]:
        target = registry.resolve(sandbox_id)
        target.workspace.require_sandbox("get_sandbox_status")
        # A worker's job: without a disk quota the disk figure is a walk of up to 100,000 entries, and 16 of
        # those at once held the event loop for 4.8 s.
        return await threads.run(target.workspace, functools.partial(manager.status, sandbox_id))

    @audited_tool(
        server,
        "pause_sandbox",
        mutating=True,
        annotations=_FREEZES,
        workspace=in_sandbox,
        title="Pause sandbox",
        description=(
            "Freeze every process of a sandbox: it uses no CPU until resume_sandbox. Nothing is lost: files stay "
            "reachable and processes go on where they stopped. A pause during snapshot_sandbox is kept after it."
        ),
    )
    async def pause_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "pause_sandbox")
        return (await manager.pause(sandbox_id)).summary()

    @audited_tool(
        server,
        "resume_sandbox",
        mutating=True,
        annotations=_FREEZES,
        workspace=in_sandbox,
        title="Resume sandbox",
        description=(
            "Thaw a paused sandbox: its processes go on where they stopped. While snapshot_sandbox copies it, the "
            "sandbox stays frozen and this answers CONFLICT."
        ),
    )
    async def resume_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "resume_sandbox")
        return (await manager.resume(sandbox_id)).summary()

    @audited_tool(
        server,
        "close_sandbox",
        mutating=True,
        annotations=_DELETES,
        workspace=in_sandbox,
        title="Close sandbox",
        description="End a sandbox: every process is killed and its files are deleted (snapshots are kept).",
    )
    async def close_sandbox(sandbox_id: SandboxIdArg) -> dict[str, object]:
        if not manager.close_unfinished(sandbox_id):  # a close cut short before is tried again as asked
            agent_owned(sandbox_id, "close_sandbox", while_restoring=True)  # a restore under way ends first (close)
        await manager.close(sandbox_id)  # the waits run in worker threads: other calls go on
        return {"sandbox_id": sandbox_id, "state": "closed"}

    async def snapshot_sandbox(sandbox_id: SandboxIdArg, label: str | None = None) -> dict[str, object]:
        agent_owned(sandbox_id, "snapshot_sandbox")
        return _snapshot_detail(await manager.snapshot(sandbox_id, label), manager)

    if snapshots:  # else every snapshot is over a cap of 0 (restore still takes a crashed server's)
        audited_tool(
            server,
            "snapshot_sandbox",
            mutating=True,
            annotations=_ADDS,
            workspace=in_sandbox,
            title="Snapshot sandbox",
            description=(
                "Save a sandbox's /workspace (files, folders, symlinks, modes) to a compressed snapshot. "
                "restore_sandbox makes a new sandbox from it. Snapshots are capped in number and size, per sandbox "
                "and in total, and expire (see 'expires'); delete_snapshot frees room. FIFOs, sockets, devices and "
                "names a restore would refuse are not stored: 'skipped' counts them, and all inside a skipped folder."
            ),
        )(snapshot_sandbox)

    @audited_tool(
        server,
        "restore_sandbox",
        mutating=True,
        annotations=_ADDS,
        title="Restore sandbox",
        description=(
            "Create a new sandbox whose /workspace is a snapshot's, byte for byte. Only files are restored: it "
            "has the source sandbox's template while this server still has it (else the default), with that "
            "template's limits and network, and no env or labels (create_sandbox's choices are not kept)."
        ),
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
        title="List snapshots",
        description="List the snapshots, including those kept from sandboxes of a server that crashed.",
    )
    async def list_snapshots() -> dict[str, object]:
        return {"snapshots": [_snapshot_detail(info, manager) for info in manager.snapshots()]}

    @audited_tool(
        server,
        "delete_snapshot",
        mutating=True,
        annotations=_DELETES,
        title="Delete snapshot",
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
        # The sandbox, and all the command did in it, is gone when the call returns.
        annotations=runs,
        title="Run in a throwaway sandbox",
        description=(
            "One-shot: create a sandbox of the default template, write `files` (path -> text) into /workspace, "
            "run `command` (sh -c: pipes and redirections work), return its output, and close the sandbox "
            "(nothing it started survives)."
        ),
    )
    async def create_run_close(
        command: str,
        files: Annotated[
            dict[str, str] | None,
            Field(
                description=f"path -> text, written before the command; at most {MAX_SEED_FILES} files of "
                f"{MAX_WRITE_BYTES // 1_048_576} MiB in all.",
                max_length=MAX_SEED_FILES,
            ),
            Audit.KEYS,
        ] = None,
        timeout_s: float | None = None,
        limits: LimitsArg | None = None,
    ) -> OperationResult:
        seeds = _seed_files(files or {})
        box = await manager.create(owner=runner.identity(), limits=limits.requested() if limits else None)
        try:
            ws = box.workspace
            # One worker's job under the file tools' shares: on the loop, 60,000 small files held every
            # agent's calls for 6 s.
            await threads.run(ws, functools.partial(_write_seeds, ws, seeds))
            out = await ws.run(command, cwd=None, timeout_s=timeout_s, in_thread=threads.binding(ws))
        finally:
            await manager.close(box.id)
        return command_result(out, {"sandbox_id": box.id})
