"""/register and the other machine-facing endpoints under attack (issue 20), against a live server.

What this proves, over real HTTP against the real `bastion serve --http`: a registration flood from many
addresses (or from one IPv6 /64 spread over its addresses) cannot keep claude.ai- or Claude Code-shaped
clients out: never-used clients are evicted, oldest first, before the table refuses anyone, and clients
that got a grant are never evicted; failed registrations cost no quota; malformed and deeply nested JSON
and other parse failures are a 400 with a one-line reason (no 500, no traceback in the log); JSON
endpoints send `nosniff`; redirect URIs are compared in one normal form at both ends. Other addresses
are played with `X-Forwarded-For`, which these servers trust from loopback (`trusted_proxies`). What it
does not prove: behaviour behind a real reverse proxy, or floods from more addresses than the per-
address quota can stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx2
import pytest

from bastion.transports.http.redirects import normal_form
from bastion.transports.http.store import AuthStore
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .clients import CLAUDE_AI, CLAUDE_CODE, LOOPBACK, from_address
from .live import Browser, LiveServer, callback_params, get_tokens, pkce


def client_count(server: LiveServer) -> int:
    with server.db() as db:
        return int(db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0])


def assert_no_traceback(server: LiveServer) -> None:
    assert "Traceback" not in server.log()


@pytest.fixture
def raw(server: LiveServer) -> Iterator[httpx2.Client]:
    with server.http() as client:
        yield client


def claude_code_connects(server: LiveServer, client_id: str) -> None:
    """The Claude Code-shaped client's whole flow (any loopback port), then an MCP session opens."""
    tokens = get_tokens(server, client_id, redirect_uri="http://localhost:40123/callback")
    with server.http() as raw:
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        opened = raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer)
    assert opened.status_code == 200, opened.text


def test_registration_flood_evicts_unused_clients_so_claude_still_registers(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """20 registrations from 10 addresses fill a 20-client table. While the flood is young (under
    `unused_client_min_age_s`), a new client is refused with a 429 that says when to retry and how to
    prune; once older, claude.ai- and Claude Code-shaped clients register (flood clients evicted, oldest
    first) and connect, and a client that got a grant is never evicted."""
    extra = "max_clients = 20\nregistrations_per_ip_per_hour = 2\nunused_client_min_age_s = 60"
    with start_proxied_server(http_extra=extra) as server, server.http() as raw:
        used = server.register(client_name="used before the flood")["client_id"]
        get_tokens(server, used)
        flood = [
            raw.post("/register", json=LOOPBACK, headers=from_address(f"192.0.2.{n}")).status_code
            for n in range(1, 11)
            for _ in range(2)
        ]
        assert flood.count(201) == 19  # the table (20) is full, the used client included
        assert flood[-1] == 429
        refused = raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1"))
        assert refused.status_code == 429
        assert refused.json()["error"] == "temporarily_unavailable"
        assert "bastion admin clients prune" in refused.json()["error_description"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert client_count(server) == 20
        with server.db() as db:  # the flood was two minutes ago
            db.execute("UPDATE oauth_clients SET created_at = created_at - 120")
        claude_ai = raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1"))
        assert claude_ai.status_code == 201, claude_ai.text
        assert claude_ai.json()["client_secret"]
        claude_code = raw.post("/register", json=CLAUDE_CODE, headers=from_address("198.51.100.2"))
        assert claude_code.status_code == 201, claude_code.text
        assert client_count(server) == 20
        with server.db() as db:
            ids = {row[0] for row in db.execute("SELECT client_id FROM oauth_clients")}
        assert used in ids
        assert {claude_ai.json()["client_id"], claude_code.json()["client_id"]} <= ids
        claude_code_connects(server, claude_code.json()["client_id"])
        assert "evicted never-used clients" in server.log()
        assert_no_traceback(server)


def test_a_table_filled_while_the_clock_ran_a_year_ahead_refuses_for_minutes_not_a_year(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Found by attack (wall-clock jumps, a real server under a clock shim): never-used clients registered while
    the clock ran a year ahead were stamped in the future; once it stepped back, none could be expired, evicted
    or pruned, and every registration, claude.ai's included, got 429 with a Retry-After of a year. Invariant: a
    stamp after now is taken as now, so the refusal says minutes (`unused_client_min_age_s`), and once that has
    passed the flood is evicted as any other."""
    extra = "max_clients = 4\nregistrations_per_ip_per_hour = 10\nunused_client_min_age_s = 60"
    with start_proxied_server(http_extra=extra) as server, server.http() as raw:
        flood = [raw.post("/register", json=LOOPBACK, headers=from_address(f"192.0.2.{n}")) for n in range(1, 5)]
        assert [r.status_code for r in flood] == [201] * 4
        with server.db() as db:  # registered while the clock ran a year ahead
            db.execute("UPDATE oauth_clients SET created_at = created_at + 365 * 86400")
        refused = raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1"))
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        with server.db() as db:  # the flood is now two minutes old, on the stepped-back clock
            db.execute("UPDATE oauth_clients SET created_at = created_at - 120")
        claude_ai = raw.post("/register", json=CLAUDE_AI, headers=from_address("198.51.100.1"))
        assert claude_ai.status_code == 201, claude_ai.text
        assert_no_traceback(server)


def test_registration_flood_from_one_ipv6_64_counts_as_one_address(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_proxied_server(http_extra="registrations_per_ip_per_hour = 3") as server, server.http() as raw:
        same_64 = [
            raw.post("/register", json=LOOPBACK, headers=from_address(f"2001:db8:1:2::{n:x}")).status_code
            for n in range(1, 6)
        ]
        assert same_64 == [201, 201, 201, 429, 429]
        refused = raw.post("/register", json=LOOPBACK, headers=from_address("2001:db8:1:2:ffff:ffff:ffff:ffff"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) > 3000
        # Another /64, and an IPv4 address, are other addresses: Claude Code still registers and connects.
        other = raw.post("/register", json=CLAUDE_CODE, headers=from_address("2001:db8:1:3::1"))
        assert other.status_code == 201
        assert raw.post("/register", json=LOOPBACK, headers=from_address("192.0.2.1")).status_code == 201
        claude_code_connects(server, other.json()["client_id"])


BAD_REGISTRATIONS: list[tuple[str, bytes | dict[str, Any]]] = [
    ("javascript redirect", {"redirect_uris": ["javascript:alert(1)"]}),
    ("password grant", {**LOOPBACK, "grant_types": ["password"]}),
    ("not JSON", b"{redirect_uris: nope"),
    ("not an object", b'["http://127.0.0.1/callback"]'),
    ("nested 30,000 deep", b"[" * 30_000 + b"]" * 30_000),  # under the 64 KiB body cap
    (
        "nested inside a field",
        b'{"redirect_uris": ["http://127.0.0.1/callback"], "x": ' + b"[" * 25_000 + b"]" * 25_000 + b"}",
    ),
    ("invalid UTF-8", b'{"redirect_uris": ["http://127.0.0.1/\xff\xfe"]}'),
    ("redirect not in normal form", {"redirect_uris": ["https://app.example:443/cb"]}),
]


def _post_registration(raw: httpx2.Client, body: bytes | dict[str, Any], address: str) -> httpx2.Response:
    if isinstance(body, dict):
        return raw.post("/register", json=body, headers=from_address(address))
    headers = {**from_address(address), "content-type": "application/json"}
    return raw.post("/register", content=body, headers=headers)


def test_failed_registrations_do_not_use_the_quota(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_proxied_server(http_extra="registrations_per_ip_per_hour = 2") as server, server.http() as raw:
        for name, body in BAD_REGISTRATIONS:
            response = _post_registration(raw, body, "192.0.2.50")
            assert response.status_code == 400, (name, response.text)
        good = [_post_registration(raw, LOOPBACK, "192.0.2.50").status_code for _ in range(3)]
        assert good == [201, 201, 429]
        assert client_count(server) == 2
        assert_no_traceback(server)


@pytest.mark.parametrize(("name", "body"), BAD_REGISTRATIONS, ids=[name for name, _ in BAD_REGISTRATIONS])
def test_malformed_registration_is_a_400_with_a_reason(
    server: LiveServer, raw: httpx2.Client, name: str, body: bytes | dict[str, Any]
) -> None:
    """Unauthenticated parse failures, deep nesting included, are a 400 with a one-line JSON reason."""
    before = client_count(server)
    response = _post_registration(raw, body, "192.0.2.60")
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-content-type-options"] == "nosniff"
    error = response.json()
    assert error["error"] in ("invalid_client_metadata", "invalid_redirect_uri")
    assert "\n" not in error["error_description"]
    assert 0 < len(error["error_description"]) < 400
    assert client_count(server) == before
    assert_no_traceback(server)
    assert raw.post("/register", json=CLAUDE_CODE).status_code == 201  # and registration still works


TOKEN_GARBAGE: list[tuple[str, bytes, str]] = [
    ("json body", b'{"grant_type": "refresh_token"}', "application/json"),
    ("no content type", b"grant_type=refresh_token", ""),
    ("binary", bytes(range(256)), "application/x-www-form-urlencoded"),
    ("bad percent escapes", b"grant_type=%zz&refresh_token=%&client_id=%%%", "application/x-www-form-urlencoded"),
    (
        "invalid UTF-8",
        b"grant_type=refresh_token&refresh_token=\xff\xfe&client_id=\xc0",
        "application/x-www-form-urlencoded",
    ),
    ("1000 fields", b"&".join(b"f%d=1" % i for i in range(1000)), "application/x-www-form-urlencoded"),
    ("repeated field", b"grant_type=a&grant_type=b", "application/x-www-form-urlencoded"),
    (
        "NUL bytes",
        b"grant_type=refresh_token&refresh_token=\x00\x00&client_id=\x00",
        "application/x-www-form-urlencoded",
    ),
]


@pytest.mark.parametrize("path", ["/token", "/revoke"])
@pytest.mark.parametrize(("name", "body", "content_type"), TOKEN_GARBAGE, ids=[t[0] for t in TOKEN_GARBAGE])
def test_malformed_token_request_is_a_4xx_with_a_reason(
    server: LiveServer, raw: httpx2.Client, path: str, name: str, body: bytes, content_type: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = raw.post(path, content=body, headers=headers)
    assert response.status_code in (400, 401), response.text
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.json()["error"] in ("invalid_request", "invalid_client")
    assert_no_traceback(server)


def test_json_endpoints_send_nosniff(server: LiveServer, raw: httpx2.Client) -> None:
    for path in (
        "/.well-known/oauth-authorization-server",
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ):
        assert raw.get(path).headers["x-content-type-options"] == "nosniff", path
    registered = raw.post("/register", json=CLAUDE_CODE)
    assert registered.status_code == 201
    assert registered.headers["x-content-type-options"] == "nosniff"
    tokens = get_tokens(server, server.register()["client_id"])
    refreshed = raw.post(
        "/token", data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"], "client_id": "x"}
    )
    assert refreshed.headers["x-content-type-options"] == "nosniff"
    unauthenticated = raw.post("/mcp", json={})
    assert unauthenticated.status_code == 401
    assert unauthenticated.headers["x-content-type-options"] == "nosniff"


def test_redirect_uri_case_is_normalised_at_both_ends_never_in_the_path(server: LiveServer, raw: httpx2.Client) -> None:
    """Registered with upper-case scheme and host: /authorize accepts it as sent (and lower-cased), the
    code redeems with it, and a path differing only in case is refused (RFC 3986 §6.2.2.1)."""
    sent = "HTTPS://App.Example/OAuth/Callback"
    registered = raw.post("/register", json={"redirect_uris": [sent], "token_endpoint_auth_method": "none"})
    assert registered.status_code == 201, registered.text
    client_id = registered.json()["client_id"]
    assert registered.json()["redirect_uris"] == ["https://app.example/OAuth/Callback"]
    verifier, challenge = pkce()
    browser = Browser(server)
    try:
        wrong_path = browser.open(
            browser.authorize_url(client_id, challenge, redirect_uri="https://app.example/oauth/callback")
        )
        assert wrong_path.status_code == 400
        assert "redirect_uri is not registered" in wrong_path.text
        location = browser.approve(browser.authorize_url(client_id, challenge, redirect_uri=sent))
    finally:
        browser.close()
    assert normal_form(location).startswith(normal_form(sent) + "?")
    code = callback_params(location)["code"][0]
    redeemed = raw.post(
        "/token",
        data={
            "grant_type": "authorization_code",
            "code": code,
            "code_verifier": verifier,
            "client_id": client_id,
            "redirect_uri": "https://app.example/OAuth/Callback",
        },
    )
    assert redeemed.status_code == 200, redeemed.text


def test_unused_client_min_age_keeps_a_client_being_authorized(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """A full table of young unused clients refuses a new one rather than evict a client whose
    authorization may be under way; the 429 names the wait."""
    with start_proxied_server(http_extra="max_clients = 2") as server, server.http() as raw:
        first = server.register()["client_id"]
        server.register()
        refused = raw.post("/register", json=CLAUDE_CODE, headers=from_address("192.0.2.9"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) <= 900
        with server.db() as db:
            db.execute("UPDATE oauth_clients SET created_at = ? WHERE client_id = ?", (time.time() - 901, first))
        assert raw.post("/register", json=CLAUDE_CODE, headers=from_address("192.0.2.9")).status_code == 201
        with server.db() as db:
            assert db.execute("SELECT count(*) FROM oauth_clients WHERE client_id = ?", (first,)).fetchone()[0] == 0


def test_grant_beyond_the_registered_scope_is_narrowed_by_the_store(tmp_path: Path) -> None:
    """The backstop behind the consent page: a grant recorded for more than the client registered holds
    only what it registered (a real store, on disk); a client that named no known scope is not bounded."""
    store = AuthStore(tmp_path / "bastion.db")
    try:
        store.add_client("bounded", {"redirect_uris": ["http://127.0.0.1/cb"], "scope": "organizer"}, None, "::1")
        store.add_client("open", {"redirect_uris": ["http://127.0.0.1/cb"]}, None, "::1")
        assert store.client_scopes("bounded") == ("organizer",)
        assert store.client_scopes("open") is None
        assert store.client_scopes("unknown") is None
        for client_id in ("bounded", "open"):
            store.create_grant_with_code(
                client_id=client_id,
                scopes=("organizer", "workbench"),
                resource="http://127.0.0.1:1/mcp",
                redirect_uri="http://127.0.0.1/cb",
                code_challenge="x" * 43,
                code_lifetime_s=60,
                grant_lifetime_s=600,
            )
        granted = {g.client_id: g.scopes for g in store.grants()}
        assert tuple(granted["bounded"]) == ("organizer",)
        assert tuple(granted["open"]) == ("organizer", "workbench")
    finally:
        store.close()
