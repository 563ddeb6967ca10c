"""MCP wiring of the work tools: run_command, explain_command and the file tools.

Wiring only: each tool names its arguments, hands an operation to the call
runner, and returns what the runner returns. Decisions live in `bastion.safety`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal

import anyio.to_thread
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from bastion.safety.errors import InvalidRequest
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import CallRunner
from bastion.tools.server import BastionServer, to_call_result
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.workspace import CommandOutput

Result = Annotated[CallToolResult, OperationResult]
SandboxId = Annotated[
    str | None, Field(description="A sandbox or configured host workspace id; default: the server's default workspace.")
]
EncodingArg = Annotated[Literal["utf-8", "base64"], Field(description="utf-8 text (redacted) or base64 bytes.")]

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)


def command_result(action: str, out: CommandOutput, extra: dict[str, object]) -> OperationResult:
    """A finished command as a result: an OOM kill or a timeout is a failure, with the output so far."""
    detail: dict[str, object] = {
        **extra,
        "exit_status": out.exit_status,
        "stdout": out.stdout,
        "stderr": out.stderr,
        "truncated": out.truncated,
    }
    if out.oom_killed:
        return OperationResult.failure(action, ResultCode.RESOURCE_LIMIT, _oom_reason(out), detail)
    if out.timed_out:
        return OperationResult.failure(
            action, ResultCode.TIMEOUT, "the command hit its time limit and was killed", detail
        )
    code = ResultCode.OUTPUT_TRUNCATED if out.truncated else ResultCode.OK
    return OperationResult.success(action, detail, code=code)


def _oom_reason(out: CommandOutput) -> str:
    note = f" ({out.memory_note})" if out.memory_note else ""
    return f"the command ran out of memory and was killed{note}"


def register_workbench(server: BastionServer, registry: WorkspaceRegistry, runner: CallRunner) -> None:
    """Add the work tools to `server`."""

    @server.tool(
        name="run_command",
        annotations=_WRITES,
        description=(
            "Run one command in a workspace. No shell runs: the command is split into words like a shell would "
            "(quotes work), but pipes, redirections, ';', '&&', '$VAR' and globs are refused. The workspace's "
            "policy decides which commands may run (use explain_command to ask). A non-zero exit status is "
            "ok=true with the status in detail.exit_status. In a sandbox, background=true starts the command and "
            "returns at once with its pid: it keeps running between calls (read_process_output, "
            "send_process_input, kill_process, list_processes)."
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
    ) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            if background:
                if timeout_s is not None:
                    raise InvalidRequest("timeout_s does not apply to a background process: kill_process ends it")
                started = await registry.get(sandbox_id).start_background(command, cwd=cwd)
                return OperationResult.success("run_command", started)
            out = await registry.get(sandbox_id).run(command, cwd=cwd, timeout_s=timeout_s)
            return command_result("run_command", out, {"argv": list(out.argv), "cwd": out.cwd})

        args = {"command": command, "cwd": cwd, "timeout_s": timeout_s, "background": background}
        return to_call_result(await runner.run("run_command", args, op, mutating=True, workspace=workspace))

    @server.tool(
        name="explain_command",
        annotations=_READ_ONLY,
        description="Say whether run_command would accept a command, and which rule decides. Runs nothing.",
    )
    async def explain_command(command: str, sandbox_id: SandboxId = None) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            decision = registry.get(sandbox_id).explain(command)
            detail: dict[str, object] = {
                "allowed": decision.allowed,
                "rule": decision.rule,
                "reason": decision.reason,
                "argv": list(decision.argv),
                "executable": decision.executable,
            }
            return OperationResult.success("explain_command", detail)

        return to_call_result(
            await runner.run("explain_command", {"command": command}, op, mutating=False, workspace=workspace)
        )

    @server.tool(
        name="read_file",
        annotations=_READ_ONLY,
        description=(
            "Read a file of the workspace (path relative to it). Large files: page with offset and length (bytes). "
            "utf-8 text is redacted as the whole file would be, so a secret cut by a page shows in neither part."
        ),
    )
    async def read_file(
        path: str,
        offset: Annotated[int, Field(ge=0)] = 0,
        length: Annotated[int | None, Field(ge=1)] = None,
        encoding: EncodingArg = "utf-8",
        sandbox_id: SandboxId = None,
    ) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            ws = registry.get(sandbox_id)
            # Redacting up to 1 MiB of secret-dense text takes most of a second: off the event loop.
            read = functools.partial(ws.read_file, path, offset=offset, length=length, encoding=encoding)
            return OperationResult.success("read_file", await anyio.to_thread.run_sync(read))

        args = {"path": path, "offset": offset, "length": length, "encoding": encoding}
        return to_call_result(await runner.run("read_file", args, op, mutating=False, workspace=workspace))

    @server.tool(
        name="write_file",
        annotations=_WRITES,
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
    ) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            detail = registry.get(sandbox_id).write_file(path, content, encoding=encoding, append=append)
            detail["files_touched"] = [detail["path"]]
            return OperationResult.success("write_file", detail)

        args = {"path": path, "content": content, "encoding": encoding, "append": append}
        return to_call_result(await runner.run("write_file", args, op, mutating=True, workspace=workspace))

    @server.tool(
        name="upload_file",
        annotations=_WRITES,
        description=(
            "Create a file of the workspace (path relative to it) from base64 bytes, creating missing folders. "
            "An existing entry of that name is CONFLICT unless overwrite is true, and a symlink is never followed. "
            "Returns the size and SHA-256 of what was written."
        ),
    )
    async def upload_file(
        path: str,
        content_base64: str,
        overwrite: bool = False,
        sandbox_id: SandboxId = None,
    ) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            detail = registry.get(sandbox_id).upload_file(path, content_base64, overwrite=overwrite)
            detail["files_touched"] = [detail["path"]]
            return OperationResult.success("upload_file", detail)

        # The audit keeps the size, not the bytes: the result carries their SHA-256.
        args = {"path": path, "content_base64_chars": len(content_base64), "overwrite": overwrite}
        return to_call_result(await runner.run("upload_file", args, op, mutating=True, workspace=workspace))

    @server.tool(
        name="list_directory",
        annotations=_READ_ONLY,
        description=(
            "List a folder of the workspace. Symlinks are shown as symlinks, never followed. Names are cleaned "
            "and redacted like command output."
        ),
    )
    async def list_directory(path: str = ".", sandbox_id: SandboxId = None) -> Result:
        workspace = registry.get_id(sandbox_id)

        async def op() -> OperationResult:
            listing = functools.partial(registry.get(sandbox_id).list_directory, path)
            return OperationResult.success("list_directory", await anyio.to_thread.run_sync(listing))

        return to_call_result(
            await runner.run("list_directory", {"path": path}, op, mutating=False, workspace=workspace)
        )
