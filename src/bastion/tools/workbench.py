"""MCP wiring of the work tools: run_command, explain_command and the file tools.

Wiring only: each tool is declared with `audited_tool` and does its one thing.
Decisions live in `bastion.safety`.
"""

from __future__ import annotations

import base64
import functools
from typing import Annotated, Final, Literal

from mcp_types import ImageContent, ToolAnnotations
from pydantic import Field

from bastion.safety.errors import InvalidRequest
from bastion.safety.paths import MAX_READ_BYTES
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import UNNAMED, Outcome
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.threads import CallerBound, ThreadShares
from bastion.workbench.background import MAX_PROCESSES
from bastion.workbench.media import MAX_IMAGE_BYTES
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.search import DEFAULT_SEARCH_RESULTS, MAX_SEARCH_RESULTS
from bastion.workbench.workspace import INLINE_READ_BYTES, CommandOutput, HostWorkspace

# The record's workspace names it, so it is not copied into the audited arguments.
SandboxId = Annotated[
    str | None,
    Field(
        description="A sandbox id (from create_sandbox) or a configured host workspace id; default: the server's "
        "default workspace, a host workspace."
    ),
    Audit.OMIT,
]
EncodingArg = Annotated[Literal["utf-8", "base64"], Field(description="utf-8 text (redacted) or base64 bytes.")]

MAX_PARALLEL_SEARCHES: Final = 2
_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)
_SEARCH = ToolAnnotations(
    read_only_hint=True,
    destructive_hint=False,
    idempotent_hint=True,
    open_world_hint=False,
)
_EDITS = ToolAnnotations(
    read_only_hint=False,
    destructive_hint=True,
    idempotent_hint=False,
    open_world_hint=False,
)
_PATHS_NOTE = (
    " Paths are relative to the workspace; in a sandbox, /workspace/... works too and symlinks resolve as its "
    "commands see them, but never to anything outside /workspace."
)
PathArg = Annotated[str, Field(description="Relative to the workspace (in a sandbox: or /workspace/...).")]
# The same upload twice leaves the same file (or answers CONFLICT without overwrite): no further effect.
_UPLOADS = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


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


def _image_outcome(ws: HostWorkspace, path: str) -> Outcome:
    image = ws.read_image(path)
    content = ImageContent(type="image", data=base64.b64encode(image.data).decode("ascii"), mime_type=image.mime_type)
    detail = {"path": image.path, "mime_type": image.mime_type, "bytes": len(image.data)}
    return Outcome(OperationResult.success(UNNAMED, detail), images=[content])


def _oom_reason(out: CommandOutput) -> str:
    note = f" ({out.memory_note})" if out.memory_note else ""
    return f"the command ran out of memory and was killed{note}"


def run_command_description(*, sandboxes: bool) -> str:
    """run_command's description, true of each tier the server offers."""
    host = (
        "In a host workspace no shell runs: the command is split into words like a shell would (quotes work), but "
        "pipes, redirections, ';', '&&', '$VAR' and globs are refused, and the workspace's policy decides which "
        "commands may run (use explain_command to ask)."
    )
    if not sandboxes:
        return f"Run one command in a workspace. {host}"
    return (
        "Run one command in a workspace. In a sandbox (sandbox_id from create_sandbox) it runs with sh -c in "
        "/workspace, so pipes, redirections, ';', '&&', '$VAR' and globs work (unless its template restricts "
        f"commands). {host}"
    )


def register_workbench(
    server: BastionServer, registry: WorkspaceRegistry, threads: ThreadShares, *, sandboxes: bool, network: bool
) -> None:
    """Add the work tools to `server`: `sandboxes` whether sandboxes are on, `network` whether any
    destination is allowed to them (host workspaces never have a network)."""
    in_workspace = workspace_of("sandbox_id", registry.get_id)
    runs = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=network)

    @audited_tool(
        server,
        "run_command",
        mutating=True,
        annotations=runs,
        workspace=in_workspace,
        title="Run command",
        description=(
            f"{run_command_description(sandboxes=sandboxes)} A non-zero exit status is "
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
                "(it ends when it exits, on kill_process, or when the sandbox closes). Its stdin is a pipe. "
                f"{MAX_PROCESSES} are kept: a start past that forgets the oldest that has exited, and its output "
                "(detail.forgotten)."
            ),
        ] = False,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object] | OperationResult:
        if background:
            if timeout_s is not None:
                raise InvalidRequest("timeout_s does not apply to a background process: kill_process ends it")
            return await registry.get(sandbox_id).start_background(command, cwd=cwd)
        ws = registry.get(sandbox_id)
        out = await ws.run(command, cwd=cwd, timeout_s=timeout_s, in_thread=threads.binding(ws))
        return command_result(out, {"argv": list(out.argv), "cwd": out.cwd})

    @audited_tool(
        server,
        "explain_command",
        mutating=False,
        annotations=_READ_ONLY,
        workspace=in_workspace,
        title="Explain command",
        description=(
            "Say whether run_command would accept a command in a workspace, and which rule decides. Runs nothing. "
            "In a host workspace its policy decides; in a sandbox any shell command is accepted unless its "
            "template restricts commands."
        ),
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
        title="Read file",
        description=(
            "Read a file of the workspace (path relative to it). Large files: page with offset and length (bytes). "
            "utf-8 text is redacted as the whole file would be, so a secret cut by a page shows in neither part. "
            "Binary content (an image, an archive, a program) is refused as utf-8: read it with encoding='base64', "
            "or see an image with as_image=true." + _PATHS_NOTE
        ),
    )
    async def read_file(
        path: PathArg,
        offset: Annotated[int, Field(ge=0)] = 0,
        length: Annotated[int | None, Field(ge=1)] = None,
        encoding: EncodingArg = "utf-8",
        as_image: Annotated[
            bool,
            Field(
                description=f"Return a PNG, JPEG, GIF or WebP file (up to {MAX_IMAGE_BYTES // 1_048_576} MiB) as "
                "image content to look at; the type is told by the file's bytes. Not with offset, length or "
                "encoding."
            ),
        ] = False,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object] | Outcome:
        ws = registry.get(sandbox_id)
        if as_image:
            if offset or length is not None or encoding != "utf-8":
                raise InvalidRequest("as_image reads the whole image: leave out offset, length and encoding")
            return await threads.run(ws, functools.partial(_image_outcome, ws, path))
        if (length is None or 0 < length <= MAX_READ_BYTES) and ws.is_small_file(path):
            # On the loop, cheaper than a thread hop; capped, so a file grown meanwhile costs no more.
            cap = INLINE_READ_BYTES if length is None else min(length, INLINE_READ_BYTES)
            detail = ws.read_file(path, offset=offset, length=cap, encoding=encoding)
            if detail["eof"] or cap == length:
                return detail
        # Redacting up to 1 MiB of secret-dense text takes most of a second: off the event loop.
        read = functools.partial(ws.read_file, path, offset=offset, length=length, encoding=encoding)
        return await threads.run(ws, read)

    @audited_tool(
        server,
        "write_file",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        title="Write file",
        description=(
            "Write a file of the workspace (path relative to it), creating missing folders. "
            "Replaces the file's content unless append is true. Symlinks are never followed for writing. "
            "To change part of a text file, edit_file is shorter and safer." + _PATHS_NOTE
        ),
    )
    async def write_file(
        path: PathArg,
        content: str,
        encoding: EncodingArg = "utf-8",
        append: bool = False,
        sandbox_id: SandboxId = None,
    ) -> Outcome:
        # Missing parents are made one by one, a path's depth of syscalls: off the event loop.
        ws = registry.get(sandbox_id)
        detail = await threads.run(
            ws, functools.partial(ws.write_file, path, content, encoding=encoding, append=append)
        )
        return Outcome(OperationResult.success(UNNAMED, detail), files=[str(detail["path"])])

    @audited_tool(
        server,
        "upload_file",
        mutating=True,
        annotations=_UPLOADS,
        workspace=in_workspace,
        title="Upload file",
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
        ws = registry.get(sandbox_id)
        detail = await threads.run(ws, functools.partial(ws.upload_file, path, content_base64, overwrite=overwrite))
        return Outcome(OperationResult.success(UNNAMED, detail), files=[str(detail["path"])])

    @audited_tool(
        server,
        "list_directory",
        mutating=False,
        annotations=_READ_ONLY,
        workspace=in_workspace,
        title="List directory",
        description=(
            "List a folder of the workspace. Symlinks are shown as symlinks, never followed. Names are cleaned "
            "and redacted like command output." + _PATHS_NOTE
        ),
    )
    async def list_directory(path: str = ".", sandbox_id: SandboxId = None) -> dict[str, object]:
        ws = registry.get(sandbox_id)
        return await threads.run(ws, functools.partial(ws.list_directory, path))

    register_search_and_edit(server, registry, threads)


def register_search_and_edit(server: BastionServer, registry: WorkspaceRegistry, threads: ThreadShares) -> None:
    """Add search_files and edit_file to `server`, sharing `threads` with the other file tools."""
    in_workspace = workspace_of("sandbox_id", registry.get_id)
    # A search may hold a worker thread for its whole time budget: a caller's burst of them queues here
    # instead of taking every thread the other tools (and the audit log) need.
    searches = CallerBound(MAX_PARALLEL_SEARCHES)

    @audited_tool(
        server,
        "search_files",
        mutating=False,
        annotations=_SEARCH,
        workspace=in_workspace,
        title="Search files",
        description=(
            "Search a folder of the workspace (every file beneath it, or one file) for a pattern: lines that "
            "contain it (path, line number, the line redacted and cut at 300 characters) and entries whose name "
            "contains it. Literal text by default; regex=true takes an RE2 regex (like Python's re, but "
            "matched in linear time: no backreferences or lookarounds), matched within the first 4096 characters "
            "of each line. Symlinks are never "
            "followed; binary files, files over 1 MiB and secret files (.env, keys) are skipped, and so are "
            ".git, .venv, node_modules and __pycache__ unless path is inside one. truncated=true "
            "says the results stopped early and why." + _PATHS_NOTE
        ),
    )
    async def search_files(
        pattern: Annotated[str, Field(description="Text to find (one line), or a regex with regex=true.")],
        path: Annotated[str, Field(description="Folder or file to search; default: the whole workspace.")] = ".",
        glob: Annotated[
            str | None,
            Field(description="Only files whose name matches, e.g. '*.py'; with a '/', the relative path."),
        ] = None,
        regex: bool = False,
        max_results: Annotated[int, Field(ge=1, le=MAX_SEARCH_RESULTS)] = DEFAULT_SEARCH_RESULTS,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object]:
        ws = registry.get(sandbox_id)
        search = functools.partial(ws.search_files, pattern, path=path, glob=glob, regex=regex, max_results=max_results)
        return await threads.run(ws, search, limiter=searches.mine())

    @audited_tool(
        server,
        "edit_file",
        mutating=True,
        annotations=_EDITS,
        workspace=in_workspace,
        title="Edit file",
        description=(
            "Replace exact text in a UTF-8 file of the workspace (up to 1 MiB): old must occur exactly once "
            "(NOT_FOUND if it does not, INVALID_REQUEST saying how many times if more) unless replace_all=true; "
            "text inside a redacted secret never matches. "
            "Returns a unified diff (redacted). The file is replaced atomically and keeps its mode (a symlink "
            "to a file of the workspace: its target is edited, the link stays); dry_run=true "
            "shows the diff and writes nothing. CONFLICT if the file changed while it was edited." + _PATHS_NOTE
        ),
    )
    async def edit_file(
        path: PathArg,
        old: Annotated[str, Field(description="The exact text to replace, whitespace and line ends included.")],
        new: Annotated[str, Field(description="What replaces it (may be empty, to delete old).")],
        replace_all: bool = False,
        dry_run: bool = False,
        sandbox_id: SandboxId = None,
    ) -> Outcome:
        ws = registry.get(sandbox_id)
        edit = functools.partial(ws.edit_file, path, old, new, replace_all=replace_all, dry_run=dry_run)
        detail = await threads.run(ws, edit)
        files = [] if dry_run else [str(detail["path"])]
        return Outcome(OperationResult.success(UNNAMED, detail), files=files)
