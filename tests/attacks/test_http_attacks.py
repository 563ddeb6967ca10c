"""The attack corpus entries aimed at the HTTP transport and OAuth, replayed against a live server.

Entries whose tool is `http.post /mcp`, `oauth.*` or `mcp_client.discovery`. What this proves: each is
refused by `bastion serve --http` on loopback (DNS rebinding, session ids without a token, unsigned
JWTs, redirect-URI tricks, PKCE downgrades, wrong verifiers, state tampering, consent riding, rotated
refresh tokens, dangerous redirect schemes). The two `mcp_client.discovery` entries attack MCP
*clients* that trust a server's discovery documents; bastion is a server that does no outbound
discovery (the one URL it fetches for a client, a client metadata document, goes through the SSRF
guard tested in tests/transports/http/test_cimd.py), so the test checks that its own documents only name its
own origin. What it does not prove: resistance to attacks not in the corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS
from tests.transports.http.live import (
    LOOPBACK_CB_FOR_TESTS,
    PASSWORD,
    Browser,
    LiveServer,
    callback_params,
    forms,
    get_tokens,
    live_server,
    pkce,
)

CORPUS: list[dict[str, Any]] = json.loads(Path(__file__).with_name("attack-corpus.json").read_text(encoding="utf-8"))
IN_SCOPE = {
    e["id"]: e for e in CORPUS if e["tool"] == "http.post /mcp" or e["tool"].startswith(("oauth.", "mcp_client."))
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(
        tmp_path_factory.mktemp("attacks") / "demo", http_extra="registrations_per_ip_per_hour = 1000"
    ) as live:
        yield live


@pytest.fixture
def raw(server: LiveServer) -> Iterator[httpx2.Client]:
    with server.http() as client:
        yield client


def test_every_http_entry_is_covered() -> None:
    assert set(IN_SCOPE) == set(COVERED)


def _rebinding(server: LiveServer, raw: httpx2.Client, entry: dict[str, Any]) -> None:
    headers = {**MCP_HEADERS, **entry["input"]["headers"]}
    headers["Host"] = (
        headers["Host"].replace(":8000", f":{server.port}") if "127.0.0.1" in headers["Host"] else headers["Host"]
    )
    tokens = get_tokens(server, server.register()["client_id"])
    body = entry["input"].get("body", INITIALIZE_REQUEST)
    response = raw.post("/mcp", json=body, headers={**headers, "Authorization": f"Bearer {tokens['access_token']}"})
    assert response.status_code in (403, 421), response.text  # refused even with a valid token


def test_a136_dns_rebinding_host(server: LiveServer, raw: httpx2.Client) -> None:
    _rebinding(server, raw, IN_SCOPE["A136"])


def test_a137_dns_rebinding_origin(server: LiveServer, raw: httpx2.Client) -> None:
    _rebinding(server, raw, IN_SCOPE["A137"])


def test_a139_session_id_is_not_authentication(server: LiveServer, raw: httpx2.Client) -> None:
    tokens = get_tokens(server, server.register()["client_id"])
    opened = raw.post(
        "/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
    )
    session = opened.headers["mcp-session-id"]
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    stolen = raw.post("/mcp", json=ping, headers={**MCP_HEADERS, "Mcp-Session-Id": session})
    assert stolen.status_code == 401


def test_a140_redirect_uri_suffix_trick(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = server.register(redirect_uris=["https://client.example.com/cb"])["client_id"]
    _, challenge = pkce()
    entry = IN_SCOPE["A140"]["input"]
    response = raw.get(
        "/authorize",
        params={**entry, "client_id": client_id, "code_challenge": challenge, "response_type": "code"},
    )
    assert response.status_code == 400
    assert "location" not in response.headers


@pytest.mark.parametrize("entry_id", ["A142", "A143"])
def test_a142_a143_pkce_missing_or_plain(server: LiveServer, raw: httpx2.Client, entry_id: str) -> None:
    client_id = server.register(redirect_uris=["https://client.example.com/cb"])["client_id"]
    params = {**IN_SCOPE[entry_id]["input"], "client_id": client_id, "response_type": "code"}
    response = raw.get("/authorize", params=params)
    assert response.status_code == 400
    assert "location" not in response.headers


def test_a145_wrong_verifier(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = server.register()["client_id"]
    _, challenge = pkce()
    browser = Browser(server)
    try:
        code = callback_params(browser.approve(browser.authorize_url(client_id, challenge)))["code"][0]
    finally:
        browser.close()
    wrong, _ = pkce()
    data = {
        "grant_type": "authorization_code",
        "code": code,
        "code_verifier": wrong,
        "client_id": client_id,
        "redirect_uri": LOOPBACK_CB_FOR_TESTS,
    }
    response = raw.post("/token", data=data)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


def test_a146_state_is_returned_untouched_and_transactions_are_bound(server: LiveServer) -> None:
    """The AS echoes the client's state byte for byte (the client checks it); a consent POST whose
    transaction does not belong to this browser is refused, so a mismatched callback cannot be minted."""
    client_id = server.register()["client_id"]
    _, challenge = pkce()
    victim, attacker = Browser(server), Browser(server)
    try:
        location = victim.approve(victim.authorize_url(client_id, challenge, state="exact-state"))
        assert callback_params(location)["state"] == ["exact-state"]
        login = victim.open(victim.authorize_url(client_id, challenge, state="s2"))
        fields = forms(login.text)[0]["fields"]
        assert attacker.client.post("/oauth/login", data={**fields, "password": PASSWORD}).status_code == 403
    finally:
        victim.close()
        attacker.close()


def test_a148_unsigned_jwt_is_not_a_token(server: LiveServer, raw: httpx2.Client) -> None:
    headers = {**MCP_HEADERS, **IN_SCOPE["A148"]["input"]["headers"]}
    assert raw.post("/mcp", json=INITIALIZE_REQUEST, headers=headers).status_code == 401


def test_a149_javascript_redirect_uri(raw: httpx2.Client) -> None:
    response = raw.post("/register", json=IN_SCOPE["A149"]["input"])
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_redirect_uri"


def test_a151_consent_does_not_carry_over_to_a_new_client(server: LiveServer) -> None:
    """The browser approved client A; client B's request still needs the password and its own consent."""
    first = server.register(client_name="first")["client_id"]
    second = server.register(client_name="second")["client_id"]
    _, challenge = pkce()
    browser = Browser(server)
    try:
        browser.approve(browser.authorize_url(first, challenge))
        page = browser.open(browser.authorize_url(second, challenge))
        assert page.status_code == 200
        assert 'name="password"' in page.text
        fields = forms(page.text)[0]["fields"]
        consent = browser.client.get(f"/oauth/consent?txn={fields['txn']}")
        assert consent.status_code == 303  # not logged in for this transaction: back to the login page
        assert consent.headers["location"].startswith("/oauth/login")
    finally:
        browser.close()


def test_a152_rotated_refresh_token_is_refused(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = server.register()["client_id"]
    tokens = get_tokens(server, client_id)
    data = {"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"], "client_id": client_id}
    assert raw.post("/token", data=data).status_code == 200
    with server.db() as db:  # past the 10 s grace window for two sessions refreshing at once
        db.execute("UPDATE oauth_tokens SET used_at = used_at - 11 WHERE used_at IS NOT NULL")
    again = raw.post("/token", data=data)
    assert again.status_code == 400
    assert again.json()["error"] == "invalid_grant"


@pytest.mark.parametrize("entry_id", ["A154", "A155"])
def test_a154_a155_discovery_documents_name_only_our_origin(
    server: LiveServer, raw: httpx2.Client, entry_id: str
) -> None:
    assert entry_id in IN_SCOPE
    documents = [
        raw.get("/.well-known/oauth-authorization-server").json(),
        raw.get("/.well-known/oauth-protected-resource/mcp").json(),
    ]
    urls = [v for doc in documents for v in doc.values() if isinstance(v, str) and "://" in v]
    urls += [v for doc in documents for v in doc.get("authorization_servers", [])]
    assert urls
    assert all(url.startswith(server.base) for url in urls)
    challenge = raw.post("/mcp", json=INITIALIZE_REQUEST, headers=MCP_HEADERS).headers["www-authenticate"]
    assert f'resource_metadata="{server.base}/' in challenge


COVERED = {
    "A136",
    "A137",
    "A139",
    "A140",
    "A142",
    "A143",
    "A145",
    "A146",
    "A148",
    "A149",
    "A151",
    "A152",
    "A154",
    "A155",
}
