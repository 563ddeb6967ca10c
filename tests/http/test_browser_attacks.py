"""Issue 20: an authorization request replaced under the administrator, in headless Chromium.

What this proves, in a real browser against a live `bastion serve --http`: an app's retry in a second tab
replaces its own pending request (same browser, same client), and the first tab's login then says the
request expired and to start again, not "CSRF check failed". The other Chromium attacks of issue 20
(cookie fixation from another port, the /authorize flood, a restart, scopes, bidi names) are in
test_browser.py. What it does not prove: other browsers' tab and cookie rules.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx2
import pytest

from .clients import assert_clients_connect
from .live import PASSWORD, LiveServer, callback_params, pkce

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")
CALLBACK = "http://127.0.0.1/callback"
BROWSER_COOKIE = "__Host-bastion-browser"
EXPIRED_TEXT = "This request expired or was already decided: start again from the app."


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One Chromium per module; each test opens its own context (its own cookie jar)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def authorize_url(server: LiveServer, client_id: str, challenge: str, **extra: str) -> str:
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": CALLBACK,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "st",
        "resource": server.mcp_url,
        **extra,
    }
    return f"{server.base}/authorize?{httpx2.QueryParams(query)}"


def catch_callback(page: Any) -> list[str]:
    """The client's loopback listener, played by the browser itself: record where the server sent us."""
    seen: list[str] = []

    def fulfil(route: Any) -> None:
        seen.append(route.request.url)
        route.fulfill(status=200, content_type="text/plain", body="callback received")

    page.route(f"{CALLBACK}*", fulfil)
    return seen


def redeem(server: LiveServer, client_id: str, verifier: str, location: str) -> dict[str, Any]:
    with server.http() as raw:
        response = raw.post(
            "/token",
            data={
                "grant_type": "authorization_code",
                "code": callback_params(location)["code"][0],
                "code_verifier": verifier,
                "client_id": client_id,
                "redirect_uri": CALLBACK,
            },
        )
    assert response.status_code == 200, response.text
    tokens: dict[str, Any] = response.json()
    return tokens


def test_app_retry_in_another_tab_says_expired_not_csrf_failed(
    start_server: Callable[..., AbstractContextManager[LiveServer]], chromium: Any
) -> None:
    """The app retries in another tab while the first login page is still open: the retry (same browser,
    same client) replaces the first request rather than piling up, so an app cannot fill the pending
    requests. Submitting the old page says the request expired and to start again, never "CSRF check
    failed"; the new tab logs in and approves; claude.ai- and Claude Code-shaped clients connect."""
    with start_server() as server:
        client_id = server.register(client_name="retrying app")["client_id"]
        verifier, challenge = pkce()
        context = chromium.new_context()
        try:
            old_tab = context.new_page()
            old_tab.goto(authorize_url(server, client_id, challenge))
            new_tab = context.new_page()
            seen = catch_callback(new_tab)
            new_tab.goto(authorize_url(server, client_id, challenge))  # the app's retry: replaces the first
            old_tab.fill("input[name=password]", PASSWORD)
            with old_tab.expect_response(lambda r: r.request.method == "POST") as answer:
                old_tab.click("button[type=submit]")
            assert answer.value.status == 403
            old_tab.wait_for_load_state()
            assert EXPIRED_TEXT in old_tab.content()
            assert "CSRF" not in old_tab.content()
            new_tab.fill("input[name=password]", PASSWORD)
            new_tab.click("button[type=submit]")
            new_tab.wait_for_url("**/oauth/consent?*")
            new_tab.click("button[value=approve]")
            new_tab.wait_for_url(f"{CALLBACK}*")
            assert redeem(server, client_id, verifier, seen[-1])["scope"] == "organizer"

        finally:
            context.close()
        assert_clients_connect(server)
