"""Issue 20, login attacks from the administrator's own address, against a live `bastion serve --http`.

An attacker on the same host shares 127.0.0.1 with the administrator's browser, so per-address limits
alone cannot tell them apart: the attacker's wrong passwords back the address off and its check in
flight refuses the next one from that address. What this proves: a browser that has logged in before
(it holds a device cookie, `bastion.transports.http.devices`) still logs in at once, on /oauth/login and
/admin/login, while that address is backed off and while other addresses flood the shared check slot;
a forged, tampered or old-password device cookie buys nothing; a non-ASCII CSRF token is refused with
403 (it was a 500 with a traceback). What it does not prove: a first login from a new browser during a
same-host flood (that browser has no device cookie: it waits like the attacker).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx2

from bastion.tools.server import SCOPES
from bastion.transports.http.password import write_hash
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .clients import CLAUDE_AI, CLAUDE_CODE
from .live import PASSWORD, Browser, LiveServer, callback_params, forms, pkce

DEVICE_COOKIE = "__Host-bastion-device"
BROWSER_COOKIE = "__Host-bastion-browser"


def admin_login(browser: Browser, password: str = PASSWORD) -> httpx2.Response:
    page = browser.open("/admin/login")
    assert page.status_code == 200, page.text
    return browser.login(page, password)


def oauth_login(server: LiveServer, browser: Browser, password: str = PASSWORD) -> httpx2.Response:
    client_id = server.register(client_name="administrator's app")["client_id"]
    _, challenge = pkce()
    page = browser.open(browser.authorize_url(client_id, challenge))
    assert page.status_code == 200, page.text
    return browser.login(page, password)


def connect_in(server: LiveServer, browser: Browser, metadata: dict[str, Any], scope: str) -> str:
    """A claude.ai- or Claude Code-shaped client registers and is approved in `browser` (as the page
    ticks it), redeems its code and opens an MCP session: the scope granted."""
    callback = metadata["redirect_uris"][0]
    client = server.register(**metadata)
    verifier, challenge = pkce()
    url = browser.authorize_url(client["client_id"], challenge, redirect_uri=callback, scope=scope or "<omit>")
    after = browser.login(browser.open(url))
    assert after.status_code == 303, after.text
    consent = browser.open(after.headers["location"])
    ticked = [s for s in SCOPES if f'value="{s}" checked' in consent.text]
    location = browser.consent(consent, scopes=ticked).headers["location"]
    assert location.startswith(callback + "?"), location
    form = {
        "grant_type": "authorization_code",
        "code": callback_params(location)["code"][0],
        "code_verifier": verifier,
        "client_id": client["client_id"],
        "redirect_uri": callback,
        **({"client_secret": client["client_secret"]} if "client_secret" in client else {}),
    }
    with server.http() as raw:
        tokens = raw.post("/token", data=form)
        assert tokens.status_code == 200, tokens.text
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {tokens.json()['access_token']}"}
        assert raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer).status_code == 200
    granted: str = tokens.json()["scope"]
    return granted


def back_off_the_address(server: LiveServer, attacker: Browser) -> None:
    """Wrong passwords from 127.0.0.1, one after another, until the address must wait."""
    page = attacker.open("/admin/login")
    for _ in range(10):
        status = attacker.login(page, "not the password").status_code
        if status == 429:
            return
        assert status == 401
    raise AssertionError("the address never backed off")


async def _flood(
    server: LiveServer, fields: dict[str, str], cookie: str, stop: asyncio.Event, statuses: Counter[int]
) -> None:
    """Wrong passwords from ever new addresses, 16 at a time, until `stop`: the shared check slot is
    never free for long."""
    addresses = itertools.count()
    limits = httpx2.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx2.AsyncClient(base_url=server.base, timeout=60, limits=limits) as client:

        async def worker() -> None:
            while not stop.is_set():
                n = next(addresses)
                headers = {"X-Forwarded-For": f"10.{n // 62500}.{n // 250 % 250}.{n % 250 + 1}"}
                headers["Cookie"] = f"{BROWSER_COOKIE}={cookie}"
                response = await client.post("/admin/login", data={**fields, "password": "wrong"}, headers=headers)
                statuses[response.status_code] += 1

        await asyncio.gather(*(worker() for _ in range(16)))


def test_same_host_login_flood_does_not_lock_out_a_browser_that_logged_in_before(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """The administrator logged in once (the browser holds a device cookie). An attacker on the same host
    then backs 127.0.0.1 off with wrong passwords: the attacker, even with the right password, now gets
    429 from that address (before this, so did the administrator, for up to 15 minutes). The
    administrator's browser, from the same address, logs in on /oauth/login and /admin/login within 5 s."""
    with start_server(cheap_hash=True, http_extra="global_login_failures_per_minute = 3") as server:
        admin = Browser(server)
        attacker = Browser(server)
        try:
            assert admin_login(admin).status_code == 303
            assert DEVICE_COOKIE in admin.cookies
            back_off_the_address(server, attacker)
            assert admin_login(attacker).status_code == 429  # the address waits, right password or not
            started = time.monotonic()
            assert oauth_login(server, admin).status_code == 303
            assert admin_login(admin).status_code == 303
            assert time.monotonic() - started < 5.0
            assert admin_login(attacker).status_code == 429  # the address still waits
            # claude.ai- and Claude Code-shaped clients, approved in that browser, connect.
            assert connect_in(server, admin, CLAUDE_AI, "claudeai") == "organizer"
            assert connect_in(server, admin, CLAUDE_CODE, "") == "organizer"
        finally:
            admin.close()
            attacker.close()
        assert "Traceback" not in server.log()


def test_login_flood_from_many_addresses_leaves_a_check_for_a_known_browser(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Wrong passwords from ever new addresses, 16 at a time, while the administrator's browser (device
    cookie) logs in: the flood shares one argon2 slot (the rest wait in a bounded line, or get 503), the
    other is kept for known browsers, so the administrator's login is checked at once, every time (before: both
    slots were the flood's and the administrator got 503 "busy")."""
    with start_proxied_server() as server:
        admin = Browser(server)
        try:
            assert admin_login(admin).status_code == 303
            flooder = Browser(server)
            page = flooder.open("/admin/login")
            fields, cookie = forms(page.text)[0]["fields"], flooder.cookies[BROWSER_COOKIE]
            flooder.close()

            statuses: Counter[int] = Counter()

            async def during_the_flood() -> list[int]:
                stop = asyncio.Event()
                flood = asyncio.create_task(_flood(server, fields, cookie, stop, statuses))
                deadline = time.monotonic() + 30
                while statuses[401] < 5 and time.monotonic() < deadline:  # the shared slot is taken
                    await asyncio.sleep(0.01)
                answers = [(await asyncio.to_thread(admin_login, admin)).status_code for _ in range(5)]
                stop.set()
                await flood
                return answers

            assert asyncio.run(during_the_flood()) == [303] * 5
            assert set(statuses) <= {401, 503}, statuses
            assert statuses[401] >= 5, statuses
        finally:
            admin.close()
        assert "Traceback" not in server.log()


def test_forged_or_stale_device_cookie_buys_nothing(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """With 127.0.0.1 backed off, a made-up device cookie, the administrator's with its signature altered,
    and the administrator's after the password changed all count as that address: 429."""
    with start_server(cheap_hash=True, http_extra="global_login_failures_per_minute = 3") as server:
        admin = Browser(server)
        attacker = Browser(server)
        try:
            assert admin_login(admin).status_code == 303
            genuine = admin.cookies[DEVICE_COOKIE]
            back_off_the_address(server, attacker)
            payload, _, mac = genuine.rpartition(".")
            for forged in ("x", f"{payload}.{mac[:-2]}AA", f"other.{payload.split('.')[1]}.{mac}", genuine + "A"):
                attacker.cookies[DEVICE_COOKIE] = forged
                assert admin_login(attacker).status_code == 429, forged
            attacker.cookies[DEVICE_COOKIE] = genuine  # a stolen genuine one does work: it is a login's proof
            assert admin_login(attacker, "wrong password again").status_code == 401
            write_hash(server.root / "state" / "admin-password.argon2", PASSWORD + " 2")
            assert admin_login(admin, PASSWORD + " 2").status_code == 429  # the old password's cookie
        finally:
            admin.close()
            attacker.close()


def test_non_ascii_csrf_token_is_refused_not_a_server_error(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """A CSRF field with non-ASCII text made the constant-time comparison raise (500, a traceback in the
    log) on /oauth/login, /oauth/consent, /admin/login and every admin POST. Now each is a 403 that says
    the form is not valid, and the administrator then logs in."""
    with start_server(cheap_hash=True) as server:
        browser = Browser(server)
        try:
            client_id = server.register()["client_id"]
            _, challenge = pkce()
            login = browser.open(browser.authorize_url(client_id, challenge))
            fields = forms(login.text)[0]["fields"]
            hostile = {**fields, "csrf": "\u00e9t\u00e9", "password": PASSWORD}
            assert browser.client.post("/oauth/login", data=hostile).status_code == 403
            assert browser.client.post("/oauth/consent", data={**hostile, "decision": "approve"}).status_code == 403
            browser.open("/admin/login")
            assert browser.client.post("/admin/login", data={"csrf": "\u00e9", "password": PASSWORD}).status_code == 403
            assert admin_login(browser).status_code == 303
            revoke = browser.client.post("/admin/revoke", data={"csrf": "\u00e9", "grant": "*"})
            assert revoke.status_code == 403
            assert "not valid for this browser" in revoke.text
            assert browser.open("/admin").status_code == 200  # the session is still there
        finally:
            browser.close()
        assert "Traceback" not in server.log()


def test_same_host_process_cannot_claim_other_addresses_with_forwarded_headers(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """uvicorn believes X-Forwarded-For from 127.0.0.1 by default, so a process on the same host could
    claim a new address per request and walk through every per-address limit. With no `trusted_proxies`
    configured (the default) the headers are ignored: registrations and logins with a fresh forged
    address each are all counted against 127.0.0.1, and the quota and back-off hold."""
    extra = "registrations_per_ip_per_hour = 3\nlogin_failures_before_backoff = 2"
    with start_server(cheap_hash=True, http_extra=extra) as server, server.http() as raw:
        statuses = [
            raw.post(
                "/register",
                json=CLAUDE_CODE,
                headers={"X-Forwarded-For": f"198.51.100.{n}", "X-Forwarded-Proto": "https"},
            ).status_code
            for n in range(1, 6)
        ]
        assert statuses == [201, 201, 201, 429, 429]
        attacker = Browser(server)
        try:
            page = attacker.open("/admin/login")
            fields, cookie = forms(page.text)[0]["fields"], attacker.cookies[BROWSER_COOKIE]
            logins = []
            for n in range(1, 5):
                headers = {"X-Forwarded-For": f"203.0.113.{n}", "Cookie": f"{BROWSER_COOKIE}={cookie}"}
                response = raw.post("/admin/login", data={**fields, "password": "wrong"}, headers=headers)
                logins.append(response.status_code)
        finally:
            attacker.close()
        assert logins[:2] == [401, 401]
        assert set(logins[2:]) == {429}  # 127.0.0.1 backed off: the forged addresses bought nothing
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0] == 3
        assert "Traceback" not in server.log()


PREFETCH = {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}


def test_prefetches_a_page_asks_for_are_refused_before_anything_counts(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Attack (prefetch_authorize.py, prefetch_loop.py): a page on another port of this host lists /authorize
    URLs, or dashboard pages, in speculation rules. Chromium prefetches them as if the administrator had
    opened them (`Sec-Fetch-Site: none`, a document navigation) with the SameSite=Strict cookies, marked only
    by `Sec-Purpose: prefetch`: twelve filled the administrator's pending requests with no click (their next
    /authorize got 429), and a loop had the server render 584 audit pages in 15 s. Invariant: each such
    request (any browser's purpose header) is 403 before a limit counts it or a page is made; afterwards the
    administrator's own /authorize opens the login page and the dashboard still shows."""
    with start_server(cheap_hash=True) as server:
        admin = Browser(server)
        try:
            assert admin_login(admin).status_code == 303
            client_id = server.register(client_name="attacker")["client_id"]
            _, challenge = pkce()
            url = admin.authorize_url(client_id, challenge)
            purposes = [
                {"Sec-Purpose": "prefetch"},
                {"Sec-Purpose": "prefetch;prerender"},
                {"Purpose": "prefetch"},
                {"X-Purpose": "preview"},
                {"X-Moz": "prefetch"},
            ]
            for purpose in purposes * 8:  # 40: past the 10 pending requests and the 30 a minute
                for path in (url, "/oauth/login", "/admin/login", "/admin/audit", "/admin/sandboxes"):
                    refused = admin.client.get(path, headers={**PREFETCH, **purpose})
                    assert refused.status_code == 403, (path, purpose, refused.status_code)
            mine = server.register(client_name="administrator's app")["client_id"]
            opened = admin.open(admin.authorize_url(mine, challenge))
            assert opened.status_code == 200, opened.text
            assert "Log in to decide on the request of" in opened.text
            assert admin.client.get("/admin/audit", headers=PREFETCH).status_code == 200
        finally:
            admin.close()
        assert "Traceback" not in server.log()
