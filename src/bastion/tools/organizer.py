"""MCP wiring of the organizer tools: list_files, plan_organize, apply_plan, move_file, undo and redo.

Wiring only: each tool picks the inbox, hands an operation to the call runner and returns
what the runner returns. The organizer's work runs in a worker thread (it is file system
calls, and a large plan takes tens of milliseconds); each inbox serializes its own calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

import anyio
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from bastion.organizer import Organizer
from bastion.safety.errors import SandboxNotFound, Unavailable
from bastion.safety.results import OperationResult
from bastion.tools._call import CallRunner
from bastion.tools.server import ORGANIZER, BastionServer, to_call_result

Result = Annotated[CallToolResult, OperationResult]
InboxId = Annotated[str | None, Field(description="A configured inbox id; default: the first inbox of the config.")]

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Moves change where files are, but never delete or overwrite one: not destructive.
_MOVES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)


class Inboxes:
    """The organizers by inbox id, in config order."""

    def __init__(self, organizers: Mapping[str, Organizer]) -> None:
        self._by_id = dict(organizers)

    def get(self, inbox: str | None) -> Organizer:
        if not self._by_id:
            raise Unavailable("no [[inbox]] is configured: the administrator must add one to use the organizer")
        if inbox is None:
            return next(iter(self._by_id.values()))
        found = self._by_id.get(inbox)
        if found is None:
            raise SandboxNotFound(f"no inbox {inbox!r}: the configured inboxes are {', '.join(sorted(self._by_id))}")
        return found

    def id_of(self, inbox: str | None) -> str | None:
        return next(iter(self._by_id), None) if inbox is None else inbox


def register_organizer(server: BastionServer, inboxes: Inboxes, runner: CallRunner) -> None:
    """Add the organizer tools to `server`, under the `organizer` scope."""

    async def run(
        action: str,
        args: dict[str, object],
        inbox: str | None,
        work: Callable[[Organizer], dict[str, Any]],
        *,
        mutating: bool,
    ) -> CallToolResult:
        async def op() -> OperationResult:
            organizer = inboxes.get(inbox)
            detail = await anyio.to_thread.run_sync(work, organizer)
            return OperationResult.success(action, detail)

        workspace = inboxes.id_of(inbox)
        result = await runner.run(action, {**args, "inbox": inbox}, op, mutating=mutating, workspace=workspace)
        return to_call_result(result)

    @server.tool(
        name="list_files",
        annotations=_READ_ONLY,
        scope=ORGANIZER,
        description=(
            "List a folder of an inbox (a folder the organizer tidies, e.g. Downloads). Each entry has its size, "
            "its category, whether plan_organize would move it and, if not, why (rule, layer, code). Changes nothing."
        ),
    )
    async def list_files(
        subdir: Annotated[str, Field(description="A folder inside the inbox; default: its top level.")] = ".",
        inbox: InboxId = None,
    ) -> Result:
        return await run("list_files", {"subdir": subdir}, inbox, lambda o: o.list_files(subdir), mutating=False)

    @server.tool(
        name="plan_organize",
        annotations=_READ_ONLY,
        scope=ORGANIZER,
        description=(
            "Propose a tidy-up of an inbox's top level: each file to its category folder by extension. Changes "
            "nothing, not even the folders. Returns a plan_id for apply_plan, the moves, and the skipped entries "
            "with the rule that keeps each; NEEDS_EXPLICIT_REQUEST ones may be moved on purpose with move_file."
        ),
    )
    async def plan_organize(inbox: InboxId = None) -> Result:
        return await run("plan_organize", {}, inbox, lambda o: o.plan(), mutating=False)

    @server.tool(
        name="apply_plan",
        annotations=_MOVES,
        scope=ORGANIZER,
        description=(
            "Carry out a plan from plan_organize (once). If any planned file changed, moved or vanished since, "
            "or a destination is now taken, the whole plan is refused and nothing moves. Never overwrites. "
            "The whole plan is one action for undo_last_action."
        ),
    )
    async def apply_plan(plan_id: str, inbox: InboxId = None) -> Result:
        return await run("apply_plan", {"plan_id": plan_id}, inbox, lambda o: o.apply(plan_id), mutating=True)

    @server.tool(
        name="move_file",
        annotations=_MOVES,
        scope=ORGANIZER,
        description=(
            "Move one file or folder inside an inbox. dest is the full target path (e.g. 'Documents/a.pdf'); "
            "missing folders are created. An existing destination is refused with CONFLICT, never overwritten "
            "or renamed around. Symbolic links and special files are never moved."
        ),
    )
    async def move_file(
        src: Annotated[str, Field(description="The entry to move, relative to the inbox.")],
        dest: Annotated[str, Field(description="Its full new path, relative to the inbox.")],
        inbox: InboxId = None,
    ) -> Result:
        args: dict[str, object] = {"src": src, "dest": dest}
        return await run("move_file", args, inbox, lambda o: o.move(src, dest), mutating=True)

    @server.tool(
        name="undo_last_action",
        annotations=_MOVES,
        scope=ORGANIZER,
        description=(
            "Undo the last apply_plan or move_file of an inbox (a whole plan at once). Refused, with nothing "
            "moved, if a file it would move back was changed or its old place is taken: nothing is overwritten."
        ),
    )
    async def undo_last_action(inbox: InboxId = None) -> Result:
        return await run("undo_last_action", {}, inbox, lambda o: o.undo(), mutating=True)

    @server.tool(
        name="redo_last_action",
        annotations=_MOVES,
        scope=ORGANIZER,
        description="Redo the last undone action of an inbox. New moves clear what can be redone.",
    )
    async def redo_last_action(inbox: InboxId = None) -> Result:
        return await run("redo_last_action", {}, inbox, lambda o: o.redo(), mutating=True)
