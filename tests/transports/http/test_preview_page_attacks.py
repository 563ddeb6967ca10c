"""A page on another port of the host (what a sandbox's preview page is) against the login and consent steps.

What this proves, against a live `bastion serve --http`: requests another page sends to /authorize, the
login and consent pages and the /oauth and /admin form POSTs are refused with 403 by Fetch Metadata
before anything counts them, so such a page (same-site: cookies ignore ports, and SameSite=Strict sends
them) can neither back off the administrator's device with wrong passwords nor fill its pending requests;
in real Chromium the administrator then logs in at once and authorizes a client, also from a same-site
page's link (as the MCP Inspector, on another localhost port, navigates). What it does not prove:
browsers that send no Fetch Metadata (they are let through, as non-browser clients are), or a page that
makes the administrator click a link to /authorize (a navigation, allowed: one request per click).
"""

from __future__ import annotations

import contextlib
import html
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from bastion.transports.http.devices import DEVICE_COOKIE, DEVICE_LIFETIME_S
from bastion.transports.http.flow import NOT_A_NAVIGATION, NOT_OUR_FORM

from .chromium import BROWSER_COOKIE, CALLBACK, CHROMIUM, admin_login, authorize_url, catch_callback, launch
from .clients import assert_clients_connect
from .live import PASSWORD, Browser, LiveServer, forms, pkce, redeem_code

# One failure backs a key off, and three pending requests fill it: the attack needs only a few requests.
TIGHT = "login_failures_before_backoff = 1\nlogin_backoff_max_s = 900\npending_authorizations_per_ip = 3"
BROWSER_ONLY = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")


@contextlib.contextmanager
def page_on_another_port(document: str) -> Iterator[str]:
    """A page served on another 127.0.0.1 port, as a sandbox's preview is. Returns its URL."""
    body = document.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def lockout_script(server: LiveServer, planted: str, login_fields: dict[str, str], urls: list[str]) -> str:
    """The attacker's page: plant the browser cookie its own login form is bound to, post wrong passwords
    to that form (each counted against the administrator's device before), fetch /authorize for its
    clients (each a pending request of that device before); `window.done` when every request is answered."""
    wrong = json.dumps({**login_fields, "password": "wrong password!!"})
    return f"""<!doctype html><html><body><script>
    (async () => {{
      document.cookie = "{BROWSER_COOKIE}={planted}; Secure; Path=/; SameSite=Strict";
      const sent = {{mode: "no-cors", credentials: "include"}};
      for (let i = 0; i < 4; i++) {{
        await fetch("{server.base}/oauth/login", {{...sent, method: "POST", body: new URLSearchParams({wrong})}});
        await fetch("{server.base}/admin/login", {{...sent, method: "POST", body: new URLSearchParams({wrong})}});
      }}
      for (const url of {json.dumps(urls)}) {{
        await fetch(url, sent);
        await fetch(url, {{...sent, method: "HEAD"}});
      }}
      window.done = true;
    }})();
    </script></body></html>"""


def _approve_in(page: Any, server: LiveServer, client_id: str, start: Callable[[str], None]) -> dict[str, Any]:
    """Log in with the right password at once and approve; `start(url)` opens /authorize. The tokens."""
    verifier, challenge = pkce()
    seen = catch_callback(page)
    start(authorize_url(server, client_id, challenge))
    page.wait_for_url("**/oauth/login?*")
    page.fill("input[name=password]", PASSWORD)
    with page.expect_response(lambda r: r.url.endswith("/oauth/login") and r.request.method == "POST") as answer:
        page.click("button[type=submit]")
    assert answer.value.status == 303, page.content()
    page.wait_for_url("**/oauth/consent?*")
    page.click("button[value=approve]")
    page.wait_for_url(f"{CALLBACK}*")
    return redeem_code(server, seen[-1], verifier, client_id, CALLBACK)


def restarted(chromium: Any, before: Any) -> Any:
    """The same browser after a restart: a new context with only the persistent cookies of `before`."""
    context = chromium.new_context()
    kept = [cookie for cookie in before.cookies() if cookie["expires"] > 0]
    if kept:
        context.add_cookies(kept)
    before.close()
    return context


def _browser_cookie(context: Any) -> str | None:
    values = [c["value"] for c in context.cookies() if c["name"] == BROWSER_COOKIE]
    return values[0] if values else None


def _watch(page: Any, server: LiveServer) -> list[tuple[str, str, int]]:
    """Every answer bastion gives to the page's requests: (method, URL, status)."""
    answered: list[tuple[str, str, int]] = []

    def seen(response: Any) -> None:
        if response.url.startswith(server.base):
            answered.append((response.request.method, response.url, response.status))

    page.on("response", seen)
    return answered


@BROWSER_ONLY
def test_preview_page_on_another_port_cannot_lock_the_administrator_out(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """The attack (Chromium): the administrator logged in once (device cookie, 30 days) and restarted the
    browser, then opens a page on another port of 127.0.0.1. Its script plants the browser cookie of the
    attacker's own /authorize transaction, posts wrong passwords to /oauth/login and /admin/login (fetch,
    no-cors) and fetches /authorize for the attacker's clients. Before, each password counted against the
    administrator's device (back-off up to 900 s) and each /authorize filled its pending requests: the
    right password got 429 for minutes. Invariant: every one of those requests is refused (403) before
    anything counts it; the administrator then logs in with the right password at once and authorizes a
    new client, and again from a link on a same-site page (the MCP Inspector's way); claude.ai- and Claude
    Code-shaped clients connect. Once the flow has set the browser cookie it outlasts a restart, so a
    script can no longer plant one (a script cannot overwrite an HttpOnly cookie)."""
    with start_server(http_extra=TIGHT) as server, launch() as chromium:
        attacker_clients = [server.register(client_name=f"attacker {n}")["client_id"] for n in range(3)]
        attacker = Browser(server)
        _, challenge = pkce()
        login = attacker.open(attacker.authorize_url(attacker_clients[0], challenge))
        assert login.status_code == 200, login.text
        fields, planted = forms(login.text)[0]["fields"], attacker.cookies[BROWSER_COOKIE]
        attacker.close()
        urls = [authorize_url(server, client, challenge) for client in attacker_clients]
        first = chromium.new_context()
        admin = first.new_page()
        admin_login(admin, server.base)
        context = restarted(chromium, first)
        try:
            assert DEVICE_COOKIE in {c["name"] for c in context.cookies(server.base)}
            with page_on_another_port(lockout_script(server, planted, fields, urls)) as evil_url:
                evil = context.new_page()
                answered = _watch(evil, server)
                evil.goto(evil_url)
                evil.wait_for_function("window.done === true", timeout=30_000)
                evil.close()
            assert _browser_cookie(context) == planted, "the page planted the cookie"
            assert {status for _, _, status in answered} == {403}, answered
            assert sorted({method for method, _, _ in answered}) == ["GET", "HEAD", "POST"], answered
            assert len(answered) == 8 + 2 * len(urls), answered
            # What still works, at once: the administrator authorizes a new app in the same browser...
            mine = server.register(client_name="administrator's app")["client_id"]
            admin = context.new_page()
            assert _approve_in(admin, server, mine, admin.goto)["scope"] == "organizer"
            # ...and one started from a link on a same-site page (the MCP Inspector on another port).
            inspector = server.register(client_name="inspector")["client_id"]
            page = context.new_page()

            def follow_link(url: str) -> None:
                with page_on_another_port(f'<a id="go" href="{url}">connect</a>') as inspector_url:
                    page.goto(inspector_url)
                    page.click("#go")
                    page.wait_for_url("**/oauth/login?*")

            assert _approve_in(page, server, inspector, follow_link)["scope"] == "organizer"
            # After another restart the flow's cookie is still there, and a script cannot replace it.
            mine_now = _browser_cookie(context)
            assert mine_now not in (None, planted)
            context = restarted(chromium, context)
            assert _browser_cookie(context) == mine_now
            with page_on_another_port(lockout_script(server, planted, fields, [])) as evil_url:
                evil = context.new_page()
                evil.goto(evil_url)
                evil.wait_for_function("window.done === true", timeout=30_000)
            assert _browser_cookie(context) == mine_now
        finally:
            context.close()
        assert "backing off" not in server.log()
        assert_clients_connect(server)


def test_login_steps_refuse_what_another_page_sends_before_counting_it(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """The same attack's requests, each as a browser labels it (Fetch Metadata), from the administrator's
    address: wrong passwords posted by a same-site or cross-site page (fetch, or a form it submits), and
    /authorize, login and consent pages fetched, framed or embedded. Invariant: each is 403 with one line
    saying why, and none is counted: with one failure enough to back off and one pending request per
    address, the administrator's own login (a same-origin form) then succeeds and their own navigation to
    /authorize (cross-site, as claude.ai sends it) opens a login page. The browser cookie lasts as long as
    the device cookie (a script cannot overwrite an HttpOnly cookie: while it lasts, none can be planted)."""
    with start_server(http_extra=TIGHT.replace("= 3", "= 1")) as server:
        first, second = (server.register(client_name=name)["client_id"] for name in ("first", "second"))
        admin = Browser(server)
        _, challenge = pkce()
        started = admin.client.get(admin.authorize_url(first, challenge))
        assert started.status_code == 303
        assert f"max-age={DEVICE_LIFETIME_S}" in started.headers["set-cookie"].lower()
        login = admin.open(started.headers["location"])
        wrong = {**forms(login.text)[0]["fields"], "password": "wrong password!!"}
        txn = wrong["txn"]
        for site in ("same-site", "cross-site"):
            for mode, dest in (("no-cors", "empty"), ("navigate", "document"), ("navigate", "iframe")):
                labels = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": mode, "Sec-Fetch-Dest": dest}
                for path in ("/oauth/login", "/admin/login", "/oauth/consent"):
                    refused = admin.client.post(path, data=wrong, headers=labels)
                    assert refused.status_code == 403, (path, labels, refused.text)
                    assert html.escape(NOT_OUR_FORM) in refused.text
        pages = [admin.authorize_url(second, challenge), f"/oauth/login?txn={txn}", f"/oauth/consent?txn={txn}"]
        pages.append("/admin/login")
        for mode, dest in (("no-cors", "empty"), ("cors", "empty"), ("navigate", "iframe"), ("no-cors", "image")):
            labels = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": mode, "Sec-Fetch-Dest": dest}
            for url in pages:
                for method in ("GET", "HEAD"):
                    refused = admin.client.request(method, url, headers=labels)
                    assert refused.status_code == 403, (method, url, labels)
                    assert method == "HEAD" or html.escape(NOT_A_NAVIGATION) in refused.text
        # Nothing was counted: the right password, from bastion's own page, logs in at once.
        own_form = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
        logged_in = admin.client.post("/oauth/login", data={**wrong, "password": PASSWORD}, headers=own_form)
        assert logged_in.status_code == 303, logged_in.text
        consent = admin.open(logged_in.headers["location"])
        decided = admin.consent(consent)
        assert decided.status_code == 303
        assert "code=" in decided.headers["location"]
        # No pending request was made for `second`: the navigation opens a login page.
        navigation = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
        opened = admin.client.get(admin.authorize_url(second, challenge), headers=navigation)
        assert opened.status_code == 303, opened.text
        assert opened.headers["location"].startswith("/oauth/login?")
        admin.close()
        assert "backing off" not in server.log()
        assert_clients_connect(server)


@BROWSER_ONLY
def test_preview_page_with_one_click_cannot_fill_pending_requests_through_its_popup(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Attack (a review of the Fetch Metadata guard, Chromium): a page on another port of the host gets one
    click, opens a popup and keeps its handle, then sets the popup's location to /authorize again and again.
    Each is a real top-level navigation (the browser even marks those within 5 s of the click as the user's),
    so each added a pending request against the administrator's device until its cap (3 here) refused the
    administrator's own: 429 for 10 minutes. Invariant: navigations that pages of this host start count
    apart (`Sec-Fetch-Site: same-site`), so after the attack the administrator's own navigation (a client
    opening the browser) opens the login page at once and the client is authorized. A same-site page's own
    Connect button (the MCP Inspector's way: a fetch, then a navigation) works before the attack; after it,
    such pages share what the attacker filled (for up to 10 minutes)."""
    with start_server(http_extra=TIGHT) as server, launch() as chromium:
        attackers = [server.register(client_name=f"attacker {n}")["client_id"] for n in range(5)]
        _, challenge = pkce()
        urls = [authorize_url(server, client, challenge) for client in attackers]
        popup_script = f"""<button id="b">preview</button><script>
        document.getElementById("b").onclick = async () => {{
          const popup = window.open("about:blank", "x");
          for (const url of {json.dumps(urls)}) {{
            popup.location = url;
            await new Promise((done) => setTimeout(done, 300));
          }}
          window.done = true;
        }};</script>"""
        inspector = server.register(client_name="inspector")["client_id"]
        metadata = json.dumps(server.base + "/.well-known/oauth-authorization-server")
        context = chromium.new_context()
        try:
            page = context.new_page()

            def click_connect(url: str) -> None:
                connect_script = f"""<button id="c">connect</button><script>
                document.getElementById("c").onclick = async () => {{
                  await fetch({metadata}, {{mode: "no-cors"}});
                  window.location.href = {json.dumps(url)};
                }};</script>"""
                with page_on_another_port(connect_script) as inspector_url:
                    page.goto(inspector_url)
                    page.click("#c")
                    page.wait_for_url("**/oauth/login?*")

            assert _approve_in(page, server, inspector, click_connect)["scope"] == "organizer"
            answered: list[int] = []
            context.on(
                "response",
                lambda response: (
                    answered.append(response.status) if response.url.startswith(f"{server.base}/authorize") else None
                ),
            )
            with page_on_another_port(popup_script) as evil_url:
                evil = context.new_page()
                evil.goto(evil_url)
                evil.click("#b")
                evil.wait_for_function("window.done === true", timeout=30_000)
            assert 429 in answered, answered  # the popup's navigations filled the same-site share...
            mine = server.register(client_name="administrator's app")["client_id"]
            admin = context.new_page()
            assert _approve_in(admin, server, mine, admin.goto)["scope"] == "organizer"  # ...and only that
        finally:
            context.close()
        assert_clients_connect(server)


def _access_lines(server: LiveServer, request: str, status: int, count: int) -> list[str]:
    """The access log's lines for `request` (e.g. "GET /authorize") with `status`, once there are `count`
    of them (a prefetch is the browser's to make: it is waited for, up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in server.log().splitlines() if f" {request} {status} " in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@BROWSER_ONLY
def test_preview_page_speculation_rules_prefetch_nothing_with_the_administrators_cookies(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Attack (Chromium, prefetch_authorize.py and prefetch_loop.py): a page on another port lists twelve
    /authorize URLs and ten dashboard pages in `<script type="speculationrules">`. With no click, Chromium
    prefetched each as the administrator's own navigation (`Sec-Fetch-Site: none`) with their SameSite=Strict
    cookies: the twelve filled the device's pending requests (the administrator's next /authorize got 429)
    and the dashboard pages were rendered with their session. Invariant: every prefetch is refused (403,
    `Sec-Purpose: prefetch`) before anything counts it; the administrator then opens /authorize and logs in."""
    with start_server() as server, launch() as chromium:
        attackers = [server.register(client_name=f"attacker {n}")["client_id"] for n in range(12)]
        _, challenge = pkce()
        urls = [authorize_url(server, client, challenge) for client in attackers]
        urls += [f"{server.base}/admin/audit?n={n}" for n in range(10)]
        rules = json.dumps({"prefetch": [{"source": "list", "urls": urls, "eagerness": "immediate"}]})
        context = chromium.new_context()
        try:
            admin = context.new_page()
            admin_login(admin, server.base)
            page = f'<!doctype html><p>a preview</p><script type="speculationrules">{rules}</script>'
            with page_on_another_port(page) as evil_url:
                context.new_page().goto(evil_url)
                refused = _access_lines(server, "GET /authorize", 403, 12)
                assert len(refused) == 12, server.log()
                assert len(_access_lines(server, "GET /admin/audit", 403, 10)) == 10, server.log()
            assert not [line for line in server.log().splitlines() if " GET /admin/audit 200 " in line]
            mine = server.register(client_name="administrator's app")["client_id"]
            fresh = context.new_page()
            assert _approve_in(fresh, server, mine, fresh.goto)["scope"] == "organizer"
        finally:
            context.close()
