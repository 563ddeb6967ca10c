"""MCP wiring of the organizer tools: list_files, plan_organize, apply_plan, move_file, undo and redo.

Wiring only (`audited_tool`): each tool picks the inbox and does its one thing. The organizer's
work runs in a worker thread (it is file system calls, and a large plan takes tens of
milliseconds); each inbox serializes its own calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from mcp_types import ToolAnnotations
from pydantic import Field

from bastion.organizer import Organizer
from bastion.safety.errors import SandboxNotFound, Unavailable, shown
from bastion.safety.results import OperationResult
from bastion.tools._call import UNNAMED, Outcome
from bastion.tools.audited import audited_tool
from bastion.tools.server import ORGANIZER, BastionServer
from bastion.tools.threads import ThreadShares

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
            # Cut (found by review: a 1.3 M-character id came back as a 20.8 MB answer over HTTP).
            raise SandboxNotFound(
                f"no inbox {shown(inbox)}: the configured inboxes are {', '.join(sorted(self._by_id))}"
            )
        return found

    def id_of(self, inbox: str | None) -> str | None:
        return next(iter(self._by_id), None) if inbox is None else inbox


def register_organizer(server: BastionServer, inboxes: Inboxes, threads: ThreadShares) -> None:
    """Add the organizer tools to `server`, under the `organizer` scope."""

    def in_inbox(arguments: Mapping[str, Any]) -> str | None:
        return inboxes.id_of(arguments["inbox"])

    async def organize(inbox: str | None, work: Callable[[Organizer], dict[str, Any]]) -> Outcome:
        organizer = inboxes.get(inbox)
        detail = await threads.run(organizer, functools.partial(work, organizer))
        # The organizer names what it moved; that is for the audit record, not the client.
        files = detail.pop("files_touched", [])
        return Outcome(OperationResult.success(UNNAMED, detail), files=files)

    @audited_tool(
        server,
        "list_files",
        mutating=False,
        annotations=_READ_ONLY,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="List inbox files",
        description=(
            "List a folder of an inbox (a folder the organizer tidies, e.g. Downloads). Each entry has its size, "
            "its category, whether plan_organize would move it and, if not, why (rule, layer, code). Changes nothing."
        ),
    )
    async def list_files(
        subdir: Annotated[str, Field(description="A folder inside the inbox; default: its top level.")] = ".",
        inbox: InboxId = None,
    ) -> Outcome:
        return await organize(inbox, lambda o: o.list_files(subdir))

    @audited_tool(
        server,
        "plan_organize",
        mutating=False,
        annotations=_READ_ONLY,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="Plan inbox tidy-up",
        description=(
            "Propose a tidy-up of an inbox's top level: each file to its category folder by extension. Changes "
            "nothing, not even the folders. Returns a plan_id for apply_plan, the moves, and the skipped entries "
            "with the rule that keeps each; NEEDS_EXPLICIT_REQUEST ones may be moved on purpose with move_file."
        ),
    )
    async def plan_organize(inbox: InboxId = None) -> Outcome:
        return await organize(inbox, lambda o: o.plan())

    @audited_tool(
        server,
        "apply_plan",
        mutating=True,
        annotations=_MOVES,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="Apply tidy-up plan",
        description=(
            "Carry out a plan from plan_organize (once). If any planned file changed, moved or vanished since, "
            "or a destination is now taken, the whole plan is refused and nothing moves. Never overwrites. "
            "The whole plan is one action for undo_last_action."
        ),
    )
    async def apply_plan(plan_id: str, inbox: InboxId = None) -> Outcome:
        return await organize(inbox, lambda o: o.apply(plan_id))

    @audited_tool(
        server,
        "move_file",
        mutating=True,
        annotations=_MOVES,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="Move inbox file",
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
    ) -> Outcome:
        return await organize(inbox, lambda o: o.move(src, dest))

    @audited_tool(
        server,
        "undo_last_action",
        mutating=True,
        annotations=_MOVES,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="Undo last inbox action",
        description=(
            "Undo the last apply_plan or move_file of an inbox (a whole plan at once). Refused, with nothing "
            "moved, if a file it would move back was changed or its old place is taken: nothing is overwritten."
        ),
    )
    async def undo_last_action(inbox: InboxId = None) -> Outcome:
        return await organize(inbox, lambda o: o.undo())

    @audited_tool(
        server,
        "redo_last_action",
        mutating=True,
        annotations=_MOVES,
        toolset=ORGANIZER,
        workspace=in_inbox,
        title="Redo inbox action",
        description="Redo the last undone action of an inbox. New moves clear what can be redone.",
    )
    async def redo_last_action(inbox: InboxId = None) -> Outcome:
        return await organize(inbox, lambda o: o.redo())
