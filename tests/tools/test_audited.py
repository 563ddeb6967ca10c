"""`audited_tool`, through the SDK's real client and the real audit log.

What this proves: the audit record's arguments are the call's bound arguments, defaults
included, with marked ones recorded as their length, their sorted names, or not at all; the
client's context and the workspace come from the server, not from the arguments; files
touched reach the record and not the client; the body names no action, the result does;
and the tool's input schema is its parameters, markers leaving no trace in it.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import pytest
from mcp import Client
from mcp.server.mcpserver import Context
from mcp_types import ImageContent, ToolAnnotations
from pydantic import Field

from bastion.app import Services, build_server
from bastion.safety.audit import verify
from bastion.safety.errors import InvalidRequest
from bastion.safety.results import OperationResult
from bastion.tools._call import UNNAMED, Outcome
from bastion.tools.audited import Audit, audited_tool, binder, workspace_of
from bastion.tools.server import ORGANIZER, BastionServer
from tests.helpers import audit_record, call

pytestmark = pytest.mark.anyio

_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)


def _declare(server: BastionServer) -> None:
    @audited_tool(
        server,
        "stash",
        mutating=True,
        annotations=_WRITES,
        toolset=ORGANIZER,
        workspace=workspace_of("place", lambda place: f"place:{place or 'home'}"),
        description="Stash a blob.",
    )
    async def stash(
        ctx: Context[Any, Any],
        blob: Annotated[str, Field(description="The bytes."), Audit.LENGTH],
        token: Annotated[str, Audit.OMIT],
        files: Annotated[dict[str, str] | None, Audit.KEYS] = None,
        place: Annotated[str | None, Audit.OMIT] = None,
        count: int = 1,
    ) -> Outcome:
        assert ctx.client_capabilities is not None  # the SDK's context reached the body
        if count < 1:
            raise InvalidRequest("count must be at least 1")
        detail = {"stored": len(blob) * count}
        return Outcome(OperationResult.success(UNNAMED, detail), files=sorted(files or {}))


async def test_the_record_has_the_bound_arguments_as_marked_and_the_files(services: Services) -> None:
    server = build_server(services, caller="test")
    _declare(server)
    async with Client(server) as client:
        done = await call(client, "stash", blob="x" * 300, token="s3cret-token", files={"b": "1", "a": "2"})
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert done["ok"], done
    assert done["action"] == "stash"
    assert done["detail"] == {"stored": 300}
    end = audit_record(services.config.audit_path, done["audit_id"])
    assert end["tool"] == "stash"
    assert end["workspace"] == "place:home"
    assert end["args"] == {"blob_chars": 300, "files": ["a", "b"], "count": 1}
    assert end["files"] == ["a", "b"]
    log = services.config.audit_path.read_text()
    assert "s3cret-token" not in log
    assert "x" * 300 not in log
    assert verify(services.config.audit_path).ok
    assert server.tool_scopes["stash"] == ORGANIZER
    schema = listed["stash"].input_schema
    assert sorted(schema["properties"]) == ["blob", "count", "files", "place", "token"]
    assert schema["properties"]["blob"] == {"description": "The bytes.", "title": "Blob", "type": "string"}
    assert sorted(schema["required"]) == ["blob", "token"]


async def test_a_refusal_in_the_body_is_audited_with_its_arguments(services: Services) -> None:
    server = build_server(services, caller="test")
    _declare(server)
    async with Client(server) as client:
        refused = await call(client, "stash", blob="y", token="t", place="attic", count=0, files={"f": ""})
    assert refused["code"] == "INVALID_REQUEST", refused
    assert refused["action"] == "stash"
    end = audit_record(services.config.audit_path, refused["audit_id"])
    assert (end["code"], end["workspace"], end["files"]) == ("INVALID_REQUEST", "place:attic", [])
    assert end["args"] == {"blob_chars": 1, "files": ["f"], "count": 0}


async def test_images_of_an_outcome_follow_the_result(services: Services) -> None:
    server = build_server(services, caller="test")
    image = ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png")

    @audited_tool(server, "draw", mutating=False, annotations=_WRITES, description="Draw.")
    async def draw() -> Outcome:
        return Outcome(OperationResult.success(UNNAMED, {"drawn": 1}), images=[image])

    async with Client(server) as client:
        result = await client.call_tool("draw", {})
    assert result.structured_content is not None
    assert result.structured_content["detail"] == {"drawn": 1}
    assert [block.type for block in result.content] == ["text", "image"]
    assert result.content[1] == image


def test_thebinder_gives_what_signature_bind_gives_and_refuses_the_same() -> None:
    """`binder` stands in for `inspect.Signature.bind` on the hot path: the same arguments in the same
    order, defaults applied, and the same TypeError for a missing or an unknown name."""

    async def body(a: int, b: int = 1, *, c: str | None = None, d: str = "x") -> dict[str, Any]:
        return {}

    signature = inspect.signature(body)
    bind = binder(signature)
    for given in ({"a": 1}, {"a": 1, "d": "y", "b": 3}, {"c": "z", "a": 0}):
        expected = signature.bind(**given)
        expected.apply_defaults()
        assert list(bind(given).items()) == list(expected.arguments.items())
    for wrong in ({}, {"a": 1, "e": 2}, {"b": 2}):
        with pytest.raises(TypeError) as ours:
            bind(wrong)
        with pytest.raises(TypeError) as theirs:
            signature.bind(**wrong)
        assert str(ours.value) == str(theirs.value)


def test_thebinder_of_a_body_with_star_arguments_is_signature_bind() -> None:
    async def body(a: int, **rest: Any) -> dict[str, Any]:
        return {}

    assert binder(inspect.signature(body))({"a": 1, "z": 2}) == {"a": 1, "rest": {"z": 2}}
