"""The gateway's scopes over real HTTP: a live `bastion serve --http` whose `biscuit` is the sshd lab.

What this proves: with tokens from the real OAuth flow (login, consent with some scopes
unticked), a `gateway:read` token sees and runs `biscuit_status` (it reaches the host)
but neither sees `biscuit_deploy` nor may call it (HTTP 403 `insufficient_scope` naming
`gateway:deploy`, no approval queued, nothing sent); a `gateway:deploy` token may ask for
a deploy but not read status; with both, an approved deploy runs once on the host. What it
does not prove: the scope check inside the MCP server without the HTTP edge
(tests/transports/http/test_scopes.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.config import load_config
from bastion.safety.approvals import ApprovalQueue
from bastion.transports.http.password import write_hash
from tests.helpers import MCP_HEADERS, call
from tests.transports.http.live import PASSWORD, LiveServer, free_port, get_tokens, serve_config, write_config

from .lab import GatewayLab, point_demo_at_lab

pytestmark = pytest.mark.anyio

READ_TOOLS = {"biscuit_actions", "biscuit_status", "biscuit_logs"}
DEPLOY_TOOLS = {"biscuit_deploy", "biscuit_restart", "biscuit_rollback"}


@contextlib.contextmanager
def gateway_server(root: Path, lab: GatewayLab) -> Iterator[LiveServer]:
    port = free_port()
    config = write_config(root, port, http_extra="registrations_per_ip_per_hour = 10000")
    point_demo_at_lab(config, lab)
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    with serve_config(root, config, port) as server:
        yield server


@pytest.fixture(scope="module")
def server(lab: GatewayLab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with gateway_server(tmp_path_factory.mktemp("gateway-http") / "demo", lab) as live:
        yield live


def token(server: LiveServer, scopes: list[str]) -> str:
    client_id = server.register(client_name="gateway scopes")["client_id"]
    tokens = get_tokens(server, client_id, scopes=scopes)
    assert set(tokens["scope"].split()) == set(scopes)
    return str(tokens["access_token"])


@contextlib.asynccontextmanager
async def mcp(server: LiveServer, access_token: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {access_token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        Client(streamable_http_client(server.mcp_url, http_client=http)) as client,
    ):
        yield client


def raw_call(server: LiveServer, access_token: str, tool: str, arguments: dict[str, Any]) -> httpx2.Response:
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {access_token}", "Mcp-Protocol-Version": "2026-07-28"}
    with server.http() as raw:
        return raw.post("/mcp", json=body, headers=headers)


def assert_insufficient(response: httpx2.Response, scope: str) -> None:
    assert response.status_code == 403, response.text
    challenge = response.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in challenge
    assert f'scope="{scope}"' in challenge


def host_saw(lab: GatewayLab, literal: str) -> bool:
    return any(record.get("request") == literal for record in lab.dispatch_records())


def queued(server: LiveServer, literal: str) -> list[str]:
    queue = ApprovalQueue(load_config(server.config_path).db_path)
    return [a.id for a in queue.recent() if a.literal == literal]


async def test_read_scope_runs_status_but_never_deploy(server: LiveServer, lab: GatewayLab) -> None:
    access = token(server, ["gateway:read"])
    async with mcp(server, access) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names == READ_TOOLS, names
        status = await call(client, "biscuit_status", project="biscuit")
    assert status["ok"], status
    assert status["detail"]["stdout"] == "biscuit: running\n"
    literal = "deploy biscuit v8.0.0"
    assert_insufficient(
        raw_call(server, access, "biscuit_deploy", {"project": "biscuit", "version": "v8.0.0"}), "gateway:deploy"
    )
    assert queued(server, literal) == []
    assert not host_saw(lab, literal)


async def test_deploy_scope_asks_for_approval_but_cannot_read(server: LiveServer, lab: GatewayLab) -> None:
    access = token(server, ["gateway:deploy"])
    async with mcp(server, access) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names == DEPLOY_TOOLS, names
        asked = await call(client, "biscuit_deploy", project="biscuit", version="v8.1.0")
    assert asked["code"] == "NEEDS_APPROVAL", asked
    assert not host_saw(lab, "deploy biscuit v8.1.0")
    before = lab.settled_count()
    assert_insufficient(raw_call(server, access, "biscuit_status", {"project": "biscuit"}), "gateway:read")
    assert lab.settled_count() == before


async def test_both_scopes_run_an_approved_deploy_once(server: LiveServer, lab: GatewayLab) -> None:
    literal = "deploy biscuit v8.2.0"
    access = token(server, ["gateway:read", "gateway:deploy"])
    async with mcp(server, access) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names == READ_TOOLS | DEPLOY_TOOLS, names
        asked = await call(client, "biscuit_deploy", project="biscuit", version="v8.2.0")
        approval_id = asked["detail"]["approval_id"]
        assert not host_saw(lab, literal)
        ApprovalQueue(load_config(server.config_path).db_path).approve(approval_id, "admin")
        done = await call(client, "biscuit_deploy", project="biscuit", version="v8.2.0", approval_id=approval_id)
    assert done["ok"], done
    assert done["detail"]["stdout"] == "deployed biscuit v8.2.0\n"
    assert sum(run["argv"] == ["deploy", "biscuit", "v8.2.0"] for run in lab.action_runs()) == 1
