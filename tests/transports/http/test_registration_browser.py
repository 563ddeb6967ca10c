"""After a registration flood, claude.ai and Claude Code still connect: login and consent in headless Chromium.

What this proves, against the real `bastion serve --http` and Debian's Chromium (through Playwright): a
flood from ten addresses fills the client table; once the flood is older than `unused_client_min_age_s`,
a claude.ai-shaped client (confidential, https callback, `scope` "claudeai") and a Claude Code-shaped one
(public, loopback callback on another port) register, the administrator logs in and approves each in a
real browser, and each redeems its code and makes an MCP call. The callbacks are answered by the browser
itself (no traffic leaves the machine). What it does not prove: the real claude.ai or Claude Code.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx2
import pytest

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .clients import CLAUDE_AI, CLAUDE_CODE, LOOPBACK, from_address
from .live import PASSWORD, LiveServer, callback_params, pkce

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def connect_in_chromium(server: LiveServer, chromium: Any, client: dict[str, Any], redirect_uri: str) -> None:
    """The administrator approves `client` in Chromium; the client redeems the code and calls /mcp."""
    verifier, challenge = pkce()
    page = chromium.new_page()
    seen: list[str] = []

    def answer(route: Any) -> None:
        seen.append(route.request.url)
        route.fulfill(status=200, content_type="text/plain", body="callback received")

    try:
        page.route(f"{redirect_uri}*", answer)
        query = httpx2.QueryParams(
            {
                "response_type": "code",
                "client_id": client["client_id"],
                "redirect_uri": redirect_uri,
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "state": "after-the-flood",
                "resource": server.mcp_url,
            }
        )
        page.goto(f"{server.base}/authorize?{query}")
        assert "administrator login" in page.title()
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        page.click("button[value=approve]")
        page.wait_for_url(f"{redirect_uri}*")
    finally:
        page.close()
    params = callback_params(seen[-1])
    assert params["state"] == ["after-the-flood"]
    form = {
        "grant_type": "authorization_code",
        "code": params["code"][0],
        "code_verifier": verifier,
        "client_id": client["client_id"],
        "redirect_uri": redirect_uri,
    }
    if "client_secret" in client:
        form["client_secret"] = client["client_secret"]
    with server.http() as raw:
        tokens = raw.post("/token", data=form)
        assert tokens.status_code == 200, tokens.text
        assert "claudeai" not in tokens.json()["scope"].split()
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {tokens.json()['access_token']}"}
        assert raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer).status_code == 200


def test_registration_flood_then_claude_ai_and_claude_code_connect_in_chromium(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]], chromium: Any
) -> None:
    extra = "max_clients = 20\nregistrations_per_ip_per_hour = 2\nunused_client_min_age_s = 60"
    with start_proxied_server(http_extra=extra) as server, server.http() as raw:
        flood = [
            raw.post("/register", json=LOOPBACK, headers=from_address(f"192.0.2.{n}")).status_code
            for n in range(1, 12)
            for _ in range(2)
        ]
        assert flood.count(201) == 20
        assert set(flood[20:]) == {429}
        assert raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1")).status_code == 429
        with server.db() as db:  # the flood was two minutes ago
            db.execute("UPDATE oauth_clients SET created_at = created_at - 120")
        claude_ai = raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1"))
        assert claude_ai.status_code == 201, claude_ai.text
        claude_code = raw.post("/register", json=CLAUDE_CODE, headers=from_address("198.51.100.2"))
        assert claude_code.status_code == 201, claude_code.text
        connect_in_chromium(server, chromium, claude_ai.json(), "https://claude.ai/api/mcp/auth_callback")
        connect_in_chromium(server, chromium, claude_code.json(), "http://localhost:47999/callback")
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0] == 20
