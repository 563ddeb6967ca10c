"""MCP wiring of background processes: list_processes, read_process_output, send_process_input, kill_process.

They are started by run_command(background=true) in a sandbox and live until they exit,
are killed, or the sandbox closes; so do processes a command leaves running (`x &`, nohup,
setsid, daemons), which list_processes shows and kill_process ends by `os_pid`. Wiring only
(`audited_tool`): the work is `HostWorkspace`'s.
"""

from __future__ import annotations

from typing import Annotated

from mcp_types import ToolAnnotations
from pydantic import Field

from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import UNNAMED
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.threads import ThreadShares
from bastion.workbench.background import MAX_INPUT_BYTES
from bastion.workbench.registry import WorkspaceRegistry

# The record's workspace names it, so it is not copied into the audited arguments.
SandboxId = Annotated[
    str | None, Field(description="The sandbox the process runs in (from create_sandbox)."), Audit.OMIT
]
Pid = Annotated[int, Field(ge=1, description="The pid run_command(background=true) returned (1, 2, ... per sandbox).")]
OsPid = Annotated[
    int | None,
    Field(
        ge=1,
        description="Instead of pid: a process a command left running, by its os_pid from list_processes "
        "(the pid ps shows in the sandbox).",
    ),
]

_READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Input can make a program do anything it does (e.g. confirm a deletion).
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)
# Killing twice leaves the same state: the second call reports killed=false.
_KILLS = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


def register_processes(server: BastionServer, registry: WorkspaceRegistry, threads: ThreadShares) -> None:
    """Add the background process tools to `server`; long command lines are cleaned in `threads`' shares."""
    in_workspace = workspace_of("sandbox_id", registry.get_id)

    @audited_tool(
        server,
        "list_processes",
        mutating=False,
        annotations=_READS,
        workspace=in_workspace,
        title="List processes",
        description=(
            "The processes of a sandbox that outlive a call. Background ones (started_by 'background', from "
            "run_command(background=true)): pid, argv, state (running/exited), exit_status, age_s and how much "
            "output they wrote. Processes a command left running (started_by 'command': started with '&', "
            "nohup, setsid or a daemon; they live until they exit, kill_process, or the sandbox closes): "
            "os_pid (the pid ps shows inside) and argv."
        ),
    )
    async def list_processes(sandbox_id: SandboxId = None) -> dict[str, object]:
        ws = registry.get(sandbox_id)
        return {"processes": await ws.list_processes(threads.binding(ws))}

    @audited_tool(
        server,
        "read_process_output",
        mutating=False,
        annotations=_READS,
        workspace=in_workspace,
        title="Read process output",
        description=(
            "The output of a background process so far, stdout and stderr apart, redacted like run_command's. "
            "Pass detail.next as `since` to get only what came after. The newest 1 MiB per stream is kept: "
            "older output is dropped (detail.dropped_bytes). detail.state and exit_status say if it has exited."
        ),
    )
    async def read_process_output(
        pid: Pid,
        since: Annotated[
            int | None, Field(ge=0, description="An offset from a previous read's detail.next; default: the start.")
        ] = None,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object]:
        ws = registry.get(sandbox_id)
        return await ws.read_process(pid, since=since, in_thread=threads.binding(ws))

    @audited_tool(
        server,
        "send_process_input",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        title="Send process input",
        description=(
            f"Write text to a background process's stdin (at most {MAX_INPUT_BYTES} bytes per call; include the "
            "newline a line-reading program waits for). eof=true then closes its stdin."
        ),
    )
    async def send_process_input(
        pid: Pid,
        data: Annotated[str, Field(description='Text to write, e.g. "yes\\n".')] = "",
        eof: Annotated[bool, Field(description="Close the process's stdin after writing.")] = False,
        sandbox_id: SandboxId = None,
    ) -> dict[str, object] | OperationResult:
        detail = await registry.get(sandbox_id).send_input(pid, data, eof=eof)
        if detail["bytes_written"] != detail["bytes"]:
            reason = "the process did not read its input in time: only part of it was written"
            return OperationResult.failure(UNNAMED, ResultCode.TIMEOUT, reason, detail)
        return detail

    @audited_tool(
        server,
        "kill_process",
        mutating=True,
        annotations=_KILLS,
        workspace=in_workspace,
        title="Kill process",
        description=(
            "Kill a background process (pid) and everything it started (SIGKILL); its record and output "
            "stay readable. Or kill one process a command left running (os_pid from list_processes): "
            "only that process. Give one of pid and os_pid."
        ),
    )
    async def kill_process(
        pid: Pid | None = None, os_pid: OsPid = None, sandbox_id: SandboxId = None
    ) -> dict[str, object]:
        return await registry.get(sandbox_id).kill_process(pid, os_pid=os_pid)
