"""The whole OAuth flow with the `mcp` SDK's own client (`OAuthClientProvider`) against a live server.

What this proves: a client that only knows the MCP URL discovers the authorization server (401 ->
protected-resource metadata -> RFC 8414 metadata), registers, sends the administrator's browser through
login and consent, redeems the code with PKCE, and calls tools over Streamable HTTP, on both protocol
eras (the 2025-11-25 handshake with SSE, and 2026-07-28); when its access token dies it refreshes, the
refresh token rotates, and a revoked grant is refused at once. What it does not prove: that other
clients (claude.ai, Cursor) behave the same; the conformance and Inspector tests cover more.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS, call

from .live import Browser, LiveServer, get_tokens
from .sdk_client import MemoryStorage, mcp_client, sdk_provider

pytestmark = pytest.mark.anyio


@pytest.mark.bwrap  # it runs a command
@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_sdk_client_full_flow(server: LiveServer, browsers: Callable[[LiveServer], Browser], mode: str) -> None:
    storage, opened = MemoryStorage(), list[str]()
    browser = browsers(server)
    provider = sdk_provider(server, browser, storage, None, opened)
    async with httpx2.AsyncClient(auth=provider, timeout=30) as http, mcp_client(server, http, mode) as client:
        version = client.session.protocol_version
        assert version is not None
        assert (version < "2026-07-28") is (mode == "legacy"), version
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert {"run_command", "read_file", "list_directory"} <= tools
        listing = await call(client, "list_directory")
        assert listing["ok"], listing
        ran = await call(client, "run_command", command="echo over-http")
        assert ran["ok"], ran
        assert "over-http" in ran["detail"]["stdout"]
    assert storage.client_info is not None
    audit = [json.loads(line) for line in (server.root / "state" / "audit.jsonl").read_text().splitlines()]
    callers = {record.get("caller") for record in audit if record.get("tool") == "run_command"}
    # The server is shared by the tests of this module: earlier clients' records are there too.
    assert f"http:{storage.client_info.client_id}" in callers, "the audit log names the OAuth client"
    assert all(caller.startswith("http:") for caller in callers), callers
    assert len(opened) == 1
    assert opened[0].startswith(f"{server.base}/authorize?")
    assert storage.tokens is not None
    assert storage.tokens.refresh_token
    first = storage.tokens

    # The access token dies (clock moved on): the SDK refreshes, and the refresh token rotates.
    with server.db() as db:
        db.execute("UPDATE oauth_tokens SET expires_at = ? WHERE kind = 'access'", (time.time() - 1,))
    provider.context.token_expiry_time = time.time() - 1  # the client's clock moved on too
    async with httpx2.AsyncClient(auth=provider, timeout=30) as http, mcp_client(server, http, mode) as client:
        assert (await call(client, "list_directory"))["ok"]
    assert storage.tokens.access_token != first.access_token
    assert storage.tokens.refresh_token != first.refresh_token
    assert len(opened) == 1, "a refresh must not send the administrator through the browser again"
    with server.db() as db:  # past the 10 s grace window for two sessions refreshing at once
        db.execute("UPDATE oauth_tokens SET used_at = used_at - 11 WHERE used_at IS NOT NULL")
    with server.http() as raw:
        reused = raw.post(
            "/token",
            data={
                "grant_type": "refresh_token",
                "refresh_token": first.refresh_token,
                "client_id": storage.client_info.client_id,
            },
        )
        assert reused.status_code == 400
        assert reused.json()["error"] == "invalid_grant"
        # Reuse of the rotated token revoked the family: the current access token is dead too.
        probe = raw.post("/mcp", json={}, headers={"Authorization": f"Bearer {storage.tokens.access_token}"})
        assert probe.status_code == 401


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_scopes_narrowed_at_consent_limit_list_and_call(
    server: LiveServer, browsers: Callable[[LiveServer], Browser], mode: str
) -> None:
    """A token for `organizer` only sees no workbench tool and cannot call one, on both eras."""
    storage, opened = MemoryStorage(), list[str]()
    browser = browsers(server)
    provider = sdk_provider(server, browser, storage, "organizer", opened)
    async with httpx2.AsyncClient(auth=provider, timeout=30) as http, mcp_client(server, http, mode) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert not names & {"run_command", "read_file", "list_directory", "write_file"}
        assert {"list_files", "plan_organize", "move_file"} <= names, "the granted toolset must stay visible"
        assert (await call(client, "list_files"))["ok"]
    assert storage.tokens is not None
    assert storage.tokens.scope == "organizer"
    token = storage.tokens.access_token
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
    body: dict[str, Any] = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "run_command", "arguments": {"command": "id"}},
    }
    with server.http() as raw:
        refused = raw.post("/mcp", json=body, headers={**headers, "Mcp-Protocol-Version": "2026-07-28"})
    assert refused.status_code == 403
    challenge = refused.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in challenge
    assert 'scope="workbench"' in challenge
    assert f'resource_metadata="{server.base}/.well-known/oauth-protected-resource/mcp"' in challenge


def test_handshake_era_is_stateful_with_sse_responses(server: LiveServer) -> None:
    """2025-11-25: initialize opens a session, and requests are answered on an SSE stream (progress, elicitation)."""
    tokens = get_tokens(server, server.register(client_name="sse probe")["client_id"])
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
    with server.http() as raw:
        opened = raw.post("/mcp", json=INITIALIZE_REQUEST, headers=headers)
        assert opened.status_code == 200
        assert opened.headers["content-type"].startswith("text/event-stream")
        assert (
            json.loads(opened.text.split("data: ", 1)[1].splitlines()[0])["result"]["protocolVersion"] == "2025-11-25"
        )
        session = {**headers, "Mcp-Session-Id": opened.headers["mcp-session-id"], "Mcp-Protocol-Version": "2025-11-25"}
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert raw.post("/mcp", json=initialized, headers=session).status_code == 202
        listed = raw.post("/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=session)
        assert listed.status_code == 200
        assert listed.headers["content-type"].startswith("text/event-stream")
        assert '"run_command"' in listed.text
        no_session = raw.post("/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, headers=headers)
        assert no_session.status_code == 400  # stateful: a request outside a session is refused
