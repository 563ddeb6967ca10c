"""The registry resolves a call's workspace once: an unknown id is refused (SANDBOX_NOT_FOUND) before
anything runs and is never recorded as the call's workspace; "is this a sandbox?" has one answer, and
an operation for sandboxes only is refused on a host workspace with one code, FORBIDDEN."""

from __future__ import annotations

import pytest
from mcp import Client

from bastion.app import Services
from bastion.safety.errors import Forbidden, SandboxNotFound
from tests.helpers import audit_record, call, create

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

UNKNOWN = "sb-000000000000"
CALLS: list[tuple[str, dict[str, object]]] = [
    ("list_directory", {"path": "."}),
    ("read_file", {"path": "notes.txt"}),
    ("write_file", {"path": "made.txt", "content": "x"}),
    ("run_command", {"command": "touch made.txt"}),
    ("list_processes", {}),
]


async def test_unknown_id_is_refused_and_never_recorded(client: Client, services: Services) -> None:
    audit = services.config.audit_path
    for tool, args in CALLS:
        refused = await call(client, tool, sandbox_id=UNKNOWN, **args)
        assert refused["code"] == "SANDBOX_NOT_FOUND", (tool, refused)
        end = audit_record(audit, refused["audit_id"])
        assert end["workspace"] is None, (tool, end)
        assert end["code"] == "SANDBOX_NOT_FOUND"
    records = audit.read_text()
    assert f'"workspace":"{UNKNOWN}"' not in records.replace(" ", "")
    assert not (services.config.workspace[0].path / "made.txt").exists()


async def test_known_ids_are_recorded(client: Client, services: Services) -> None:
    box = await create(client)
    host = await call(client, "list_directory", path=".")
    inside = await call(client, "list_directory", path=".", sandbox_id=box)
    audit = services.config.audit_path
    assert audit_record(audit, host["audit_id"])["workspace"] == services.config.default_workspace
    assert audit_record(audit, inside["audit_id"])["workspace"] == box


async def test_resolve_once_and_one_answer_to_is_sandbox(client: Client, services: Services) -> None:
    registry = services.registry
    host = registry.resolve(None)
    assert (host.id, host.is_sandbox, host.sandbox) == (services.config.default_workspace, False, None)
    with pytest.raises(Forbidden, match="for sandboxes only"):
        host.require_sandbox("code")
    with pytest.raises(SandboxNotFound):
        registry.resolve(UNKNOWN)
    assert registry.known_id(UNKNOWN) is None
    box = await create(client)
    target = registry.resolve(box)
    assert target.is_sandbox
    assert target.require_sandbox("code").id == box
    assert registry.get(box) is target.workspace


async def test_sandbox_only_operation_on_a_host_workspace_is_forbidden(client: Client) -> None:
    refused = await call(client, "run_command", command="sleep 1", background=True)
    assert refused["code"] == "FORBIDDEN"
    assert "for sandboxes only" in str(refused["reason"])
