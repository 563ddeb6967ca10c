"""Headless Chromium (Debian's `chromium`, driven by Playwright) on the administrator's pages.

What this proves: a real browser, with its own cookie, SameSite and redirect rules, can log in, narrow
the scopes and approve a client, ending at the client's redirect URI with a code that redeems; a wrong
password is refused with a generic message and then rate limited; a cross-site page that posts the
consent form (without the CSRF token, and without the SameSite cookie a browser withholds) is refused
and mints no code; a pending approval is approved from /admin/approvals. What it does not prove:
other browsers' behaviour, or the pages over a TLS reverse proxy.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx2
import pytest

from bastion.safety.approvals import ApprovalQueue
from bastion.tools.server import SCOPES

from .live import PASSWORD, LiveServer, callback_params, pkce

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")
CALLBACK = "http://127.0.0.1/callback"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per module; each test opens its own page, in its own context (own cookies)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def _authorize_url(server: LiveServer, client_id: str, challenge: str) -> str:
    query = httpx2.QueryParams(
        {
            "response_type": "code",
            "client_id": client_id,
            "redirect_uri": CALLBACK,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": "browser-state",
            "resource": server.mcp_url,
        }
    )
    return f"{server.base}/authorize?{query}"


def _catch_callback(page: Any) -> list[str]:
    """The client's loopback listener, played by the browser itself: record where the AS sent us."""
    seen: list[str] = []

    def fulfil(route: Any) -> None:
        seen.append(route.request.url)
        route.fulfill(status=200, content_type="text/plain", body="callback received")

    page.route(f"{CALLBACK}*", fulfil)
    return seen


def test_chromium_logs_in_narrows_and_consents(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    with start_server() as server:
        client_id = server.register(client_name="Chromium test client")["client_id"]
        verifier, challenge = pkce()
        page = browser.new_page()
        seen = _catch_callback(page)
        page.goto(_authorize_url(server, client_id, challenge))
        assert "administrator login" in page.title()
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        assert "Chromium test client" in page.content()
        # The request names no scope: all four are offered, only the least-privileged one is ticked.
        ticked = {s: page.is_checked(f"input[value='{s}']") for s in SCOPES}
        assert ticked == {"workbench": False, "organizer": True, "gateway:read": False, "gateway:deploy": False}
        page.check("input[value='gateway:read']")
        page.click("button[value=approve]")
        page.wait_for_url(f"{CALLBACK}*")
        params = callback_params(seen[-1])
        assert params["state"] == ["browser-state"]
        assert params["iss"] == [server.base]
        with server.http() as raw:
            tokens = raw.post(
                "/token",
                data={
                    "grant_type": "authorization_code",
                    "code": params["code"][0],
                    "code_verifier": verifier,
                    "client_id": client_id,
                    "redirect_uri": CALLBACK,
                },
            ).json()
        assert tokens["scope"] == "organizer gateway:read"


def test_chromium_wrong_password_is_refused_then_rate_limited(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    with start_server(http_extra="login_failures_before_backoff = 3") as server:
        client_id = server.register()["client_id"]
        _, challenge = pkce()
        page = browser.new_page()
        page.goto(_authorize_url(server, client_id, challenge))
        statuses = []
        for _ in range(5):
            page.fill("input[name=password]", "not the password")
            with page.expect_response(lambda r: r.url.endswith("/oauth/login") and r.request.method == "POST") as info:
                page.click("button[type=submit]")
            statuses.append(info.value.status)
            page.wait_for_load_state()
            if info.value.status == 429:
                break
            assert "Login failed." in page.content()
        assert statuses[:2] == [401, 401]
        assert statuses[-1] == 429
        assert "Too many failed attempts" in page.content()


def test_chromium_cross_site_post_without_csrf_fails(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    with start_server() as server:
        client_id = server.register()["client_id"]
        _, challenge = pkce()
        page = browser.new_page()
        seen = _catch_callback(page)
        page.goto(_authorize_url(server, client_id, challenge))
        txn = page.input_value("input[name=txn]")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        # A page on another site posts the consent form in the same browser, without the CSRF token.
        evil = (
            f'<form id="f" method="post" action="{server.base}/oauth/consent">'
            f'<input name="txn" value="{txn}"><input name="decision" value="approve">'
            '<input name="scope" value="workbench"></form><script>document.getElementById("f").submit()</script>'
        )
        attacker = browser.new_page()
        attacker.route(
            "http://attacker.test/", lambda route: route.fulfill(status=200, content_type="text/html", body=evil)
        )
        with attacker.expect_response(lambda r: r.url.endswith("/oauth/consent")) as info:
            attacker.goto("http://attacker.test/")
        assert info.value.status == 403
        assert not seen
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_codes").fetchone()[0] == 0


def test_chromium_approves_a_pending_action(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    with start_server() as server:
        queue = ApprovalQueue(server.db_path)
        pending = queue.request("biscuit_deploy", "deploy v1.2.3", "test-client", ttl_s=600)
        denied = queue.request("biscuit_deploy", "deploy v9.9.9", "test-client", ttl_s=600)
        page = browser.new_page()
        page.goto(f"{server.base}/admin/approvals")
        page.wait_for_url("**/admin/login")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/admin")
        page.click("a[href='/admin/approvals']")
        assert "deploy v1.2.3" in page.content()
        page.locator(f"form:has(input[value='{pending.id}']) button[value=approve]").click()
        page.wait_for_load_state()
        page.locator(f"form:has(input[value='{denied.id}']) input[name=reason]").fill("not today")
        page.locator(f"form:has(input[value='{denied.id}']) button[value=deny]").click()
        page.wait_for_load_state()
        assert queue.get(pending.id).state == "approved"
        assert queue.get(denied.id).state == "denied"
        assert queue.get(denied.id).reason == "not today"
        # Without the session's CSRF token the same POST is refused.
        with server.http() as raw:
            forged = raw.post("/admin/approvals", data={"id": pending.id, "decision": "deny"})
        assert forged.status_code == 403
