"""The call contract: every answer is an OperationResult; no traceback ever reaches a client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp_types import TextContent

from bastion.app import Services, build_server
from bastion.safety.audit import verify
from bastion.safety.results import OperationResult
from bastion.tools.server import to_call_result
from bastion.workbench.workspace import HostWorkspace
from tests.helpers import LoopLag

pytestmark = pytest.mark.anyio

SECRET_DETAIL = "boom: /srv/secret-internal-path"


def _text(result: object) -> str:
    return json.dumps([c.model_dump() for c in result.content]) + json.dumps(result.structured_content)  # type: ignore[attr-defined]


async def test_internal_error_in_a_tool_is_an_internal_error_result(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash inside the tool's operation is INTERNAL_ERROR with an incident id; its text stays on the server."""

    def explode(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(SECRET_DETAIL)

    monkeypatch.setattr(HostWorkspace, "read_file", explode)
    async with Client(build_server(services, caller="test")) as client:
        result = await client.call_tool("read_file", {"path": "README.md"})
    payload = result.structured_content
    assert payload is not None
    assert result.is_error is True
    assert payload["ok"] is False
    assert payload["code"] == "INTERNAL_ERROR"
    assert "incident" in payload["reason"]
    assert SECRET_DETAIL not in _text(result)
    assert "Traceback" not in _text(result)
    assert verify(services.config.audit_path).ok


async def test_crash_outside_the_call_runner_is_still_a_result(services: Services) -> None:
    """Even a tool that raises past its runner (a bastion bug) answers INTERNAL_ERROR, not SDK free text."""
    server = build_server(services, caller="test")

    @server.tool(name="broken", description="Always crashes outside its call runner.")
    async def broken() -> str:
        raise RuntimeError(SECRET_DETAIL)

    async with Client(server) as client:
        result = await client.call_tool("broken", {})
    assert result.is_error is True
    assert result.structured_content is not None
    assert result.structured_content["code"] == "INTERNAL_ERROR"
    assert SECRET_DETAIL not in _text(result)


async def test_bad_argument_types_are_invalid_request(client: Client) -> None:
    result = await client.call_tool("run_command", {"command": 42})
    assert result.structured_content is not None
    assert result.structured_content["code"] == "INVALID_REQUEST"
    assert "command" in result.structured_content["reason"]
    missing = await client.call_tool("read_file", {})
    assert missing.structured_content is not None
    assert missing.structured_content["code"] == "INVALID_REQUEST"


async def test_unknown_argument_is_refused_not_ignored(client: Client) -> None:
    result = await client.call_tool("run_command", {"command": "ls", "env": {"LD_PRELOAD": "/x.so"}})
    assert result.structured_content is not None
    assert result.structured_content["code"] == "INVALID_REQUEST"
    assert "environment is fixed" in result.structured_content["reason"]
    other = await client.call_tool("read_file", {"path": "README.md", "follow": True})
    assert other.structured_content is not None
    assert other.structured_content["code"] == "INVALID_REQUEST"


@pytest.mark.parametrize("huge", ["argument", "tool"])
async def test_a_huge_unknown_name_is_not_echoed_whole(client: Client, huge: str) -> None:
    """Found by attack: an unknown argument's name was quoted whole in the reason: a name of a million characters
    came back as a reason (and a text block) of a million, and was redacted again in the audit record. Invariant:
    the reason stays short, says the name was cut, and the call is refused as unknown."""
    name = "k" * 1_000_000
    if huge == "argument":
        result = await client.call_tool("list_directory", {"path": ".", name: 1})
    else:
        result = await client.call_tool(name, {})
    payload = result.structured_content
    assert payload is not None
    assert payload["code"] == "INVALID_REQUEST"
    assert f"unknown {huge} 'kkkk" in payload["reason"]
    assert "(cut, 1000000 characters)" in payload["reason"]
    assert len(payload["reason"]) < 500
    assert len(_text(result)) < 1500


@pytest.mark.parametrize(
    "arguments",
    [
        {"limits": {"\u200b" * 300_000: 1}},
        {"network_allow": ["\u200b" * 300_000]},
        {"limits": {f"k{i}": 1 for i in range(5000)}},
    ],
    ids=["limits-key", "network-rule", "many-bad-items"],
)
async def test_a_huge_argument_is_not_echoed_whole_in_create_sandboxs_refusal(
    client: Client, arguments: dict[str, object]
) -> None:
    """Found by review (twenty-seventh session): over HTTP a `create_sandbox` whose `limits` key or
    `network_allow` rule was 1.3 M zero-width spaces (3.9 MB) came back as a 7.8 MB or 20.8 MB answer: pydantic's
    path of the bad field was joined whole (a dict key is part of it), and the rule's parse error quoted it
    (`{text!r}`). Invariant: the refusal is typed and small, each path cut, at most a few listed."""
    result = await client.call_tool("create_sandbox", arguments)
    payload = result.structured_content
    assert payload is not None
    assert payload["code"] == "INVALID_REQUEST", payload
    assert len(_text(result)) < 4096, len(_text(result))


async def test_a_refused_keys_control_characters_are_quoted_in_the_reason(client: Client) -> None:
    """Found by review: a short `limits` key was written raw into the reason, a newline or an escape sequence
    with it. Invariant: such a part of the path is quoted (escaped), and an ordinary one is left as it is."""
    result = await client.call_tool("create_sandbox", {"limits": {"a\n\x1b[2Jb": 1, "memory_bytes": "x"}})
    payload = result.structured_content
    assert payload is not None
    assert payload["code"] == "INVALID_REQUEST", payload
    assert "limits.'a\\n\\x1b[2Jb'" in payload["reason"], payload["reason"]
    assert "limits.memory_bytes" in payload["reason"], payload["reason"]
    assert "\n" not in payload["reason"], payload["reason"]


async def test_a_huge_secret_dense_argument_holds_the_event_loop_no_longer_than_a_plain_one(client: Client) -> None:
    """Found by attack: the audit record's cleaning redacted each string argument whole before cutting it to 4,096
    characters, on the event loop: one 4 MiB argument of `key=` lines (the redactor's costliest text) to a tool
    that does not exist held every agent's calls 2.5 s, and could be sent again and again. Invariant: the call is
    refused as unknown, its record kept (cut), and the loop's longest stall (its own CPU) stays far under that
    of the whole text's redaction (1.8 s for these 3 MB before the fix)."""
    with LoopLag() as lag:
        result = await client.call_tool("no_such_tool", {"text": "key=\n" * 600_000})
    payload = result.structured_content
    assert payload is not None
    assert payload["code"] == "INVALID_REQUEST"
    assert lag.cpu_worst < 0.4, lag.cpu_worst


async def test_unknown_workspace_is_sandbox_not_found(client: Client) -> None:
    result = await client.call_tool("run_command", {"command": "ls", "sandbox_id": "nope"})
    assert result.structured_content is not None
    assert result.structured_content["code"] == "SANDBOX_NOT_FOUND"


@pytest.mark.bwrap
async def test_non_zero_exit_is_ok_with_status(client: Client, workspace: Path) -> None:
    result = await client.call_tool("run_command", {"command": "ls no-such-file"})
    payload = result.structured_content
    assert payload is not None
    assert payload["ok"] is True
    assert result.is_error is False
    assert payload["detail"]["exit_status"] == 2
    assert "no-such-file" in payload["detail"]["stderr"]


async def test_every_result_carries_its_audit_id(client: Client, services: Services) -> None:
    result = await client.call_tool("explain_command", {"command": "git status"})
    payload = result.structured_content
    assert payload is not None
    assert payload["detail"]["allowed"] is True
    lines = services.config.audit_path.read_text().splitlines()
    assert json.loads(lines[-1])["id"] == payload["audit_id"]


async def test_a_refused_call_records_its_arguments_by_the_tools_audit_rules(
    client: Client, services: Services
) -> None:
    """Attack (found by review): a call refused for a bad argument recorded the client's arguments as sent,
    past the tool's audit rules: upload_file's whole content (recorded as its length when the call runs) and
    create_run_close's files' contents (recorded as their names). Refused, they are recorded as when they run."""
    content = "c2VjcmV0IGZpbGUgYm9keQ=="
    refused = await client.call_tool(
        "upload_file", {"path": "f.bin", "content_base64": content, "overwrite": "notabool"}
    )
    assert refused.is_error
    await client.call_tool("create_run_close", {"command": "true", "files": {"f": "file body"}, "timeout_s": "x"})
    text = services.config.audit_path.read_text()
    assert content not in text
    assert "file body" not in text
    records = [json.loads(line) for line in text.splitlines()]
    upload = next(r for r in records if r.get("tool") == "upload_file")
    assert upload["args"]["content_base64_chars"] == len(content)
    run = next(r for r in records if r.get("tool") == "create_run_close")
    assert run["args"]["files"] == ["f"]


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: both forms write them as null
    | st.text(alphabet=st.characters(codec="utf-8"))  # every code point but the surrogates
)
_DETAILS = st.dictionaries(
    st.text(max_size=8),
    st.recursive(_LEAVES, lambda x: st.lists(x, max_size=4) | st.dictionaries(st.text(max_size=5), x, max_size=4)),
    max_size=5,
)


def _text_as_before(result: OperationResult) -> str:
    return json.dumps(result.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))


@given(_DETAILS, st.text())
@settings(max_examples=300)
def test_the_text_block_holds_the_structured_content_as_json(detail: dict[str, object], reason: str) -> None:
    """The text block is pydantic's JSON of the result: the same value as the structured content, and as the
    text `json.dumps` wrote before (floats may be spelled otherwise: 5e-05 and 0.00005)."""
    result = OperationResult.success("read_file", detail, reason=reason)
    wire = to_call_result(result)
    [block] = wire.content
    assert isinstance(block, TextContent)
    assert json.loads(block.text) == wire.structured_content == json.loads(_text_as_before(result))


def test_a_value_pydantic_cannot_write_is_written_as_before() -> None:
    result = OperationResult.success("run_command", {"stdout": "a\udc80b"})
    [block] = to_call_result(result).content
    assert isinstance(block, TextContent)
    assert block.text == _text_as_before(result)
