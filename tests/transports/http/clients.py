"""What must still work after an attack: claude.ai- and Claude Code-shaped clients register and connect.

Each client registers the metadata those apps send (claude.ai: its https callback, a client secret, the
unknown scope `claudeai`; Claude Code: a loopback callback on a port, a public client, no scope), goes
through the administrator's login and consent, redeems its code with PKCE, and opens an MCP session.
"""

from __future__ import annotations

from typing import Any

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .live import Browser, LiveServer, callback_params, pkce

CLAUDE_AI_CALLBACK = "https://claude.ai/api/mcp/auth_callback"
CLAUDE_CODE_CALLBACK = "http://localhost:53682/callback"

CLAUDE_AI: dict[str, Any] = {
    "client_name": "Claude",
    "redirect_uris": [CLAUDE_AI_CALLBACK],
    "grant_types": ["authorization_code", "refresh_token"],
    "response_types": ["code"],
    "token_endpoint_auth_method": "client_secret_post",
    "scope": "claudeai",
}
CLAUDE_CODE: dict[str, Any] = {
    "client_name": "Claude Code (bastion)",
    "redirect_uris": [CLAUDE_CODE_CALLBACK],
    "grant_types": ["authorization_code", "refresh_token"],
    "response_types": ["code"],
    "token_endpoint_auth_method": "none",
}
# The least a public client registers: what registration floods are made of.
LOOPBACK: dict[str, Any] = {"redirect_uris": ["http://127.0.0.1/callback"], "token_endpoint_auth_method": "none"}


def from_address(address: str) -> dict[str, str]:
    """Headers that play another client address (the test servers trust X-Forwarded-For from loopback)."""
    return {"X-Forwarded-For": address}


def connect(
    server: LiveServer, metadata: dict[str, Any], *, scope: str = "", headers: dict[str, str] | None = None
) -> str:
    """Register, log in, consent (to what the page ticks), redeem, initialize: the granted scope."""
    callback = metadata["redirect_uris"][0]
    with server.http() as raw:
        registered = raw.post("/register", json=metadata, headers=headers or {})
    assert registered.status_code == 201, registered.text
    client = registered.json()
    verifier, challenge = pkce()
    browser = Browser(server)
    try:
        extra = {"scope": scope} if scope else {"scope": "<omit>"}
        url = browser.authorize_url(client["client_id"], challenge, redirect_uri=callback, **extra)
        login = browser.open(url)
        assert login.status_code == 200, login.text
        logged_in = browser.login(login)
        assert logged_in.status_code == 303, logged_in.text
        consent = browser.open(logged_in.headers["location"])
        assert consent.status_code == 200, consent.text
        ticked = [s for s in ("workbench", "organizer", "gateway:read", "gateway:deploy") if _ticked(consent.text, s)]
        decided = browser.consent(consent, scopes=ticked)
        assert decided.status_code == 303, decided.text
        location = decided.headers["location"]
    finally:
        browser.close()
    assert location.startswith(callback + "?"), location
    form = {
        "grant_type": "authorization_code",
        "code": callback_params(location)["code"][0],
        "code_verifier": verifier,
        "client_id": client["client_id"],
        "redirect_uri": callback,
    }
    if "client_secret" in client:
        form["client_secret"] = client["client_secret"]
    with server.http() as raw:
        tokens = raw.post("/token", data=form)
        assert tokens.status_code == 200, tokens.text
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {tokens.json()['access_token']}"}
        opened = raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer)
        assert opened.status_code == 200, opened.text
    granted: str = tokens.json()["scope"]
    return granted


def _ticked(page: str, scope: str) -> bool:
    return f'value="{scope}" checked' in page


def assert_clients_connect(server: LiveServer) -> None:
    """claude.ai and Claude Code, as they register, still connect; neither is handed a gateway scope."""
    assert connect(server, CLAUDE_AI, scope="claudeai") == "organizer"
    assert connect(server, CLAUDE_CODE) == "organizer"
