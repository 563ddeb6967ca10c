"""Issue 20 in headless Chromium: a request replaced under the administrator, and a same-host flood.

What this proves, in a real browser against a live `bastion serve --http`: an app's retry in a second tab
replaces its own pending request (same browser, same client), and the first tab's login then says the
request expired and to start again, not "CSRF check failed"; a browser that logged in before starts a
request and connects a client while an attacker on the same host floods /authorize. The other Chromium
attacks of issue 20 (cookie fixation from another port, the /authorize flood from another address, a
restart, scopes, bidi names) are in test_browser.py. What it does not prove: other browsers' rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from bastion.safety.approvals import ApprovalQueue
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .chromium import BROWSER_COOKIE, CALLBACK, CHROMIUM, admin_login, authorize_url, catch_callback, launch
from .clients import CLAUDE_CODE, assert_clients_connect
from .live import PASSWORD, LiveServer, callback_params, pkce

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")
DEVICE_COOKIE = "__Host-bastion-device"
EXPIRED_TEXT = "This request expired or was already decided: start again from the app."


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One Chromium per module; each test opens its own context (its own cookie jar)."""
    with launch() as launched:
        yield launched


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
    with start_server(cheap_hash=True) as server:
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


def test_same_host_authorize_flood_does_not_block_a_browser_that_logged_in_before(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]], chromium: Any
) -> None:
    """An attacker on the same host shares 127.0.0.1 with the administrator: 1,000 /authorize from it fill
    that address's pending requests (10) and its rate (30 a minute), and 99 spoofed addresses fill the
    server's 1,000; a browser without a device cookie from 127.0.0.1 then gets 429. Chromium, which logged
    in once before (device cookie, sent on a navigation it starts itself), is counted as itself: a Claude
    Code-shaped client is approved in it, redeems its code and opens an MCP session. What it does not
    prove: a claude.ai-started request during such a flood (that navigation is cross-site, so the
    SameSite=Strict device cookie is not sent and the address counts: it waits for the flood's requests
    to expire, at most 10 minutes)."""
    with start_proxied_server(cheap_hash=True) as server:
        flooder = server.register(client_name="flooder")["client_id"]
        _, challenge = pkce()
        context = chromium.new_context()
        try:
            page = context.new_page()
            admin_login(page, server.base)
            assert DEVICE_COOKIE in {c["name"] for c in context.cookies(server.base)}
            url = authorize_url(server, flooder, challenge)
            with server.http() as attacker:
                statuses = Counter(attacker.get(url).status_code for _ in range(1000))
                assert statuses == Counter({303: 10, 429: 990}), statuses
                for n in range(99):
                    spoofed = {"X-Forwarded-For": f"198.18.{n}.1"}
                    assert {attacker.get(url, headers=spoofed).status_code for _ in range(10)} == {303}
                full = attacker.get(url, headers={"X-Forwarded-For": "198.18.200.1"})
                assert full.status_code == 429
                assert "too many authorization requests are waiting" in full.text
            stranger = chromium.new_context()
            try:
                refused = stranger.new_page().goto(url)
                assert refused is not None
                assert refused.status == 429  # 127.0.0.1 without a device cookie: the flood holds it
            finally:
                stranger.close()
            assert connect_in_chromium(server, page, CLAUDE_CODE) == "organizer"
        finally:
            context.close()


def connect_in_chromium(server: LiveServer, page: Any, metadata: dict[str, Any]) -> str:
    """Register `metadata`, approve it in `page` as the consent page ticks it, redeem the code, open an
    MCP session: the scope granted."""
    callback = metadata["redirect_uris"][0]
    client_id = server.register(**metadata)["client_id"]
    verifier, challenge = pkce()
    seen: list[str] = []

    def fulfil(route: Any) -> None:
        seen.append(route.request.url)
        route.fulfill(status=200, content_type="text/plain", body="callback received")

    page.route(f"{callback}*", fulfil)
    page.goto(authorize_url(server, client_id, challenge, redirect_uri=callback))
    assert "administrator login" in page.title(), page.inner_text("body")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/oauth/consent?*")
    page.click("button[value=approve]")
    page.wait_for_url(f"{callback}*")
    with server.http() as raw:
        tokens = raw.post(
            "/token",
            data={
                "grant_type": "authorization_code",
                "code": callback_params(seen[-1])["code"][0],
                "code_verifier": verifier,
                "client_id": client_id,
                "redirect_uri": callback,
            },
        )
        assert tokens.status_code == 200, tokens.text
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {tokens.json()['access_token']}"}
        assert raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer).status_code == 200
    granted: str = tokens.json()["scope"]
    return granted


def test_bidi_override_in_an_approval_requester_is_shown_escaped(
    start_server: Callable[..., AbstractContextManager[LiveServer]], chromium: Any
) -> None:
    """A pending gateway approval names who asked for it (`http:<client id>`; a URL client id is the
    client's choice). With U+202E in it, /admin/approvals showed the name reordered; now each invisible or
    bidi character is shown as `\\uXXXX`, and the administrator still approves it."""
    with start_server(cheap_hash=True) as server:
        queue = ApprovalQueue(server.db_path)
        pending = queue.request("biscuit_deploy", "deploy v1.2.3", "http:evil\u202etxt.exe", ttl_s=600)
        context = chromium.new_context()
        try:
            page = context.new_page()
            page.goto(f"{server.base}/admin/approvals")
            page.wait_for_url("**/admin/login")
            page.fill("input[name=password]", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url("**/admin")
            page.goto(f"{server.base}/admin/approvals")
            text = page.inner_text("body")
            assert "http:evil\\u202etxt.exe" in text
            assert "\u202e" not in page.content()
            page.locator(f"form:has(input[value='{pending.id}']) button[value=approve]").click()
            page.wait_for_load_state()
            assert queue.get(pending.id).state == "approved"
        finally:
            context.close()


def test_admin_login_in_another_tab_keeps_a_pending_request(
    start_server: Callable[..., AbstractContextManager[LiveServer]], chromium: Any
) -> None:
    """A login at /admin issues the browser cookie a fresh value (fixation); a login page for an app's
    request, open in another tab and bound to the old value, then said "CSRF check failed". The request now
    follows the browser to its new value: that tab logs in and approves; the old value opens nothing."""
    with start_server(cheap_hash=True) as server:
        client_id = server.register(client_name="waiting app")["client_id"]
        verifier, challenge = pkce()
        context = chromium.new_context()
        try:
            app_tab = context.new_page()
            seen = catch_callback(app_tab)
            app_tab.goto(authorize_url(server, client_id, challenge))
            txn = app_tab.input_value("input[name=txn]")
            old = next(c["value"] for c in context.cookies(server.base) if c["name"] == BROWSER_COOKIE)
            admin_tab = context.new_page()
            admin_login(admin_tab, server.base)
            admin_tab.close()  # Playwright routes a tab's redirects only while it is the last one opened
            assert old not in [c["value"] for c in context.cookies(server.base) if c["name"] == BROWSER_COOKIE]
            with server.http(headers={"Cookie": f"{BROWSER_COOKIE}={old}"}) as holder:
                assert holder.get(f"/oauth/login?txn={txn}").status_code == 403  # the old value opens nothing
            app_tab.fill("input[name=password]", PASSWORD)
            app_tab.click("button[type=submit]")
            app_tab.wait_for_url("**/oauth/consent?*")
            app_tab.click("button[value=approve]")
            app_tab.wait_for_url(f"{CALLBACK}*")
            assert redeem(server, client_id, verifier, seen[-1])["scope"] == "organizer"
        finally:
            context.close()
