"""close_sandbox racing the file tools of the same sandbox, through the SDK's real client (issue 19).

What this proves: read_file, list_directory, search_files and edit_file, which work in worker threads,
answer OK or a typed refusal when another call closes their sandbox meanwhile, never INTERNAL_ERROR,
and the closed sandbox's folder is gone. Found by the load test (tests/load/): list_directory racing
close_sandbox was INTERNAL_ERROR ("the jail is closed"), and the thread could have gone on beneath a
reused fd number (tests/safety/test_paths.py proves the jail keeps it). What it does not prove: every
interleaving; each round is one (the close starts at a different place among the calls each round).
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import pytest
from mcp import Client

from bastion.app import Services
from tests.helpers import Payload, call, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ROUNDS = 6
TYPED = {"OK", "SANDBOX_NOT_FOUND", "UNAVAILABLE", "NOT_FOUND"}
CALLS: list[tuple[str, dict[str, object]]] = [
    ("list_directory", {}),
    ("read_file", {"path": "a.txt"}),
    ("search_files", {"pattern": "needle"}),
    ("edit_file", {"path": "a.txt", "old": "needle", "new": "pin", "replace_all": True}),
    ("list_directory", {"path": "d"}),
    ("search_files", {"pattern": "needle", "path": "d"}),
]


async def test_close_sandbox_racing_file_tools_gets_typed_answers_and_leaves_nothing(
    client: Client, services: Services
) -> None:
    answers: list[tuple[str, Payload]] = []

    async def one(tool: str, args: Mapping[str, object]) -> None:
        answers.append((tool, await call(client, tool, **args)))

    for round_ in range(ROUNDS):
        box = await create(client)
        # Enough for the threads to be at work when the close comes: a 1 MiB file, 2,000 files to search.
        await call(client, "write_file", path="a.txt", content="a needle\n" * 100_000, sandbox_id=box)
        await sh(client, box, "mkdir -p d && for i in $(seq 2000); do echo needle > d/f$i.txt; done")
        close_at = round_ % (len(CALLS) + 1)
        closing: Mapping[str, object] = {"sandbox_id": box}
        async with anyio.create_task_group() as group:
            for index, (tool, args) in enumerate(CALLS):
                if index == close_at:
                    group.start_soon(one, "close_sandbox", closing)
                group.start_soon(one, tool, {**args, "sandbox_id": box})
            if close_at == len(CALLS):
                group.start_soon(one, "close_sandbox", closing)
        assert not (services.config.sandboxes_dir / box).exists()
    wrong = [(tool, p["code"], p["reason"]) for tool, p in answers if p["code"] not in TYPED]
    assert not wrong, wrong
    assert all(p["ok"] for tool, p in answers if tool == "close_sandbox")
    assert (await call(client, "list_sandboxes"))["detail"]["sandboxes"] == []
