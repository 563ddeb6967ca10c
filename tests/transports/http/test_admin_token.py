"""`bastion admin token`, `tokens`, `revoke` and `clients list|prune` against a live server (issue 20).

What this proves, with the real CLI beside the real `bastion serve --http`: `admin token` prints an
access token once (only its digest is stored), which a real MCP client uses over Streamable HTTP for a
tool call within its scopes and not beyond them; `admin tokens` lists it as a grant (never the token),
`admin revoke <grant>` stops it at once, and an expired one is refused; bad names, scopes and lifetimes
are refused with one line and exit 78, issuing nothing. `clients prune` forgets never-used clients older
than `--older-than` and keeps the young ones and any that got a grant; `clients` shows names escaped.
What it does not prove: the Inspector's own UI (it sends the same header).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS, call

from .live import BASTION, LiveServer, get_tokens


def bastion(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(BASTION), "admin", *args, "--config", str(server.config_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)


def issue(server: LiveServer, *args: str) -> tuple[str, str]:
    """`admin token ARGS`: (the token, the grant id named in its message)."""
    issued = bastion(server, "token", *args)
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip()
    assert len(token) >= 40
    assert "\n" not in token
    grant_id = issued.stderr.split("bastion admin revoke ")[1].split("'")[0]
    return token, grant_id


def mcp_status(server: LiveServer, token: str) -> int:
    with server.http() as raw:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {token}"}
        return raw.post("/mcp", json=INITIALIZE_REQUEST, headers=headers).status_code


def grant_count(server: LiveServer) -> int:
    with server.db() as db:
        return int(db.execute("SELECT count(*) FROM oauth_grants").fetchone()[0])


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_admin_token_works_for_a_real_mcp_call_and_revoke_stops_it(server: LiveServer, mode: str) -> None:
    token, grant_id = issue(server, "--client", "inspector", "--scope", "organizer", "--ttl", "10m")
    with server.db() as db:
        stored = [row[0] for row in db.execute("SELECT digest FROM oauth_tokens WHERE grant_id = ?", (grant_id,))]
    assert stored == [hashlib.sha256(token.encode()).hexdigest()], "only the digest is stored"

    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
        Client(streamable_http_client(server.mcp_url, http_client=http), mode=mode) as client,
    ):
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert "list_files" in names
        assert "run_command" not in names, "the token's scopes bound what it sees"
        assert (await call(client, "list_files"))["ok"]
    with server.http() as raw:  # and what it may call
        body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "run_command", "arguments": {}}}
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {token}", "Mcp-Protocol-Version": "2026-07-28"}
        assert raw.post("/mcp", json=body, headers=headers).status_code == 403

    listed = bastion(server, "tokens", "--json")
    grants = {g["grant_id"]: g for g in json.loads(listed.stdout)}
    assert grants[grant_id]["client_id"] == "cli:inspector"
    assert grants[grant_id]["scopes"] == ["organizer"]
    assert token not in listed.stdout + bastion(server, "tokens").stdout

    revoked = bastion(server, "revoke", grant_id)
    assert revoked.stdout.strip() == "revoked 1 grant(s)", revoked.stderr
    assert mcp_status(server, token) == 401
    assert grant_id not in bastion(server, "tokens").stdout
    # What still works: an OAuth client's own grant, untouched by the revocation.
    other = get_tokens(server, server.register(client_name="after revoke")["client_id"])
    assert mcp_status(server, other["access_token"]) == 200


def test_admin_token_expires_with_its_ttl(server: LiveServer) -> None:
    token, grant_id = issue(server, "--client", "script.1", "--scope", "organizer workbench", "--ttl", "60")
    assert mcp_status(server, token) == 200
    with server.db() as db:  # the minute has passed
        db.execute("UPDATE oauth_tokens SET expires_at = ? WHERE grant_id = ?", (time.time() - 1, grant_id))
        db.execute("UPDATE oauth_grants SET expires_at = ? WHERE grant_id = ?", (time.time() - 1, grant_id))
    assert mcp_status(server, token) == 401
    assert grant_id not in bastion(server, "tokens").stdout, "an expired grant is not listed as active"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--client", "inspector", "--scope", "root"), "unknown scope root"),
        (("--client", "inspector", "--scope", ""), "unknown scope (none)"),
        (("--client", "bad name\u202e", "--scope", "organizer"), "--client"),
        (("--client", "x" * 65, "--scope", "organizer"), "--client"),
        (("--client", "inspector", "--scope", "organizer", "--ttl", "59"), "--ttl must be"),
        (("--client", "inspector", "--scope", "organizer", "--ttl", "1000d"), "--ttl must be"),
        (("--client", "inspector", "--scope", "organizer", "--listen", "127.0.0.1:\u00b2"), "--listen"),
    ],
)
def test_admin_token_bad_arguments_issue_nothing(server: LiveServer, args: tuple[str, ...], says: str) -> None:
    before = grant_count(server)
    refused = bastion(server, "token", *args)
    assert refused.returncode == 2, refused.stderr  # usage: a bad value
    assert says in refused.stderr
    assert refused.stdout == ""
    assert "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert grant_count(server) == before


# Found by attack: the duration's `\d` took other scripts' digits ("٦٠" was 60 seconds).
@pytest.mark.parametrize("ttl", ["soon", "\u0666\u0660"])
def test_admin_token_ttl_that_is_not_a_duration_is_a_usage_error(server: LiveServer, ttl: str) -> None:
    before = grant_count(server)
    refused = bastion(server, "token", "--client", "inspector", "--scope", "organizer", "--ttl", ttl)
    assert refused.returncode == 2
    assert "not a duration" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert grant_count(server) == before


def test_admin_clients_prune_forgets_only_old_unused_clients(server: LiveServer) -> None:
    used = server.register(client_name="used")["client_id"]
    get_tokens(server, used)
    old_unused = server.register(client_name="old unused \u202egnp.exe")["client_id"]
    young_unused = server.register(client_name="young unused")["client_id"]
    with server.db() as db:  # registered an hour ago
        db.execute(
            "UPDATE oauth_clients SET created_at = created_at - 3600 WHERE client_id IN (?, ?)", (used, old_unused)
        )

    listed = bastion(server, "clients")
    assert old_unused in listed.stdout
    assert "\u202e" not in listed.stdout, "names are shown escaped"
    assert "\\u202e" in listed.stdout
    pruned = bastion(server, "clients", "prune", "--older-than", "30m", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["removed"] >= 1
    remaining = {c["client_id"] for c in json.loads(bastion(server, "clients", "--json").stdout)}
    assert old_unused not in remaining
    assert {used, young_unused} <= remaining, "a client with a grant, and a young one, are kept"
    # The pruned client is gone for the server too; the used one still connects.
    with server.http() as raw:
        unknown = raw.get("/authorize", params={"client_id": old_unused, "response_type": "code"})
        assert unknown.status_code == 400
    assert mcp_status(server, get_tokens(server, used)["access_token"]) == 200
