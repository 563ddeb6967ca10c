"""The negative test plan (../shared/oauth-negative-tests.md), each row against a live server on loopback.

Each test is named `test_tNN_...` after its row. What they prove: the server answers each hostile or
malformed request as the plan expects, over real HTTP, against the real `bastion serve --http`. What
they do not prove: behaviour behind a real TLS reverse proxy, or against requests nobody listed.
T-61 (Client ID Metadata Documents and their SSRF guard) is in test_cimd.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx2
import pytest

from bastion.transports.http.endpoints import ROTATIONS_PER_MINUTE
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .live import PASSWORD, Browser, LiveServer, callback_params, forms, get_tokens, pkce

CLAUDE_CB = "https://claude.ai/api/mcp/auth_callback"
LOOPBACK_CB = "http://127.0.0.1/callback"


@pytest.fixture
def raw(server: LiveServer) -> Iterator[httpx2.Client]:
    with server.http() as client:
        yield client


def public_client(server: LiveServer, **extra: Any) -> str:
    client_id: str = server.register(**{"client_name": "pub", **extra})["client_id"]
    return client_id


def confidential_client(server: LiveServer) -> tuple[str, str]:
    info = server.register(
        client_name="conf", redirect_uris=[CLAUDE_CB], token_endpoint_auth_method="client_secret_post"
    )
    return info["client_id"], info["client_secret"]


def tokens_for(server: LiveServer, client_id: str, **kwargs: Any) -> dict[str, Any]:
    return get_tokens(server, client_id, **kwargs)


def code_for(server: LiveServer, client_id: str, challenge: str, redirect_uri: str = LOOPBACK_CB, **params: str) -> str:
    browser = Browser(server)
    try:
        location = browser.approve(browser.authorize_url(client_id, challenge, redirect_uri=redirect_uri, **params))
    finally:
        browser.close()
    return callback_params(location)["code"][0]


def redeem(raw: httpx2.Client, client_id: str, code: str, verifier: str, **extra: str) -> httpx2.Response:
    data = {"grant_type": "authorization_code", "code": code, "code_verifier": verifier, "client_id": client_id}
    data["redirect_uri"] = LOOPBACK_CB
    data.update(extra)
    return raw.post("/token", data={k: v for k, v in data.items() if v is not None})


def refresh(raw: httpx2.Client, client_id: str, token: str, **extra: str) -> httpx2.Response:
    return raw.post(
        "/token", data={"grant_type": "refresh_token", "refresh_token": token, "client_id": client_id, **extra}
    )


def set_password(server: LiveServer, password: str) -> None:
    """`bastion admin set-password`, the password on stdin; it must succeed and never echo it."""
    changed = server.admin("set-password", stdin=password + "\n")
    assert password not in changed.stdout + changed.stderr


def mcp_status(raw: httpx2.Client, token: str) -> int:
    return raw.post(
        "/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": f"Bearer {token}"}
    ).status_code


def assert_challenge(server: LiveServer, response: httpx2.Response) -> str:
    assert response.status_code == 401
    header = response.headers["www-authenticate"]
    assert header.startswith("Bearer ")
    assert f'resource_metadata="{server.base}/.well-known/oauth-protected-resource/mcp"' in header
    assert 'scope="workbench organizer gateway:read gateway:deploy"' in header
    return str(header)


# -- A. resource server and discovery ---------------------------------------------------------------


def test_t01_no_credentials(server: LiveServer, raw: httpx2.Client) -> None:
    header = assert_challenge(server, raw.post("/mcp", json=INITIALIZE_REQUEST, headers=MCP_HEADERS))
    assert "error=" not in header


@pytest.mark.parametrize("value", ["Bearer", "Basic dXNlcjpwYXNz", "Bearer a b", "Bearer " + "x" * 10_000])
def test_t02_malformed_authorization_header(server: LiveServer, raw: httpx2.Client, value: str) -> None:
    assert_challenge(server, raw.post("/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": value}))


def test_t03_unknown_token(server: LiveServer, raw: httpx2.Client) -> None:
    response = raw.post("/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": "Bearer " + "A" * 43})
    assert 'error="invalid_token"' in assert_challenge(server, response)


def test_t04_expired_token_is_401_so_clients_refresh(server: LiveServer, raw: httpx2.Client) -> None:
    tokens = tokens_for(server, public_client(server))
    assert mcp_status(raw, tokens["access_token"]) == 200
    with server.db() as db:
        db.execute("UPDATE oauth_tokens SET expires_at = ? WHERE kind = 'access'", (time.time() - 1,))
    response = raw.post(
        "/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
    )
    assert 'error="invalid_token"' in assert_challenge(server, response)


def test_t05_token_bound_to_another_resource_is_refused(server: LiveServer, raw: httpx2.Client) -> None:
    tokens = tokens_for(server, public_client(server))
    assert mcp_status(raw, tokens["access_token"]) == 200
    with server.db() as db:  # a token this AS minted for another resource, in the same store
        db.execute("UPDATE oauth_grants SET resource = 'https://other.example/mcp' WHERE revoked_at IS NULL")
    try:
        assert mcp_status(raw, tokens["access_token"]) == 401
    finally:
        with server.db() as db:
            db.execute(
                "UPDATE oauth_grants SET resource = ? WHERE resource = 'https://other.example/mcp'", (server.mcp_url,)
            )


def test_t06_revoked_access_token(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    assert raw.post("/revoke", data={"token": tokens["access_token"], "client_id": client_id}).status_code == 200
    assert mcp_status(raw, tokens["access_token"]) == 401


def test_t07_token_in_query_is_ignored(server: LiveServer, raw: httpx2.Client) -> None:
    tokens = tokens_for(server, public_client(server))
    response = raw.post(f"/mcp?access_token={tokens['access_token']}", json=INITIALIZE_REQUEST, headers=MCP_HEADERS)
    assert_challenge(server, response)


def test_t08_insufficient_scope(server: LiveServer, raw: httpx2.Client) -> None:
    tokens = tokens_for(server, public_client(server), scopes=["organizer"])
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "read_file", "arguments": {"path": "x"}},
    }
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}", "Mcp-Protocol-Version": "2026-07-28"}
    response = raw.post("/mcp", json=call, headers=headers)
    assert response.status_code == 403
    header = response.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in header
    assert 'scope="workbench"' in header
    assert f'resource_metadata="{server.base}/.well-known/oauth-protected-resource/mcp"' in header


@pytest.mark.parametrize("method", [b"tools\\/call", b"\\u0074ools/call"])
def test_t08_an_escaped_method_name_gets_the_same_403(server: LiveServer, raw: httpx2.Client, method: bytes) -> None:
    r"""Attack (found by review): "tools\/call" is the same JSON string as "tools/call", but the edge looked
    for the raw bytes and let it through to the inner check, which refused it without the 403 and its
    challenge that names the scope to ask for."""
    tokens = tokens_for(server, public_client(server), scopes=["organizer"])
    body = b'{"jsonrpc":"2.0","id":2,"method":"' + method + b'","params":{"name":"read_file","arguments":{"path":"x"}}}'
    headers = {
        **MCP_HEADERS,
        "Authorization": f"Bearer {tokens['access_token']}",
        "Mcp-Protocol-Version": "2026-07-28",
        "Content-Type": "application/json",
    }
    response = raw.post("/mcp", content=body, headers=headers)
    assert response.status_code == 403
    assert 'error="insufficient_scope"' in response.headers["www-authenticate"]


def test_t09_session_of_one_grant_is_refused_to_another(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    first, second = tokens_for(server, client_id), tokens_for(server, client_id)
    opened = raw.post(
        "/mcp", json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Authorization": f"Bearer {first['access_token']}"}
    )
    assert opened.status_code == 200
    session = opened.headers["mcp-session-id"]
    ping = {"jsonrpc": "2.0", "id": 3, "method": "ping"}
    hijack = {**MCP_HEADERS, "Mcp-Session-Id": session, "Mcp-Protocol-Version": "2025-11-25"}
    assert raw.post("/mcp", json=ping, headers=hijack).status_code == 401
    other = raw.post("/mcp", json=ping, headers={**hijack, "Authorization": f"Bearer {second['access_token']}"})
    assert other.status_code == 404
    own = raw.post("/mcp", json=ping, headers={**hijack, "Authorization": f"Bearer {first['access_token']}"})
    assert own.status_code == 200


@pytest.mark.parametrize("path", ["/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"])
def test_t10_protected_resource_metadata(server: LiveServer, raw: httpx2.Client, path: str) -> None:
    response = raw.get(path, headers={"Authorization": "Bearer nonsense"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert f'"resource":"{server.mcp_url}"' in response.text  # byte-equal, no trailing slash
    assert response.json()["authorization_servers"] == [server.base]


CORS_PATHS = [
    ("/.well-known/oauth-protected-resource/mcp", "GET"),
    ("/.well-known/oauth-authorization-server", "GET"),
    ("/register", "POST"),
    ("/token", "POST"),
    ("/revoke", "POST"),
    ("/mcp", "POST"),
]


@pytest.mark.parametrize(("path", "method"), CORS_PATHS)
def test_t11_cors_where_clients_need_it(raw: httpx2.Client, path: str, method: str) -> None:
    origin = "http://localhost:6274"
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type, mcp-protocol-version",
    }
    response = raw.options(path, headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in ("*", origin)
    assert response.headers.get("access-control-allow-credentials") != "true"
    if path == "/mcp":
        exposed = raw.post(path, json=INITIALIZE_REQUEST, headers={**MCP_HEADERS, "Origin": origin})
        assert exposed.status_code == 401
        names = exposed.headers["access-control-expose-headers"].lower()
        assert "www-authenticate" in names
        assert "mcp-session-id" in names


@pytest.mark.parametrize("path", ["/authorize", "/oauth/login", "/oauth/consent"])
def test_t11_no_cors_on_browser_pages(raw: httpx2.Client, path: str) -> None:
    headers = {"Origin": "http://localhost:6274", "Access-Control-Request-Method": "POST"}
    response = raw.options(path, headers=headers)
    assert "access-control-allow-origin" not in response.headers
    posted = raw.post(path, data={"x": "1"}, headers={"Origin": "http://localhost:6274"})
    assert "access-control-allow-origin" not in posted.headers


# -- B. authorization server metadata ----------------------------------------------------------------


def test_t12_t13_t14_authorization_server_metadata(server: LiveServer, raw: httpx2.Client) -> None:
    meta = raw.get("/.well-known/oauth-authorization-server").json()
    assert meta["issuer"] == server.base
    for key in ("authorization_endpoint", "token_endpoint", "registration_endpoint", "revocation_endpoint"):
        assert meta[key].startswith(server.base + "/")
    assert meta["code_challenge_methods_supported"] == ["S256"]
    assert {"authorization_code", "refresh_token"} <= set(meta["grant_types_supported"])
    assert "none" in meta["token_endpoint_auth_methods_supported"]
    assert meta["response_types_supported"] == ["code"]
    assert meta["authorization_response_iss_parameter_supported"] is True  # and iss is sent: see T-38


def test_t15_no_partial_openid_configuration(raw: httpx2.Client) -> None:
    assert raw.get("/.well-known/openid-configuration").status_code == 404


# -- C. dynamic client registration ------------------------------------------------------------------


def test_t16_missing_redirect_uris(raw: httpx2.Client) -> None:
    response = raw.post("/register", json={})
    assert response.status_code == 400
    assert response.json()["error"] in ("invalid_redirect_uri", "invalid_client_metadata")


@pytest.mark.parametrize(
    "uri",
    [
        "javascript:alert(1)",
        "data:text/html,<script>alert(1)</script>",
        "file:///etc/passwd",
        "http://evil.example/cb",
        "https://x.example/cb#frag",
        "https://*.x.example/cb",
        "https://user@x.example/cb",
    ],
)
def test_t17_dangerous_redirect_uris(raw: httpx2.Client, uri: str) -> None:
    response = raw.post("/register", json={"redirect_uris": [uri], "token_endpoint_auth_method": "none"})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_redirect_uri"


def test_t18_unknown_https_host_is_flagged_on_consent_and_never_auto_redirected(server: LiveServer) -> None:
    client_id = public_client(server, redirect_uris=["https://unknown.example/cb"])
    _, challenge = pkce()
    browser = Browser(server)
    try:
        login = browser.open(browser.authorize_url(client_id, challenge, redirect_uri="https://unknown.example/cb"))
        assert login.status_code == 200  # a login page, not a redirect to unknown.example
        consent = browser.open(browser.login(login).headers["location"])
        assert "Check this address" in consent.text
        assert "https://unknown.example" in consent.text
    finally:
        browser.close()


@pytest.mark.parametrize(
    "metadata",
    [
        {"grant_types": ["password"]},
        {"grant_types": ["client_credentials"]},
        {"grant_types": ["authorization_code", "password"]},
        {"grant_types": ["authorization_code", "urn:ietf:params:oauth:grant-type:jwt-bearer"]},
        {"response_types": ["token"]},
        {"response_types": ["code", "token"]},
    ],
)
def test_t19_grant_and_response_type_abuse(raw: httpx2.Client, metadata: dict[str, Any]) -> None:
    body = {"redirect_uris": [LOOPBACK_CB], "token_endpoint_auth_method": "none", **metadata}
    response = raw.post("/register", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_client_metadata"


def test_t20_oversize_registrations(raw: httpx2.Client) -> None:
    many = raw.post("/register", json={"redirect_uris": [f"https://x.example/cb{i}" for i in range(1000)]})
    assert many.status_code in (400, 413)
    six = raw.post("/register", json={"redirect_uris": [f"https://x.example/cb{i}" for i in range(6)]})
    assert six.status_code == 400
    big_name = raw.post("/register", json={"redirect_uris": [LOOPBACK_CB], "client_name": "n" * 100_000})
    assert big_name.status_code in (400, 413)
    long_name = raw.post("/register", json={"redirect_uris": [LOOPBACK_CB], "client_name": "n" * 5000})
    assert long_name.status_code == 400
    huge = raw.post(
        "/register", content=b"{" + b" " * (4 * 1024 * 1024) + b"}", headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413


def test_t20_registration_flooding_and_expiry(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    extra = "registrations_per_ip_per_hour = 3\nmax_clients = 5"
    with start_proxied_server(http_extra=extra) as server, server.http() as raw:
        body = {"redirect_uris": [LOOPBACK_CB], "token_endpoint_auth_method": "none"}
        one_ip = [raw.post("/register", json=body).status_code for _ in range(4)]
        assert one_ip == [201, 201, 201, 429]
        other = {"X-Forwarded-For": "192.0.2.7"}
        assert [raw.post("/register", json=body, headers=other).status_code for _ in range(3)] == [201, 201, 429]
        third = {"X-Forwarded-For": "192.0.2.8"}
        assert raw.post("/register", json=body, headers=third).status_code == 429  # global cap of 5
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0] == 5
            db.execute("UPDATE oauth_clients SET created_at = ?", (time.time() - 2 * 86400,))
        assert raw.post("/register", json=body, headers=third).status_code == 201  # unused clients expired
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0] == 1


def test_t20_unused_client_expires_without_a_new_registration(server: LiveServer, raw: httpx2.Client) -> None:
    """A client unused for 24 h is refused at once, not only after the next registration purges it."""
    unused, used = public_client(server), public_client(server)
    tokens = tokens_for(server, used)
    with server.db() as db:
        db.execute(
            "UPDATE oauth_clients SET created_at = ? WHERE client_id IN (?, ?)", (time.time() - 86_401, unused, used)
        )
    _, challenge = pkce()
    assert_refused_page(_authorize(raw, **_base_params(server, unused, challenge)), "unknown client")
    refused = raw.post("/token", data={"grant_type": "refresh_token", "refresh_token": "x" * 43, "client_id": unused})
    assert refused.status_code == 401
    assert refused.json()["error"] == "invalid_client"
    # A client that got a grant is not "unused": it keeps working however old it is.
    rotated = refresh(raw, used, tokens["refresh_token"])
    assert rotated.status_code == 200, rotated.text
    assert _authorize(raw, **_base_params(server, used, challenge)).status_code == 303


def test_t21_metadata_is_escaped_on_the_consent_page(server: LiveServer) -> None:
    xss = "<img src=x onerror=alert(1)>"
    client_id = public_client(server, client_name=xss, client_uri="https://ok.example")
    _, challenge = pkce()
    browser = Browser(server)
    try:
        login = browser.open(browser.authorize_url(client_id, challenge))
        assert xss not in login.text
        consent = browser.open(browser.login(login).headers["location"])
        assert xss not in consent.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in consent.text
        assert "<a " not in consent.text  # client_uri / logo_uri are never rendered as links
    finally:
        browser.close()


def test_t21_javascript_client_uri_is_refused_or_inert(server: LiveServer, raw: httpx2.Client) -> None:
    response = raw.post("/register", json={"redirect_uris": [LOOPBACK_CB], "client_uri": "javascript:alert(1)"})
    assert response.status_code == 400


def test_t22_unknown_scope_at_registration_is_narrowed_not_refused(server: LiveServer, raw: httpx2.Client) -> None:
    response = raw.post(
        "/register", json={"redirect_uris": [LOOPBACK_CB], "token_endpoint_auth_method": "none", "scope": "claudeai"}
    )
    assert response.status_code == 201
    assert "claudeai" not in json.dumps(response.json())
    tokens = tokens_for(server, response.json()["client_id"])
    assert "claudeai" not in tokens["scope"].split()


# -- D. authorization endpoint, login and consent ---------------------------------------------------


def _authorize(raw: httpx2.Client, **params: str) -> httpx2.Response:
    return raw.get("/authorize", params=params)


def _base_params(server: LiveServer, client_id: str, challenge: str, **override: str) -> dict[str, str]:
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": LOOPBACK_CB,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "s",
        "resource": server.mcp_url,
    }
    params.update(override)
    return {k: v for k, v in params.items() if v != "<omit>"}


def assert_refused_page(response: httpx2.Response, text: str = "") -> None:
    assert response.status_code == 400
    assert "location" not in response.headers
    assert text in response.text


def test_t23_unknown_client(raw: httpx2.Client) -> None:
    _, challenge = pkce()
    response = _authorize(
        raw,
        client_id="nope",
        redirect_uri="https://evil.example/cb",
        response_type="code",
        code_challenge=challenge,
        code_challenge_method="S256",
    )
    assert_refused_page(response, "unknown client")


@pytest.mark.parametrize(
    "uri",
    [
        CLAUDE_CB + "/",
        "https://claude.ai/api/mcp/AUTH_CALLBACK",
        CLAUDE_CB + "?x=1",
        "https://claude.ai.evil.example/api/mcp/auth_callback",
        "https://claude.ai@evil.example/api/mcp/auth_callback",
        "https://evil.example/api/mcp/auth_callback",
    ],
)
def test_t24_redirect_mismatch(server: LiveServer, raw: httpx2.Client, uri: str) -> None:
    client_id, _ = confidential_client(server)
    _, challenge = pkce()
    assert_refused_page(_authorize(raw, **_base_params(server, client_id, challenge, redirect_uri=uri)), "redirect_uri")


def test_t25_loopback_any_port(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    response = _authorize(
        raw, **_base_params(server, client_id, challenge, redirect_uri="http://127.0.0.1:53123/callback")
    )
    assert response.status_code == 303
    assert response.headers["location"].startswith("/oauth/login?txn=")


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:53123/other",
        "http://localhost:53123/callback",
        "https://127.0.0.1:53123/callback",
        "http://127.0.0.1.evil.example:53123/callback",
        "http://127.0.0.1:53123/callback?x=1",
        "http://evil@127.0.0.1:53123/callback",
    ],
)
def test_t26_loopback_boundaries(server: LiveServer, raw: httpx2.Client, uri: str) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    assert_refused_page(_authorize(raw, **_base_params(server, client_id, challenge, redirect_uri=uri)), "redirect_uri")


def test_t27_pkce_required(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    params = _base_params(server, client_id, "<omit>", code_challenge_method="<omit>")
    assert_refused_page(_authorize(raw, **params), "invalid_request")


def test_t28_plain_pkce_refused(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    verifier, _ = pkce()
    params = _base_params(server, client_id, verifier[:43], code_challenge_method="plain")
    assert_refused_page(_authorize(raw, **params), "S256")


def test_t29_malformed_challenge(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    assert_refused_page(_authorize(raw, **_base_params(server, client_id, "abcdefghij")), "invalid_request")
    assert_refused_page(_authorize(raw, **_base_params(server, client_id, "+" * 43)), "invalid_request")
    query = "&".join(f"{k}={v}" for k, v in _base_params(server, client_id, challenge).items() if k != "resource")
    duplicated = raw.get(f"/authorize?{query}&code_challenge={challenge}")
    assert_refused_page(duplicated, "invalid_request")


@pytest.mark.parametrize("response_type", ["token", "code id_token"])
def test_t30_response_type(server: LiveServer, raw: httpx2.Client, response_type: str) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    params = _base_params(server, client_id, challenge, response_type=response_type)
    assert_refused_page(_authorize(raw, **params), "unsupported_response_type")


@pytest.mark.parametrize("resource", ["https://evil.example/mcp", "{mcp}#x", "/mcp", "{mcp}/"])
def test_t31_resource_indicator(server: LiveServer, raw: httpx2.Client, resource: str) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    params = _base_params(server, client_id, challenge, resource=resource.format(mcp=server.mcp_url))
    assert_refused_page(_authorize(raw, **params), "invalid_target")


def test_t31_missing_resource_binds_to_the_mcp_url(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    verifier, challenge = pkce()
    code = code_for(server, client_id, challenge, resource="<omit>")
    tokens = redeem(raw, client_id, code, verifier).json()
    assert mcp_status(raw, tokens["access_token"]) == 200


def test_t32_no_redirect_to_an_attacker_uri_before_login(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server, redirect_uris=["https://attacker.example/cb"])
    for bad in ({"code_challenge": "short"}, {"response_type": "token"}, {"resource": "https://x.example"}):
        params = _base_params(server, client_id, "x" * 43, redirect_uri="https://attacker.example/cb", **bad)
        assert_refused_page(_authorize(raw, **params))


def test_t33_csrf_on_login_and_consent(server: LiveServer) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    victim, attacker = Browser(server), Browser(server)
    try:
        login = victim.open(victim.authorize_url(client_id, challenge))
        fields = forms(login.text)[0]["fields"]
        # No CSRF token; and a token from another browser (no matching cookie).
        assert victim.client.post("/oauth/login", data={"txn": fields["txn"], "password": PASSWORD}).status_code == 403
        assert attacker.client.post("/oauth/login", data={**fields, "password": PASSWORD}).status_code == 403
        consent = victim.open(victim.login(login).headers["location"])
        consent_fields = forms(consent.text)[0]["fields"]
        approve = {**consent_fields, "decision": "approve", "scope": "workbench"}
        assert victim.client.post("/oauth/consent", data={**approve, "csrf": "forged"}).status_code == 403
        assert attacker.client.post("/oauth/consent", data=approve).status_code == 403
        with server.db() as db:
            before = db.execute("SELECT count(*) FROM oauth_codes").fetchone()[0]
        first = victim.client.post("/oauth/consent", data=approve)
        assert first.status_code == 303
        replay = victim.client.post("/oauth/consent", data=approve)
        assert replay.status_code == 403  # the transaction is single-use
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_codes").fetchone()[0] == before + 1
    finally:
        victim.close()
        attacker.close()


def assert_page_headers(response: httpx2.Response) -> None:
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY"
    assert "no-store" in response.headers["cache-control"]


def test_t34_t35_clickjacking_headers_and_303(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    assert_page_headers(raw.get("/authorize", params={"client_id": "nope"}))
    browser = Browser(server)
    try:
        authorize = browser.client.get(browser.authorize_url(client_id, challenge))
        assert_page_headers(authorize)
        login = browser.open(authorize.headers["location"])
        assert_page_headers(login)
        after = browser.login(login)
        assert after.status_code == 303  # never 307: the password is not re-posted anywhere
        assert_page_headers(after)
        consent = browser.open(after.headers["location"])
        assert_page_headers(consent)
        decided = browser.consent(consent)
        assert decided.status_code == 303
    finally:
        browser.close()


def test_t36_wrong_password(start_proxied_server: Callable[..., AbstractContextManager[LiveServer]]) -> None:
    extra = "login_failures_before_backoff = 3\nlogin_backoff_max_s = 1\nglobal_login_failures_per_minute = 8"
    with start_proxied_server(http_extra=extra) as server:
        client_id = public_client(server)
        _, challenge = pkce()
        browser = Browser(server)
        try:
            login = browser.open(browser.authorize_url(client_id, challenge))
            started = time.perf_counter()
            wrong = browser.login(login, "not the password")
            assert wrong.status_code == 401
            assert "Login failed." in wrong.text
            assert "code=" not in wrong.headers.get("location", "")
            assert time.perf_counter() - started > 0.01  # the argon2 work was done
            statuses = [browser.login(login, "still wrong").status_code for _ in range(4)]
            assert statuses[:2] == [401, 401]
            assert 429 in statuses[2:]
            limited = browser.login(login, PASSWORD)
            assert limited.status_code == 429  # even the right password waits
            assert int(limited.headers["retry-after"]) >= 1
            # From five addresses: the global limit stops every address that has failed, even with the
            # right password; an address with no failure (the administrator's) is never locked out (issue 20).
            # Each posts a request of its own: one request's form takes five passwords in all.
            for n in range(5):
                forwarded = {"X-Forwarded-For": f"192.0.2.{n + 10}"}
                form = forms(browser.open(browser.authorize_url(client_id, challenge)).text)[0]
                browser.client.post("/oauth/login", data={**form["fields"], "password": "nope"}, headers=forwarded)
            fresh = forms(browser.open(browser.authorize_url(client_id, challenge)).text)[0]
            blocked = browser.client.post(
                "/oauth/login",
                data={**fresh["fields"], "password": PASSWORD},
                headers={"X-Forwarded-For": "192.0.2.10"},
            )
            assert blocked.status_code == 429
            assert "limiting" in server.log() or "backing off" in server.log()
            admin = browser.client.post(
                "/oauth/login",
                data={**fresh["fields"], "password": PASSWORD},
                headers={"X-Forwarded-For": "192.0.2.99"},
            )
            assert admin.status_code == 303
        finally:
            browser.close()


def test_t36_admin_logs_in_after_the_cool_down(start_server: Callable[..., AbstractContextManager[LiveServer]]) -> None:
    extra = "login_failures_before_backoff = 2\nlogin_backoff_max_s = 1"
    with start_server(http_extra=extra) as server:
        client_id = public_client(server)
        _, challenge = pkce()
        browser = Browser(server)
        try:
            login = browser.open(browser.authorize_url(client_id, challenge))
            for _ in range(3):
                browser.login(login, "wrong password")
            assert browser.login(login, PASSWORD).status_code == 429
            deadline = time.monotonic() + 5
            status = 429
            while status == 429 and time.monotonic() < deadline:
                time.sleep(0.2)
                status = browser.login(login, PASSWORD).status_code
            assert status == 303
        finally:
            browser.close()


def test_t37_deny(server: LiveServer) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    browser = Browser(server)
    try:
        login = browser.open(browser.authorize_url(client_id, challenge, state="xyz"))
        consent = browser.open(browser.login(login).headers["location"])
        denied = browser.consent(consent, decision="deny")
    finally:
        browser.close()
    assert denied.status_code == 303
    params = callback_params(denied.headers["location"])
    assert params == {"error": ["access_denied"], "state": ["xyz"], "iss": [server.base]}
    assert denied.headers["location"].startswith(LOOPBACK_CB + "?")


def test_t38_response_parameters(server: LiveServer) -> None:
    client_id = public_client(server)
    _, challenge = pkce()
    state = "a&b=c%d+e f"
    browser = Browser(server)
    try:
        location = browser.approve(browser.authorize_url(client_id, challenge, state=state))
    finally:
        browser.close()
    params = callback_params(location)
    assert set(params) == {"code", "state", "iss"}
    assert len(params["code"]) == 1
    assert params["state"] == [state]
    assert params["iss"] == [server.base]


# -- E. token endpoint (authorization_code) ---------------------------------------------------------


@pytest.fixture
def pub_code(server: LiveServer) -> tuple[str, str, str]:
    client_id = public_client(server)
    verifier, challenge = pkce()
    return client_id, verifier, code_for(server, client_id, challenge)


def test_t39_wrong_verifier(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, _, code = pub_code
    other, _ = pkce()
    response = redeem(raw, client_id, code, other)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


@pytest.mark.parametrize("verifier", ["a" * 42, "a" * 129, "a+b/c=" * 8])
def test_t40_verifier_format(raw: httpx2.Client, pub_code: tuple[str, str, str], verifier: str) -> None:
    client_id, _, code = pub_code
    response = redeem(raw, client_id, code, verifier)
    assert response.status_code == 400
    assert response.json()["error"] in ("invalid_request", "invalid_grant")


def test_t41_missing_verifier(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, _, code = pub_code
    response = raw.post(
        "/token",
        data={"grant_type": "authorization_code", "code": code, "client_id": client_id, "redirect_uri": LOOPBACK_CB},
    )
    assert response.status_code == 400


def test_t42_code_replay_revokes_the_grant(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    first = redeem(raw, client_id, code, verifier)
    assert first.status_code == 200
    tokens = first.json()
    assert mcp_status(raw, tokens["access_token"]) == 200
    second = redeem(raw, client_id, code, verifier)
    assert second.status_code == 400
    assert second.json()["error"] == "invalid_grant"
    assert mcp_status(raw, tokens["access_token"]) == 401
    assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"


def test_t43_code_race(server: LiveServer, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code

    def attempt(_: int) -> int:
        with server.http() as client:
            return redeem(client, client_id, code, verifier).status_code

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(attempt, range(10)))
    assert statuses.count(200) == 1
    assert statuses.count(400) == 9


def test_t44_expired_code(server: LiveServer, raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    with server.db() as db:
        db.execute("UPDATE oauth_codes SET expires_at = ? WHERE used_at IS NULL", (time.time() - 1,))
    response = redeem(raw, client_id, code, verifier)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


def test_t44_code_lifetime_is_short(server: LiveServer, pub_code: tuple[str, str, str]) -> None:
    with server.db() as db:
        expires = db.execute("SELECT max(expires_at) FROM oauth_codes").fetchone()[0]
    assert 0 < expires - time.time() <= 120


def test_t45_cross_client_code(server: LiveServer, raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    _, verifier, code = pub_code
    conf_id, secret = confidential_client(server)
    response = redeem(raw, conf_id, code, verifier, client_secret=secret)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


def test_t46_redirect_uri_mismatch(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    other = redeem(raw, client_id, code, verifier, redirect_uri="http://127.0.0.1/callback2")
    assert other.status_code == 400
    assert other.json()["error"] == "invalid_grant"
    omitted = redeem(raw, client_id, code, verifier, redirect_uri=None)  # type: ignore[arg-type]
    assert omitted.status_code == 400


def test_t47_resource_mismatch(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    response = redeem(raw, client_id, code, verifier, resource="https://other.example/mcp")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_target"


def test_t48_confidential_client_authentication(server: LiveServer, raw: httpx2.Client) -> None:
    conf_id, secret = confidential_client(server)
    base = {
        "grant_type": "authorization_code",
        "code": "x" * 43,
        "code_verifier": "v" * 43,
        "client_id": conf_id,
        "redirect_uri": CLAUDE_CB,
    }
    wrong = raw.post("/token", data={**base, "client_secret": "wrong"})
    missing = raw.post("/token", data=base)
    basic = base64.b64encode(f"{conf_id}:wrong".encode()).decode()
    with_basic = raw.post("/token", data=base, headers={"Authorization": f"Basic {basic}"})
    for response in (wrong, missing, with_basic):
        assert response.status_code == 401
        assert response.json()["error"] == "invalid_client"
    assert with_basic.headers["www-authenticate"].startswith("Basic")
    right = raw.post("/token", data={**base, "client_secret": secret})
    assert right.status_code == 400  # authenticated; the made-up code is then invalid_grant
    assert right.json()["error"] == "invalid_grant"


@pytest.mark.parametrize(
    "grant_type", ["password", "client_credentials", "urn:ietf:params:oauth:grant-type:jwt-bearer", "implicit"]
)
def test_t49_grant_type_abuse(server: LiveServer, raw: httpx2.Client, grant_type: str) -> None:
    client_id = public_client(server)
    response = raw.post(
        "/token", data={"grant_type": grant_type, "client_id": client_id, "username": "a", "password": "b"}
    )
    assert response.status_code == 400
    assert response.json()["error"] in ("unsupported_grant_type", "unauthorized_client")


def test_t50_transport_and_shape(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    assert raw.get("/token").status_code == 405
    as_json = raw.post("/token", json={"grant_type": "authorization_code", "code": code, "client_id": client_id})
    assert as_json.status_code == 400
    body = f"grant_type=authorization_code&code={code}&code={code}&code_verifier={verifier}&client_id={client_id}"
    duplicated = raw.post("/token", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert duplicated.status_code == 400
    assert duplicated.json()["error"] == "invalid_request"


def test_t51_token_response_hygiene(raw: httpx2.Client, pub_code: tuple[str, str, str]) -> None:
    client_id, verifier, code = pub_code
    response = redeem(raw, client_id, code, verifier)
    assert response.status_code == 200
    assert "no-store" in response.headers["cache-control"]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 3600
    assert body["refresh_token"]
    assert set(body["scope"].split()) == {"workbench", "organizer", "gateway:read", "gateway:deploy"}
    assert len(base64.urlsafe_b64decode(body["access_token"] + "=")) == 32  # 256-bit opaque


# -- F. refresh tokens ------------------------------------------------------------------------------


def test_t52_rotation_and_reuse_detection(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    first = tokens_for(server, client_id)
    rotated = refresh(raw, client_id, first["refresh_token"])
    assert rotated.status_code == 200
    second = rotated.json()
    assert second["refresh_token"] != first["refresh_token"]
    assert mcp_status(raw, second["access_token"]) == 200
    past_grace(server, first["refresh_token"])
    reused = refresh(raw, client_id, first["refresh_token"])
    assert reused.json()["error"] == "invalid_grant"
    assert refresh(raw, client_id, second["refresh_token"]).json()["error"] == "invalid_grant"
    assert mcp_status(raw, second["access_token"]) == 401


def test_t52_a_client_refreshing_in_a_loop_is_slowed(server: LiveServer, raw: httpx2.Client) -> None:
    """Attack: an approved client refreshes in a loop. Each rotation writes rows (and kept the used token
    for its whole lifetime: tests/transports/http/test_store.py), at whatever rate the client liked.
    Invariant: past ROTATIONS_PER_MINUTE a refresh is 429 with Retry-After; the token it presented stays
    good and the grant is not revoked."""
    client_id = public_client(server)
    current = tokens_for(server, client_id)
    for _ in range(ROTATIONS_PER_MINUTE):
        rotated = refresh(raw, client_id, current["refresh_token"])
        assert rotated.status_code == 200, rotated.text
        current = rotated.json()
    slowed = refresh(raw, client_id, current["refresh_token"])
    assert slowed.status_code == 429
    assert int(slowed.headers["retry-after"]) >= 1
    assert mcp_status(raw, current["access_token"]) == 200
    with server.db() as db:
        (used_at,) = db.execute(
            "SELECT used_at FROM oauth_tokens WHERE digest = ?",
            (hashlib.sha256(current["refresh_token"].encode()).hexdigest(),),
        ).fetchone()
    assert used_at is None  # refused before it was spent: the client retries with it later


def test_t53_cross_client_refresh(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    conf_id, secret = confidential_client(server)
    response = refresh(raw, conf_id, tokens["refresh_token"], client_secret=secret)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"
    assert refresh(raw, client_id, tokens["refresh_token"]).status_code == 200  # not revoked by the attempt


def test_t54_scope_escalation(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id, scopes=["organizer"])
    response = refresh(raw, client_id, tokens["refresh_token"], scope="organizer workbench")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_scope"


def test_t55_refresh_and_resource(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    other = refresh(raw, client_id, tokens["refresh_token"], resource="https://other.example/mcp")
    assert other.json()["error"] == "invalid_target"
    plain = refresh(raw, client_id, tokens["refresh_token"])
    assert plain.status_code == 200
    assert mcp_status(raw, plain.json()["access_token"]) == 200


def test_t56_revoking_the_refresh_token_kills_the_grant(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    revoked = raw.post(
        "/revoke", data={"token": tokens["refresh_token"], "client_id": client_id, "token_type_hint": "refresh_token"}
    )
    assert revoked.status_code == 200
    assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"
    assert mcp_status(raw, tokens["access_token"]) == 401


def test_t56_password_change_revokes_everything(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_server() as server, server.http() as raw:
        client_id = public_client(server)
        tokens = tokens_for(server, client_id)
        assert mcp_status(raw, tokens["access_token"]) == 200
        set_password(server, "a brand new password")
        assert mcp_status(raw, tokens["access_token"]) == 401
        assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"
        _, challenge = pkce()
        browser = Browser(server)
        try:
            login = browser.open(browser.authorize_url(client_id, challenge))
            assert browser.login(login, PASSWORD).status_code == 401
            assert browser.login(login, "a brand new password").status_code == 303
        finally:
            browser.close()


def test_t56_password_change_voids_a_login_in_progress(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Logged in with the old password, consent page open: after the change, approving mints no code."""
    with start_server() as server:
        client_id = public_client(server)
        _, challenge = pkce()
        browser = Browser(server)
        try:
            login = browser.open(browser.authorize_url(client_id, challenge))
            consent = browser.open(browser.login(login).headers["location"])
            assert consent.status_code == 200
            set_password(server, "a brand new password")
            decided = browser.consent(consent)
            assert decided.status_code == 403
            assert "location" not in decided.headers
            assert "password has changed" in decided.text
        finally:
            browser.close()
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_codes").fetchone()[0] == 0


def test_t56_revoke_all_button(start_server: Callable[..., AbstractContextManager[LiveServer]]) -> None:
    with start_server() as server, server.http() as raw:
        client_id = public_client(server)
        tokens = tokens_for(server, client_id)
        browser = Browser(server)
        try:
            login = browser.open("/admin/login")
            home = browser.open(browser.login(login).headers["location"])
            assert client_id in home.text
            revoke_all = next(f for f in forms(home.text) if f["fields"].get("grant") == "*")
            assert browser.client.post("/admin/revoke", data=revoke_all["fields"]).status_code == 303
        finally:
            browser.close()
        assert mcp_status(raw, tokens["access_token"]) == 401
        assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"


def test_t57_refresh_token_expiry(server: LiveServer, raw: httpx2.Client) -> None:
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    with server.db() as db:
        db.execute(
            "UPDATE oauth_tokens SET expires_at = ? WHERE kind = 'refresh' AND client_id = ?",
            (time.time() - 1, client_id),
        )
    assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"


def past_grace(server: LiveServer, token: str) -> None:
    """Move a rotated refresh token's rotation time back past the grace window, as if 11 s had passed."""
    with server.db() as db:
        moved = db.execute(
            "UPDATE oauth_tokens SET used_at = used_at - 11 WHERE digest = ? AND used_at IS NOT NULL",
            (hashlib.sha256(token.encode()).hexdigest(),),
        ).rowcount
    assert moved == 1


def test_t58_concurrent_refresh_by_two_sessions_gets_one_pair(server: LiveServer) -> None:
    """Issue 20: two Claude Code sessions sharing one credential store refresh with the same token at once.

    Both get the same new pair (a 10 s grace window for the same client), which works; the grant is not
    revoked. Presenting the old token after the window is still reuse and revokes the whole grant, the
    pair included. What it does not prove: several server processes (one serves a state folder).
    """
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)

    def attempt(_: int) -> httpx2.Response:
        with server.http() as client:
            return refresh(client, client_id, tokens["refresh_token"])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(attempt, range(2)))
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    first, second = (r.json() for r in results)
    assert first == second
    assert first["refresh_token"] != tokens["refresh_token"]
    with server.http() as raw:
        assert mcp_status(raw, first["access_token"]) == 200
        # Another client presenting it is refused and gets nothing (cross-client, T-53), and revokes nothing.
        other = public_client(server)
        assert refresh(raw, other, tokens["refresh_token"]).json()["error"] == "invalid_grant"
        assert mcp_status(raw, first["access_token"]) == 200
        # The new refresh token rotates normally.
        third = refresh(raw, client_id, first["refresh_token"])
        assert third.status_code == 200
        # After the window, the old token is reuse: the grant dies, every pair included.
        past_grace(server, tokens["refresh_token"])
        assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"
        assert mcp_status(raw, third.json()["access_token"]) == 401
        assert refresh(raw, client_id, third.json()["refresh_token"]).json()["error"] == "invalid_grant"


def test_t58_refresh_reuse_with_other_scopes_in_the_window_revokes(server: LiveServer) -> None:
    """The grace window gives back the same pair only for the same request: other scopes are reuse."""
    client_id = public_client(server)
    tokens = tokens_for(server, client_id)
    with server.http() as raw:
        rotated = refresh(raw, client_id, tokens["refresh_token"])
        assert rotated.status_code == 200
        narrowed = refresh(raw, client_id, tokens["refresh_token"], scope="organizer")
        assert narrowed.json()["error"] == "invalid_grant"
        assert mcp_status(raw, rotated.json()["access_token"]) == 401


def test_t58_grace_window_off_revokes_at_once(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """With `refresh_reuse_grace_s = 0`, a concurrent refresh revokes the family, as before issue 20."""
    with start_server(http_extra="refresh_reuse_grace_s = 0") as server, server.http() as raw:
        client_id = public_client(server)
        tokens = tokens_for(server, client_id)
        winner = refresh(raw, client_id, tokens["refresh_token"])
        assert winner.status_code == 200
        assert refresh(raw, client_id, tokens["refresh_token"]).json()["error"] == "invalid_grant"
        assert mcp_status(raw, winner.json()["access_token"]) == 401


# -- G. revocation, storage, logging ----------------------------------------------------------------


def test_t59_revocation_semantics(server: LiveServer, raw: httpx2.Client) -> None:
    owner = public_client(server)
    tokens = tokens_for(server, owner)
    stranger = public_client(server)
    assert raw.post("/revoke", data={"token": "unknown" * 6, "client_id": owner}).status_code == 200
    assert raw.post("/revoke", data={"token": tokens["access_token"], "client_id": stranger}).status_code == 200
    assert mcp_status(raw, tokens["access_token"]) == 200  # another client's token stays valid
    wrong_hint = raw.post(
        "/revoke", data={"token": tokens["access_token"], "client_id": owner, "token_type_hint": "refresh_token"}
    )
    assert wrong_hint.status_code == 200
    assert mcp_status(raw, tokens["access_token"]) == 401


def secrets_of_every_kind(server: LiveServer, raw: httpx2.Client) -> list[str]:
    """A client secret, codes (redeemed, replayed, left pending), tokens (issued, rotated, revoked)."""
    _, client_secret = confidential_client(server)
    client_id = public_client(server)
    verifier, challenge = pkce()
    code = code_for(server, client_id, challenge)
    issued = redeem(raw, client_id, code, verifier).json()
    rotated = refresh(raw, client_id, issued["refresh_token"]).json()
    assert redeem(raw, client_id, code, verifier).status_code == 400  # the replay revokes the grant
    pending = code_for(server, client_id, pkce()[1])
    revoked = tokens_for(server, client_id)
    raw.post("/revoke", data={"token": revoked["refresh_token"], "client_id": client_id})
    queried = tokens_for(server, client_id)["access_token"]
    raw.post(f"/mcp?access_token={queried}", json=INITIALIZE_REQUEST, headers=MCP_HEADERS)
    tokens = [t[kind] for t in (issued, rotated, revoked) for kind in ("access_token", "refresh_token")]
    return [client_secret, code, pending, queried, *tokens]


def test_t60_no_secret_at_rest_or_in_logs(server: LiveServer, raw: httpx2.Client) -> None:
    """Every secret made here is absent from the database files (only SHA-256 digests) and from the
    server's log and access log; so is the admin password, stored only as an argon2id hash."""
    seen = secrets_of_every_kind(server, raw)
    state = server.root / "state"
    stored = b"".join(p.read_bytes() for p in state.iterdir() if p.name.startswith("bastion.db"))
    log = server.log()
    for secret in seen:
        assert secret.encode() not in stored
        assert secret not in log
    assert PASSWORD not in log
    assert PASSWORD.encode() not in stored
    hash_text = (state / "admin-password.argon2").read_text()
    assert hash_text.startswith("$argon2id$")
    assert "access_token" not in log  # the query string above never reached the log
