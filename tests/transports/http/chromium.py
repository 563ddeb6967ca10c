"""Real headless Chromium for the login and consent flows: the browser, and the client's part of the dance."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2

from .live import PASSWORD, LiveServer

CHROMIUM = shutil.which("chromium")
CALLBACK = "http://127.0.0.1/callback"
BROWSER_COOKIE = "__Host-bastion-browser"


@contextmanager
def launch() -> Iterator[Any]:
    """One headless Chromium (Debian's), closed at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def authorize_url(server: LiveServer, client_id: str, challenge: str, **extra: str) -> str:
    """Where an app sends the browser to start: PKCE S256, the callback, the MCP URL as resource."""
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": CALLBACK,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "browser-state",
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


def admin_login(page: Any, base: str) -> None:
    """Log `page` in to the admin pages at `base` with the right password, as the administrator does."""
    page.goto(f"{base}/admin/login")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin")
