"""Headless Chromium (Debian's `chromium`, driven by Playwright) on the administrator's pages.

What this proves: a real browser, with its own cookie, SameSite and redirect rules, can log in, narrow
the scopes and approve a client, ending at the client's redirect URI with a code that redeems; a wrong
password is refused with a generic message and then rate limited; a cross-site page that posts the
consent form (without the CSRF token, and without the SameSite cookie a browser withholds) is refused
and mints no code; a pending approval is approved from /admin/approvals. What it does not prove:
other browsers' behaviour, or the pages over a TLS reverse proxy.
"""

from __future__ import annotations

import contextlib
import http.server
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from bastion.safety.approvals import ApprovalQueue
from bastion.tools.server import SCOPES

from .chromium import BROWSER_COOKIE, CALLBACK, CHROMIUM, authorize_url, catch_callback, launch
from .clients import assert_clients_connect
from .live import PASSWORD, Browser, LiveServer, callback_params, forms, pkce, serve_config

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per module; each test opens its own context (its own cookie jar)."""
    with launch() as launched:
        yield launched


def test_chromium_logs_in_narrows_and_consents(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    with start_server(cheap_hash=True) as server:
        client_id = server.register(client_name="Chromium test client")["client_id"]
        verifier, challenge = pkce()
        page = browser.new_page()
        seen = catch_callback(page)
        page.goto(authorize_url(server, client_id, challenge))
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
    with start_server(cheap_hash=True, http_extra="login_failures_before_backoff = 3") as server:
        client_id = server.register()["client_id"]
        _, challenge = pkce()
        page = browser.new_page()
        page.goto(authorize_url(server, client_id, challenge))
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
    with start_server(cheap_hash=True) as server:
        client_id = server.register()["client_id"]
        _, challenge = pkce()
        page = browser.new_page()
        seen = catch_callback(page)
        page.goto(authorize_url(server, client_id, challenge))
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
    with start_server(cheap_hash=True) as server:
        queue = ApprovalQueue(server.db_path)
        pending = queue.request("biscuit_deploy", "deploy v1.2.3", "test-client", ttl_s=600)
        # Attack: a literal whose dangerous end is past 200 characters: the decisions' history cut it there.
        long = "deploy v1.2.3 " + "x" * 200 + " target=prod-all-regions,drop-db"
        denied = queue.request("biscuit_deploy", long, "test-client", ttl_s=600)
        page = browser.new_page()
        page.goto(f"{server.base}/admin/approvals")
        page.wait_for_url("**/admin/login")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/admin")
        page.click("a[href='/admin/approvals']")
        page.wait_for_url("**/admin/approvals")
        page.wait_for_load_state()
        assert "deploy v1.2.3" in page.content()
        page.locator(f"form:has(input[value='{pending.id}']) button[value=approve]").click()
        page.wait_for_load_state()
        page.locator(f"form:has(input[value='{denied.id}']) input[name=reason]").fill("not today")
        page.locator(f"form:has(input[value='{denied.id}']) button[value=deny]").click()
        page.wait_for_load_state()
        assert queue.get(pending.id).state == "approved"
        assert queue.get(denied.id).state == "denied"
        assert queue.get(denied.id).reason == "not today"
        assert "target=prod-all-regions,drop-db" in page.locator("table").inner_text()  # the history, whole
        # Without the session's CSRF token the same POST is refused.
        with server.http() as raw:
            forged = raw.post("/admin/approvals", data={"id": pending.id, "decision": "deny"})
        assert forged.status_code == 403


# -- issue 20: the login and consent flow under attack -----------------------------------------------


@contextlib.contextmanager
def cookie_planter(value: str) -> Iterator[str]:
    """An attacker's page on another loopback port: it sets bastion's browser cookie (cookies are not
    separated by port, RFC 6265 §8.5). Returns its URL."""

    class Plant(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Set-Cookie", f"{BROWSER_COOKIE}={value}; Path=/; Secure; SameSite=Lax")
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<p>nothing to see</p>")

        def log_message(self, *args: object) -> None:
            pass

    planter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Plant)
    thread = threading.Thread(target=planter.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{planter.server_address[1]}/"
    finally:
        planter.shutdown()
        planter.server_close()
        thread.join(5)


def _browser_cookie(context: Any) -> str | None:
    values = [c["value"] for c in context.cookies() if c["name"] == BROWSER_COOKIE]
    return values[0] if values else None


def _approve_in_chromium(server: LiveServer, context: Any, client_id: str) -> dict[str, Any]:
    """The administrator approves `client_id` in Chromium as the page ticks it; the token response."""
    verifier, challenge = pkce()
    page = context.new_page()
    seen = catch_callback(page)
    page.goto(authorize_url(server, client_id, challenge))
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/oauth/consent?*")
    page.click("button[value=approve]")
    page.wait_for_url(f"{CALLBACK}*")
    code = callback_params(seen[-1])["code"][0]
    with server.http() as raw:
        tokens: dict[str, Any] = raw.post(
            "/token",
            data={
                "grant_type": "authorization_code",
                "code": code,
                "code_verifier": verifier,
                "client_id": client_id,
                "redirect_uri": CALLBACK,
            },
        ).json()
    page.close()
    return tokens


def test_browser_cookie_fixation_from_another_loopback_port_gets_the_attacker_nothing(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """The attacker's page on another loopback port plants bastion's browser cookie in the administrator's
    Chromium, starts an authorization request for the attacker's client with the same cookie, and lures
    the administrator to its login page. The administrator types the password. Before issue 20 the
    attacker then opened the consent page with the planted cookie and approved itself a code (then a
    token with `workbench gateway:deploy`). Now the login re-issues the cookie and the request follows the
    new value: with the planted one the attacker gets 403 at every step, and no code or grant exists.
    Afterwards the administrator approves a real client in the same browser, and claude.ai- and Claude
    Code-shaped clients connect. What it does not prove: that the administrator would not approve the
    attacker's client on the consent page they are shown (it names the client and its redirect)."""
    with start_server(cheap_hash=True) as server:
        attacker_client = server.register(client_name="Claude Code", scope="workbench gateway:deploy")["client_id"]
        planted = secrets.token_urlsafe(32)
        context = browser.new_context()
        try:
            with cookie_planter(planted) as planter_url:
                context.new_page().goto(planter_url)
            assert _browser_cookie(context) == planted, "Chromium kept the cookie the other port set"
            attacker = Browser(server)
            attacker.cookies[BROWSER_COOKIE] = planted
            try:
                _, challenge = pkce()
                login = attacker.open(attacker.authorize_url(attacker_client, challenge))
                assert login.status_code == 200
                fields = forms(login.text)[0]["fields"]
                assert attacker.cookies[BROWSER_COOKIE] == planted  # the server kept the planted value
                # The administrator, lured to the attacker's login page, logs in.
                page = context.new_page()
                seen = catch_callback(page)
                page.goto(f"{server.base}/oauth/login?txn={fields['txn']}")
                page.fill("input[name=password]", PASSWORD)
                page.click("button[type=submit]")
                page.wait_for_url("**/oauth/consent?*")
                assert _browser_cookie(context) not in (None, planted), "the login re-issued the cookie"
                # The attacker, with the planted value, gets nothing at any step.
                consent = attacker.client.get(f"/oauth/consent?txn={fields['txn']}")
                assert consent.status_code == 403
                assert "another browser" in consent.text
                assert 'name="csrf"' not in consent.text
                assert attacker.client.get(f"/oauth/login?txn={fields['txn']}").status_code == 403
                forged = {**fields, "decision": "approve", "scope": "workbench"}
                assert attacker.client.post("/oauth/consent", data=forged).status_code == 403
                assert attacker.client.post("/oauth/login", data={**fields, "password": PASSWORD}).status_code == 403
                page.click("button[value=deny]")
                page.wait_for_url(f"{CALLBACK}*")
                assert "error=access_denied" in seen[-1]
            finally:
                attacker.close()
            with server.db() as db:
                assert db.execute("SELECT count(*) FROM oauth_codes").fetchone()[0] == 0
                assert db.execute("SELECT count(*) FROM oauth_grants").fetchone()[0] == 0
            # What still works: the administrator approves a real client in the same browser.
            real = server.register(client_name="real client")["client_id"]
            assert _approve_in_chromium(server, context, real)["scope"] == "organizer"
        finally:
            context.close()
        assert_clients_connect(server)


def test_authorize_flood_never_drops_the_administrators_login_in_progress(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """The administrator has the login page open in Chromium; another address sends 1,000 /authorize.
    Before issue 20 the oldest pending requests were dropped at 1,000, the administrator's among them,
    and the login then said "CSRF check failed". Now the flood is refused (429) past 10 pending requests
    and 30 a minute from that address, and the administrator's login and consent complete."""
    with start_proxied_server(cheap_hash=True) as server:
        flooder = server.register(client_name="flooder")["client_id"]
        mine = server.register(client_name="administrator's app")["client_id"]
        verifier, challenge = pkce()
        page = browser.new_page()
        seen = catch_callback(page)
        page.goto(authorize_url(server, mine, challenge))
        assert "administrator login" in page.title()
        statuses: dict[int, int] = {}
        with server.http(headers={"X-Forwarded-For": "198.51.100.20"}) as raw:
            for _ in range(1000):
                status = raw.get(authorize_url(server, flooder, challenge)).status_code
                statuses[status] = statuses.get(status, 0) + 1
        assert statuses == {303: 10, 429: 990}, statuses
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        page.click("button[value=approve]")
        page.wait_for_url(f"{CALLBACK}*")
        assert "code=" in seen[-1]
        with server.http() as raw:
            tokens = raw.post(
                "/token",
                data={
                    "grant_type": "authorization_code",
                    "code": callback_params(seen[-1])["code"][0],
                    "code_verifier": verifier,
                    "client_id": mine,
                    "redirect_uri": CALLBACK,
                },
            )
        assert tokens.status_code == 200, tokens.text
        assert_clients_connect(server)


def test_expired_request_says_start_again_not_csrf_check_failed(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """The login page is open when the request is gone (here: the server restarted, which forgets pending
    requests, as expiry does): submitting it says the request expired and to start again, not "CSRF check
    failed". Starting again then works in the same browser."""
    with start_server(cheap_hash=True) as server:
        client_id = server.register(client_name="patient client")["client_id"]
        _, challenge = pkce()
        page = browser.new_context().new_page()
        page.goto(authorize_url(server, client_id, challenge))
        server.stop()
        with serve_config(server.root, server.config_path, server.port) as again:
            page.fill("input[name=password]", PASSWORD)
            with page.expect_response(lambda r: r.url.endswith("/oauth/login") and r.request.method == "POST") as info:
                page.click("button[type=submit]")
            assert info.value.status == 403
            text = page.inner_text("body")
            assert "expired" in text
            assert "start again" in text
            assert "CSRF" not in text
            assert _approve_in_chromium(again, page.context, client_id)["scope"] == "organizer"
        page.context.close()


def test_consent_pre_ticks_least_privileged_and_registered_scope_bounds_the_request(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """claude.ai registers and asks for the unknown scope `claudeai`: all four toolsets are offered and
    only `organizer` is ticked (before issue 20 all four were ticked, `gateway:deploy` included), so an
    administrator who just clicks Approve grants the least. A client registered for `organizer` asking
    for `workbench gateway:deploy` is refused with invalid_scope; asking for `organizer gateway:deploy` is
    offered `organizer` only."""
    with start_server(cheap_hash=True) as server:
        claude = server.register(client_name="Claude", scope="claudeai")["client_id"]
        _, challenge = pkce()
        page = browser.new_context().new_page()
        page.goto(authorize_url(server, claude, challenge) + "&scope=claudeai")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        ticked = {s: page.is_checked(f"input[value='{s}']") for s in SCOPES}
        assert ticked == {"workbench": False, "organizer": True, "gateway:read": False, "gateway:deploy": False}
        narrow = server.register(client_name="organizer only", scope="organizer")["client_id"]
        refused = page.goto(authorize_url(server, narrow, challenge) + "&scope=workbench%20gateway:deploy")
        assert refused is not None
        assert refused.status == 400
        assert "invalid_scope" in page.inner_text("body")
        page.goto(authorize_url(server, narrow, challenge) + "&scope=organizer%20gateway:deploy")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        offered = page.eval_on_selector_all("input[name=scope]", "boxes => boxes.map(b => b.value)")
        assert offered == ["organizer"]
        assert _approve_in_chromium(server, page.context, claude)["scope"] == "organizer"
        page.context.close()


def test_bidi_override_in_a_client_name_is_shown_escaped(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """A client named with U+202E (right-to-left override) and other invisible characters, which make a
    name read as another (CVE-2021-42574): the login and consent pages show them as `\\u202e`, and no
    such character reaches the page; the name is isolated in <bdi>."""
    name = "Claude\u202eedoC\u2066 \u200b\x07"
    with start_server(cheap_hash=True) as server:
        client_id = server.register(client_name=name)["client_id"]
        _, challenge = pkce()
        page = browser.new_page()
        page.goto(authorize_url(server, client_id, challenge))
        _assert_name_escaped(page)
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        _assert_name_escaped(page)


def _assert_name_escaped(page: Any) -> None:
    assert "Claude\\u202eedoC\\u2066 \\u200b\\u0007" in page.inner_text("body")
    assert not {"\u202e", "\u2066", "\u200b", "\x07"} & set(page.content())
    assert page.locator("bdi", has_text="Claude").count() == 1


def test_chromium_flow_started_from_another_site_completes(
    start_server: Callable[..., AbstractContextManager[LiveServer]], browser: Any
) -> None:
    """As claude.ai does: a page on another site sends the browser to /authorize, so the SameSite=Strict
    browser cookie is withheld on that navigation. The binding checks still let the real flow through
    (the login page tolerates a missing cookie, never a different one; the POSTs and the consent page
    get it), and the code redeems. Guards the fixation fix against breaking real clients."""
    with start_server(cheap_hash=True) as server:
        client_id = server.register(client_name="Claude")["client_id"]
        verifier, challenge = pkce()
        context = browser.new_context()
        page = context.new_page()
        seen = catch_callback(page)
        start = f'<a id="go" href="{authorize_url(server, client_id, challenge)}">connect</a>'
        page.route("http://app.test/", lambda route: route.fulfill(status=200, content_type="text/html", body=start))
        page.goto("http://app.test/")
        with page.expect_request(lambda r: "/oauth/login?" in r.url) as login_request:
            page.click("#go")
        page.wait_for_url("**/oauth/login?*")
        # Chromium withholds the cookie it was just given on this cross-site-initiated redirect.
        assert BROWSER_COOKIE not in (login_request.value.all_headers().get("cookie") or "")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/oauth/consent?*")
        page.click("button[value=approve]")
        page.wait_for_url(f"{CALLBACK}*")
        with server.http() as raw:
            tokens = raw.post(
                "/token",
                data={
                    "grant_type": "authorization_code",
                    "code": callback_params(seen[-1])["code"][0],
                    "code_verifier": verifier,
                    "client_id": client_id,
                    "redirect_uri": CALLBACK,
                },
            )
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["scope"] == "organizer"
        context.close()
