"""Two Claude Code sessions sharing one credential store refresh at once (issue 20), with the SDK's client.

What this proves, against the real `bastion serve --http`: two `OAuthClientProvider`s (the SDK's OAuth
client, as Claude Code sessions use) loaded from one token store, both holding the same expired access
token, refresh concurrently with the same refresh token; both get the same new pair, both tool calls
succeed, nobody is sent back to the administrator's browser, and the grant is not revoked. What it does
not prove: Claude Code's own store (a file), or sessions that refresh more than 10 s apart (reuse).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import httpx2
import pytest
from mcp.client.auth import OAuthClientProvider

from tests.helpers import call

from .live import Browser, LiveServer
from .sdk_client import MemoryStorage, mcp_client, sdk_provider

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_two_sessions_sharing_one_credential_store_refresh_at_once(
    server: LiveServer, browsers: Callable[[LiveServer], Browser], mode: str
) -> None:
    storage, opened = MemoryStorage(), list[str]()
    first = sdk_provider(server, browsers(server), storage, None, opened)
    async with httpx2.AsyncClient(auth=first, timeout=30) as http, mcp_client(server, http, mode) as client:
        assert (await call(client, "list_files"))["ok"]
    assert storage.tokens is not None
    assert storage.client_info is not None
    old = storage.tokens
    assert len(opened) == 1

    # Later: the access token has expired; two sessions start from the store and both must refresh.
    with server.db() as db:
        db.execute("UPDATE oauth_tokens SET expires_at = ? WHERE kind = 'access'", (time.time() - 1,))
    sessions: list[OAuthClientProvider] = []
    for _ in range(2):
        session = sdk_provider(server, browsers(server), storage, None, opened)
        await session._initialize()  # both read the store before either refreshes
        session.context.token_expiry_time = time.time() - 1
        sessions.append(session)
    results: list[bool] = []

    async def work(session: OAuthClientProvider) -> None:
        async with httpx2.AsyncClient(auth=session, timeout=30) as http, mcp_client(server, http, mode) as client:
            results.append(bool((await call(client, "list_files"))["ok"]))

    async with anyio.create_task_group() as tasks:
        for session in sessions:
            tasks.start_soon(work, session)

    assert results == [True, True]
    assert len(opened) == 1, "neither session was sent back to the administrator"
    pairs = {(s.context.current_tokens.access_token, s.context.current_tokens.refresh_token) for s in sessions}  # type: ignore[union-attr]
    assert len(pairs) == 1, "both sessions hold the same new pair"
    assert pairs != {(old.access_token, old.refresh_token)}
    client_id = storage.client_info.client_id
    with server.db() as db:
        revoked = db.execute(
            "SELECT count(*) FROM oauth_grants WHERE client_id = ? AND revoked_at IS NOT NULL", (client_id,)
        ).fetchone()[0]
    assert revoked == 0
    assert f"refresh token of client {client_id} presented again within the grace window" in server.log()
