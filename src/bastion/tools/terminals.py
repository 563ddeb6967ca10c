"""MCP wiring of terminals: open_terminal, terminal_send, terminal_read, terminal_resize, close_terminal.

A terminal is a program on a pseudo-terminal opened inside a sandbox, with its own session and
controlling tty (REPLs, password prompts, `less`, job control). Wiring only (`audited_tool`): the
work is `bastion.workbench.terminals`'. What is sent is audited as sent; the audit log redacts
every string of a record as it redacts command arguments.
"""

from __future__ import annotations

from typing import Annotated

from mcp_types import ToolAnnotations
from pydantic import Field

from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import UNNAMED
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.threads import CallerBound, ThreadShares
from bastion.workbench.registry import WorkspaceRegistry
from bastion.workbench.terminals import (
    KEYS,
    MAX_COLS,
    MAX_ROWS,
    MAX_SEND_BYTES,
    MAX_WAIT_S,
    MAX_WAITING_READS,
    MIN_COLS,
    MIN_ROWS,
)

SandboxId = Annotated[str | None, Field(description="The sandbox to open it in (from create_sandbox)."), Audit.OMIT]
TerminalId = Annotated[str, Field(max_length=64, description="The terminal_id open_terminal returned.")]
Rows = Annotated[int, Field(ge=MIN_ROWS, le=MAX_ROWS, description="Lines of the screen.")]
Cols = Annotated[int, Field(ge=MIN_COLS, le=MAX_COLS, description="Characters per line.")]

# Opening starts a program; sending can make it do anything it does (e.g. confirm a deletion).
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)
# Reading takes what scrolled off since the last read: not idempotent, but it changes nothing in the sandbox.
_READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
_RESIZES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Closing twice: the second call is NOT_FOUND, and nothing more is killed.
_CLOSES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


def register_terminals(server: BastionServer, registry: WorkspaceRegistry, threads: ThreadShares) -> None:
    """Add the terminal tools to `server`; a read's long scrollback is cleaned in `threads`' shares."""
    in_workspace = workspace_of("sandbox_id", registry.get_id)
    of_terminal = workspace_of("terminal_id", registry.terminal_workspace)
    # One thread at a time for each caller's waits (cleaning and matching what a wait_for looks at), taken before
    # the workspace's share: found by review, 16 waiters with a pattern RE2 runs slowly held all 4 of a host
    # workspace's threads, and its other tools (read_file) waited 5.5 to 8.9 s.
    waits = CallerBound(1)

    @audited_tool(
        server,
        "open_terminal",
        mutating=True,
        annotations=_WRITES,
        workspace=in_workspace,
        title="Open terminal",
        description=(
            "Start a program on an interactive terminal (a real pseudo-terminal inside the sandbox, with job "
            "control) for what needs a TTY: a REPL, a password prompt, an installer's questions, less, vim, top. "
            "Returns terminal_id. command: a shell command line (default: bash); in a sandbox whose template has "
            "a command policy, or a host workspace, only a command that policy allows (else FORBIDDEN on a host "
            "workspace). It runs in /workspace until close_terminal, its exit, the sandbox closing, or an idle "
            "close; at most a few terminals per sandbox (RESOURCE_LIMIT)."
        ),
    )
    async def open_terminal(
        sandbox_id: SandboxId = None,
        command: Annotated[
            str | None, Field(max_length=4096, description='What to run, e.g. "python3" (default: bash).')
        ] = None,
        rows: Rows = 24,
        cols: Cols = 80,
    ) -> dict[str, object]:
        return await registry.get(sandbox_id).open_terminal(command, rows=rows, cols=cols)

    @audited_tool(
        server,
        "terminal_send",
        mutating=True,
        annotations=_WRITES,
        workspace=of_terminal,
        title="Send to terminal",
        description=(
            "Type into a terminal: text as typed, then keys by name, in order (e.g. text='ls -l', keys=['Enter']). "
            f"Keys: {', '.join(KEYS)}. At most {MAX_SEND_BYTES} bytes per call. "
            "Then terminal_read (wait_for) to see the result."
        ),
    )
    async def terminal_send(
        terminal_id: TerminalId,
        text: Annotated[str, Field(description="Text typed as is (no newline is added: use keys=['Enter']).")] = "",
        keys: Annotated[
            list[Annotated[str, Field(max_length=16)]],
            Field(max_length=256, description='Special keys after the text, e.g. ["Enter"] or ["Ctrl-C"].'),
        ] = [],  # noqa: B006 - pydantic copies the default; the schema shows []
    ) -> dict[str, object] | OperationResult:
        detail = await registry.find_terminal(terminal_id).workspace.terminals.send(terminal_id, text, keys)
        if detail["bytes_written"] != detail["bytes"]:
            reason = "the program did not read its input in time: only part of it was written"
            return OperationResult.failure(UNNAMED, ResultCode.TIMEOUT, reason, detail)
        return detail

    @audited_tool(
        server,
        "terminal_read",
        mutating=False,
        annotations=_READS,
        workspace=of_terminal,
        title="Read terminal",
        description=(
            "The terminal's screen as text (rows lines, trailing spaces cut; cursor row and col from 0) and the "
            "lines that scrolled off since the last read, cleaned and redacted like command output. wait_for: a "
            "regular expression (RE2; a line is matched by '(?m)^...$', e.g. '(?m)^>>>$' for a Python prompt); "
            "first wait until the screen or those lines match it (matched), the program's output ends, or "
            f"timeout_s (default 10, at most {MAX_WAIT_S:.0f}). Without wait_for, timeout_s waits for any new output. "
            f"At most {MAX_WAITING_READS} reads wait on one terminal at once. "
            "paced=true: the program wrote faster than the terminal renders, and waited."
        ),
    )
    async def terminal_read(
        terminal_id: TerminalId,
        wait_for: Annotated[
            str | None, Field(max_length=1000, description=r'A regex to wait for, e.g. "(?m)^done$".')
        ] = None,
        timeout_s: Annotated[float | None, Field(ge=0, le=MAX_WAIT_S, description="How long to wait.")] = None,
    ) -> dict[str, object]:
        ws = registry.find_terminal(terminal_id).workspace
        return await ws.terminals.read(
            terminal_id,
            wait_for=wait_for,
            timeout_s=timeout_s,
            in_thread=threads.binding(ws),
            wait_in_thread=threads.binding(ws, limiter=waits.mine()),
        )

    @audited_tool(
        server,
        "terminal_resize",
        mutating=True,
        annotations=_RESIZES,
        workspace=of_terminal,
        title="Resize terminal",
        description="Change a terminal's size; its program is told (SIGWINCH) and sees it (stty size).",
    )
    async def terminal_resize(terminal_id: TerminalId, rows: Rows, cols: Cols) -> dict[str, object]:
        return registry.find_terminal(terminal_id).workspace.terminals.resize(terminal_id, rows, cols)

    @audited_tool(
        server,
        "close_terminal",
        mutating=True,
        annotations=_CLOSES,
        workspace=of_terminal,
        title="Close terminal",
        description="Kill a terminal's program and everything it started (SIGKILL), and close the terminal.",
    )
    async def close_terminal(terminal_id: TerminalId) -> dict[str, object]:
        return await registry.find_terminal(terminal_id).workspace.terminals.close(terminal_id)
