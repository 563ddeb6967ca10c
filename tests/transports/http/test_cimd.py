"""Client ID Metadata Documents (T-61): the fetch, its SSRF guard and the document checks.

What this proves: with the real fetcher against a real local HTTPS server, a good document becomes a
public client; redirects, oversized and slow documents, a document naming another client id, and bad
redirect URIs are refused within the time bound; results are cached. The guard itself refuses loopback,
private, link-local (cloud metadata), CGNAT and mapped addresses, and the live server refuses a URL
client id that resolves to loopback. The local server stands in for a public host by replacing only the
address predicate (a public test host is not reachable here). What it does not prove: behaviour of real
public hosts (certificate chains, IPv6-only hosts).
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import pytest

from bastion.transports.http import cimd
from bastion.transports.http.cimd import CimdFetcher, CimdRefused, check_url, public_only

from .live import LiveServer, pkce
from .tls import self_signed

pytestmark = pytest.mark.anyio


class DocumentServer:
    def __init__(self, folder: Path) -> None:
        self.cert, key = self_signed(folder)
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                base = f"https://127.0.0.1:{server.port}"
                doc = {
                    "client_id": f"{base}{self.path}",
                    "client_name": "Doc client",
                    "redirect_uris": ["http://127.0.0.1/cb"],
                }
                if self.path == "/redirect.json":
                    self.send_response(302)
                    self.send_header("Location", f"{base}/client.json")
                    self.end_headers()
                    return
                if self.path == "/big.json":
                    body = json.dumps({**doc, "pad": "x" * 200_000}).encode()
                elif self.path == "/slow.json":
                    time.sleep(2)
                    body = json.dumps(doc).encode()
                elif self.path == "/other.json":
                    body = json.dumps({**doc, "client_id": f"{base}/client.json"}).encode()
                elif self.path == "/evil-redirect.json":
                    body = json.dumps({**doc, "redirect_uris": ["http://evil.example/cb"]}).encode()
                elif self.path == "/scoped.json":
                    body = json.dumps({**doc, "scope": "claudeai organizer gateway:read"}).encode()
                elif self.path == "/unknown-scope.json":
                    body = json.dumps({**doc, "scope": "claudeai"}).encode()
                elif self.path == "/secret.json":
                    body = json.dumps({**doc, "token_endpoint_auth_method": "client_secret_post"}).encode()
                else:
                    body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def documents(tmp_path: Path) -> Iterator[DocumentServer]:
    server = DocumentServer(tmp_path)
    yield server
    server.close()


def fetcher_for(documents: DocumentServer) -> CimdFetcher:
    context = ssl.create_default_context(cafile=str(documents.cert))
    return CimdFetcher((), address_allowed=lambda address: address == "127.0.0.1", ssl_context=context)


async def test_cimd_document_scope_bounds_the_client_like_a_registered_one(documents: DocumentServer) -> None:
    """Issue 20: the document's `scope`, narrowed to known scopes, is the client's bound (the consent
    page offers nothing beyond it); no known scope, or none at all, leaves the client unbounded."""
    fetcher = fetcher_for(documents)
    scoped = await fetcher.client(documents.url("/scoped.json"))
    assert scoped is not None
    assert scoped.scope == "organizer gateway:read"
    for path in ("/unknown-scope.json", "/client.json"):
        unbounded = await fetcher.client(documents.url(path))
        assert unbounded is not None
        assert unbounded.scope is None


async def test_a_good_document_is_a_public_client_and_is_cached(documents: DocumentServer) -> None:
    fetcher = fetcher_for(documents)
    info = await fetcher.client(documents.url("/client.json"))
    assert info is not None
    assert info.client_id == documents.url("/client.json")
    assert info.token_endpoint_auth_method == "none"
    assert [str(u) for u in info.redirect_uris or []] == ["http://127.0.0.1/cb"]
    assert info.client_name == "Doc client"
    assert await fetcher.client(documents.url("/client.json")) is not None
    assert documents.hits["/client.json"] == 1


async def test_many_asks_and_varied_paths_cannot_make_bastion_fetch_in_a_loop(
    documents: DocumentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: an unauthenticated client sends /token or /authorize with a client_id URL at once from
    many connections, then with a new path each time (each its own cache entry): bastion fetched once
    per ask, as fast as the client asked, from a host the client chose. Invariant: one fetch per URL at
    a time (the others read its answer), and at most FETCHES_PER_HOST_PER_MINUTE new fetches from a host
    a minute; past it the ask is refused and not cached."""
    monkeypatch.setattr(cimd, "FETCHES_PER_HOST_PER_MINUTE", 3)
    fetcher = fetcher_for(documents)
    results: list[object] = []

    async def ask() -> None:
        results.append(await fetcher.client(documents.url("/client.json")))

    async with anyio.create_task_group() as tasks:
        for _ in range(20):
            tasks.start_soon(ask)
    assert documents.hits["/client.json"] == 1
    assert all(r is not None for r in results)
    for n in range(5):
        await fetcher.client(documents.url(f"/varied-{n}.json"))
    assert sum(documents.hits.values()) == 3
    assert await fetcher.client(documents.url("/varied-4.json")) is None
    assert await fetcher.client(documents.url("/client.json")) is not None  # cached: no fetch needed


@pytest.mark.parametrize("path", ["/redirect.json", "/big.json", "/other.json", "/evil-redirect.json", "/secret.json"])
async def test_bad_documents_are_refused(documents: DocumentServer, path: str) -> None:
    assert await fetcher_for(documents).client(documents.url(path)) is None


async def test_a_client_id_url_with_one_non_ascii_character_is_refused_not_a_500(documents: DocumentServer) -> None:
    """Attack (cimd_unicode.py): an "é" in a client_id URL's path passed the URL check and reached h11,
    whose UnicodeEncodeError escaped the fetcher: /authorize and /token answered 500 to anyone, and the
    failure, never cached, was fetched again at each request. Invariant: refused (None) before any fetch;
    the same document at its ASCII URL is still a client."""
    fetcher = fetcher_for(documents)
    assert await fetcher.client(documents.url("/caf\u00e9.json")) is None
    assert await fetcher.client(documents.url("/caf%C3%A9.json")) is not None


async def test_slow_document_is_cut_off(documents: DocumentServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cimd, "FETCH_TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert await fetcher_for(documents).client(documents.url("/slow.json")) is None
    assert time.monotonic() - started < 1.5


async def test_the_real_guard_refuses_loopback(documents: DocumentServer) -> None:
    context = ssl.create_default_context(cafile=str(documents.cert))
    fetcher = CimdFetcher((), ssl_context=context)  # the default guard: public addresses only
    assert await fetcher.client(documents.url("/client.json")) is None
    assert "/client.json" not in documents.hits  # refused before connecting


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.1.1", False),
        ("172.16.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
    ],
)
def test_public_only(address: str, allowed: bool) -> None:
    assert public_only(address) is allowed


# Issue 20: every block of the IANA special-purpose registries, and every IPv6 form that carries an IPv4
# address, with the loopback, private, link-local and metadata addresses inside them.
SPECIAL_PURPOSE_ADDRESSES = [
    "0.1.2.3",  # this network
    "192.0.0.9",  # IETF protocol assignment marked globally reachable (PCP anycast)
    "192.0.0.170",  # NAT64/DNS64 discovery
    "192.0.2.1",  # TEST-NET-1
    "192.31.196.1",  # AS112-v4, marked globally reachable
    "192.52.193.1",  # AMT, marked globally reachable
    "192.88.99.1",  # 6to4 relay anycast
    "192.175.48.1",  # AS112 direct delegation, marked globally reachable
    "198.18.0.1",  # benchmarking
    "198.51.100.1",  # TEST-NET-2
    "203.0.113.1",  # TEST-NET-3
    "240.0.0.1",  # reserved
    "255.255.255.255",  # limited broadcast
    "::",  # unspecified
    "::127.0.0.1",  # IPv4-compatible loopback
    "::10.0.0.1",  # IPv4-compatible private
    "::169.254.169.254",  # IPv4-compatible metadata
    "::ffff:10.0.0.1",  # IPv4-mapped private
    "::ffff:169.254.169.254",  # IPv4-mapped metadata
    "::ffff:8.8.8.8",  # IPv4-mapped, even of a public address: reaches IPv4 by another name
    "::ffff:0:7f00:1",  # IPv4-translated (RFC 2765)
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215)
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "2002:808:808::1",  # 6to4 of a public address: still a tunnel to anything
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "2001:0:0:0:0:0:7f00:1",  # Teredo prefix with loopback inside
    "2001:2::1",  # benchmarking
    "2001:3::1",  # AMT
    "2001:4:112::1",  # AS112-v6
    "2001:20::1",  # ORCHIDv2
    "2001:db8::1",  # documentation
    "2620:4f:8000::1",  # AS112-v6 direct delegation
    "3fff::1",  # documentation (RFC 9637)
    "100::1",  # discard-only
    "5f00::1",  # SRv6 SIDs
    "fc00::1",  # unique local
    "fec0::1",  # deprecated site-local
    "fe80::1%1",  # link-local with a zone
    "ff02::1",  # multicast
    "not an address",
]


@pytest.mark.parametrize("address", SPECIAL_PURPOSE_ADDRESSES)
def test_cimd_special_purpose_address_is_refused(address: str) -> None:
    """The guard refuses every special-purpose block; ordinary public unicast still passes (below)."""
    assert public_only(address) is False


@pytest.mark.parametrize("address", ["1.1.1.1", "9.9.9.9", "2001:4860:4860::8888", "2a00:1450:4001::1"])
def test_cimd_ordinary_public_address_is_fetched(address: str) -> None:
    assert public_only(address) is True


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com",
        "https://example.com/",
        "https://example.com/c.json#x",
        "https://example.com/c.json?x=1",
        "https://user@example.com/c.json",
        "https://example.com:99999/c.json",
        "https://exa mple.com/c.json",
        "https://example.com/caf\u00e9.json",
        "https://ex\u00e4mple.com/c.json",
        "https://example.com/c\u200b.json",
    ],
)
def test_url_shape(url: str) -> None:
    with pytest.raises(CimdRefused):
        check_url(url)


@pytest.mark.parametrize(
    "client_id",
    [
        "https://127.0.0.1:{port}/x.json",
        "https://localhost:{port}/x.json",
        "http://169.254.169.254/latest/meta-data/",
        "https://[::ffff:127.0.0.1]:{port}/x.json",
        "https://[::127.0.0.1]:{port}/x.json",
        "https://[64:ff9b::7f00:1]:{port}/x.json",
        "https://[2002:7f00:1::1]:{port}/x.json",
        "https://[2001::7f00:1]:{port}/x.json",
    ],
)
def test_t61_live_server_refuses_internal_client_id_urls(server: LiveServer, client_id: str) -> None:
    _, challenge = pkce()
    params = {
        "response_type": "code",
        "client_id": client_id.format(port=server.port),
        "redirect_uri": "http://127.0.0.1/cb",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    with server.http() as raw:
        response = raw.get("/authorize", params=params)
        assert response.status_code == 400
        assert "location" not in response.headers
        meta = raw.get("/.well-known/oauth-authorization-server").json()
    assert meta["client_id_metadata_document_supported"] is True
    if params["client_id"].startswith("https://"):
        # Refused by the address guard, before any connection (not by a failed connect).
        assert f"{params['client_id']} refused: " in server.log()
        assert "resolves to a non-public address" in server.log().split(f"{params['client_id']} refused: ")[1]


class HangUpServer:
    """A loopback TCP server that hangs up on each client: at once (in the TLS handshake), or once the
    handshake is done and the request is in (`after_request`), with a reset when `reset`."""

    def __init__(self, folder: Path, *, after_request: bool, reset: bool) -> None:
        self.cert, key = self_signed(folder)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.cert, key)
        self.after_request, self.reset = after_request, reset
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with contextlib.suppress(OSError):
                if self.after_request:
                    conn = self.context.wrap_socket(conn, server_side=True)
                    conn.recv(4096)
                if self.reset:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not, on Linux)
        self.listener.close()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.mark.parametrize(
    ("after_request", "reset"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["closed-in-handshake", "reset-in-handshake", "closed-after-request", "reset-after-request"],
)
async def test_a_document_host_hanging_up_is_a_refusal_not_a_500(
    tmp_path: Path, after_request: bool, reset: bool
) -> None:
    """Found by a review (issue 20): a client_id URL whose host accepts, then closes or resets the
    connection, made the fetch raise anyio's BrokenResourceError (neither OSError nor SSLError): /authorize
    and /token answered 500 with a traceback, to anyone, and nothing was cached, so every retry fetched
    again. Invariant: it is a refusal (None), logged, and cached like any failed fetch."""
    server = HangUpServer(tmp_path, after_request=after_request, reset=reset)
    try:
        context = ssl.create_default_context(cafile=str(server.cert))
        fetcher = CimdFetcher((), address_allowed=lambda address: address == "127.0.0.1", ssl_context=context)
        url = f"https://127.0.0.1:{server.port}/client.json"
        assert await fetcher.client(url) is None
        assert url in fetcher._cache  # cached as a failure: a retry does not fetch again
        assert fetcher._cache[url][1] is None
    finally:
        server.close()
