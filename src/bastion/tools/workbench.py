"""MCP wiring of the work tools: run_command, explain_command and the file tools.

Wiring only: each tool is declared with `audited_tool` and does its one thing.
Decisions live in `bastion.safety`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal

import anyio.to_thread
from mcp_types import ToolAnnotations
from pydantic import Field

from bastion.safety.errors import InvalidRequest
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import UNNAMED, Outcome
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.workspace import CommandOutput

# The record's workspace names it, so it is not copied into the audited arguments.
SandboxId = Annotated[
    str | None,
    Field(description="A sandbox or configured host workspace id; default: the server's default workspace."),
    Audit.OMIT,
]
EncodingArg = Annotated[Literal["utf-8", "base64"], Field(description="utf-8 text (redacted) or base64 bytes.")]

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)


def command_result(out: CommandOutput, extra: dict[str, object]) -> OperationResult:
    """A finished command as a result: an OOM kill or a timeout is a failure, with the output so far."""
    detail: dict[str, object] = {
        **extra,
        "exit_status": out.exit_status,
        "stdout": out.stdout,
        "stderr": out.stderr,
        "truncated": out.truncated,
    }
    if out.oom_killed:
        return OperationResult.failure(UNNAMED, ResultCode.RESOURCE_LIMIT, _oom_reason(out), detail)
    if out.timed_out:
        return OperationResult.failure(
            UNNAMED, ResultCode.TIMEOUT, "the command hit its time limit and was killed", detail
        )
    code = ResultCode.OUTPUT_TRUNCATED if out.truncated else ResultCode.OK
    return OperationResult.success(UNNAMED, detail, code=code)


def _oom_reason(out: CommandOutput) -> str:
    note = f" ({out.memory_note})" if out.memory_note else ""
    return f"the command ran out of memory and was killed{note}"


def register_workbench(server: BastionServer, registry: WorkspaceRegistry) -> None:
    """Add the work tools to `server`."""
    in_workspace = workspace_of("sandbox_id", registry.get_id)

    @audited_tool(
        server,
        "run_command",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        description=(
            "Run one command in a workspace. No shell runs: the command is split into words like a shell would "
            "(quotes work), but pipes, redirections, ';', '&&', '$VAR' and globs are refused. The workspace's "
            "policy decides which commands may run (use explain_command to ask). A non-zero exit status is "
            "ok=true with the status in detail.exit_status. In a sandbox, background=true starts the command and "
            "returns at once with its pid: it keeps running between calls (read_process_output, "
            "send_process_input, kill_process, list_processes). What a command leaves running ('server &', "
            "nohup, setsid, a daemon) lives on until the sandbox closes, like on a machine: the next command can "
            "reach it; list_processes shows it, kill_process ends it. A timeout kills the command and "
            "everything it started."
        ),
    )
    async def run_command(
        command: Annotated[str, Field(description='The command line, e.g. "git log --oneline -n 5".')],
        cwd: Annotated[str | None, Field(description="Working folder, relative to the workspace.")] = None,
        timeout_s: Annotated[float | None, Field(description="Wall-clock limit; capped by config.")] = None,
        background: Annotated[
            bool,
            Field(
                description="Sandboxes only: start it and return at once with its pid; no time limit applies "
                "(it ends when it exits, on kill_process, or when the sandbox closes). Its stdin is a pipe."
            ),
        ] = False,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object] | OperationResult:
        if background:
            if timeout_s is not None:
                raise InvalidRequest("timeout_s does not apply to a background process: kill_process ends it")
            return await registry.get(sandbox_id).start_background(command, cwd=cwd)
        out = await registry.get(sandbox_id).run(command, cwd=cwd, timeout_s=timeout_s)
        return command_result(out, {"argv": list(out.argv), "cwd": out.cwd})

    @audited_tool(
        server,
        "explain_command",
        mutating=False,
        annotations=_READ_ONLY,
        workspace=in_workspace,
        description="Say whether run_command would accept a command, and which rule decides. Runs nothing.",
    )
    async def explain_command(command: str, sandbox_id: SandboxId = None) -> dict[str, object]:
        decision = registry.get(sandbox_id).explain(command)
        return {
            "allowed": decision.allowed,
            "rule": decision.rule,
            "reason": decision.reason,
            "argv": list(decision.argv),
            "executable": decision.executable,
        }

    @audited_tool(
        server,
        "read_file",
        mutating=False,
        annotations=_READ_ONLY,
        workspace=in_workspace,
        description=(
            "Read a file of the workspace (path relative to it). Large files: page with offset and length (bytes). "
            "utf-8 text is redacted as the whole file would be, so a secret cut by a page shows in neither part. "
            "Binary content (an image, an archive, a program) is refused as utf-8: read it with encoding='base64'."
        ),
    )
    async def read_file(
        path: str,
        offset: Annotated[int, Field(ge=0)] = 0,
        length: Annotated[int | None, Field(ge=1)] = None,
        encoding: EncodingArg = "utf-8",
        sandbox_id: SandboxId = None,
    ) -> dict[str, object]:
        ws = registry.get(sandbox_id)
        # Redacting up to 1 MiB of secret-dense text takes most of a second: off the event loop.
        read = functools.partial(ws.read_file, path, offset=offset, length=length, encoding=encoding)
        return await anyio.to_thread.run_sync(read)

    @audited_tool(
        server,
        "write_file",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        description=(
            "Write a file of the workspace (path relative to it), creating missing folders. "
            "Replaces the file's content unless append is true. Symlinks are never followed for writing."
        ),
    )
    async def write_file(
        path: str,
        content: str,
        encoding: EncodingArg = "utf-8",
        append: bool = False,
        sandbox_id: SandboxId = None,
    ) -> Outcome:
        detail = registry.get(sandbox_id).write_file(path, content, encoding=encoding, append=append)
        return Outcome(OperationResult.success(UNNAMED, detail), files=[str(detail["path"])])

    @audited_tool(
        server,
        "upload_file",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        description=(
            "Create a file of the workspace (path relative to it) from base64 bytes, creating missing folders. "
            "An existing entry of that name is CONFLICT unless overwrite is true, and a symlink is never followed. "
            "Returns the size and SHA-256 of what was written."
        ),
    )
    async def upload_file(
        path: str,
        # The audit keeps the size, not the bytes: the result carries their SHA-256.
        content_base64: Annotated[str, Audit.LENGTH],
        overwrite: bool = False,
        sandbox_id: SandboxId = None,
    ) -> Outcome:
        detail = registry.get(sandbox_id).upload_file(path, content_base64, overwrite=overwrite)
        return Outcome(OperationResult.success(UNNAMED, detail), files=[str(detail["path"])])

    @audited_tool(
        server,
        "list_directory",
        mutating=False,
        annotations=_READ_ONLY,
        workspace=in_workspace,
        description=(
            "List a folder of the workspace. Symlinks are shown as symlinks, never followed. Names are cleaned "
            "and redacted like command output."
        ),
    )
    async def list_directory(path: str = ".", sandbox_id: SandboxId = None) -> dict[str, object]:
        listing = functools.partial(registry.get(sandbox_id).list_directory, path)
        return await anyio.to_thread.run_sync(listing)
