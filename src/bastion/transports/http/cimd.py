"""Client ID Metadata Documents: a client whose `client_id` is an https URL (MCP 2025-11-25, CIMD).

SECURITY BOUNDARY (server-side request forgery). The URL comes from whoever opens /authorize, so:
- only `https://host/path` URLs (a path other than `/`, no userinfo, fragment or query) are fetched;
- the host is resolved once and every address must be ordinary public unicast (`public_only`): none of
  the IANA special-purpose blocks (loopback, private, link-local with cloud metadata at 169.254.169.254,
  CGNAT, documentation, benchmarking, AS112, AMT), no multicast, and no IPv6 form that carries an IPv4
  address (mapped, compatible, NAT64, 6to4, Teredo); the connection goes to the address that was checked
  (no second lookup a rebinding DNS could answer differently);
- TLS with certificate and hostname checks; no redirects (anything but 200 is a refusal); at most
  `MAX_DOCUMENT_BYTES`, within `FETCH_TIMEOUT_S` for the whole exchange;
- the document must name itself (`client_id` equal to the URL), list valid redirect URIs, and be a
  public client (`token_endpoint_auth_method` none): it holds no secret. Its `scope`, narrowed to the
  scopes bastion knows, bounds what may be granted to it, as a registered client's does.
Results, good or bad, are cached for a while, so a URL cannot be used to make bastion fetch in a loop;
one fetch per URL runs at a time (concurrent asks wait for it), and at most
`FETCHES_PER_HOST_PER_MINUTE` new ones from a host, so varied paths cannot either. A URL refused by its
shape costs no fetch and none of that budget, and a URL that has fetched well since start refreshes
outside it: a stranger spending a host's budget cannot make a working client unknown.
Name resolution runs in threads of its own, at most `MAX_LOOKUPS` at once counting those given up on
(one kept for known URLs); past that a lookup is refused at once: hostnames whose DNS never answers can
neither hold the event loop's shared executor nor pile up threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
import h11
from mcp.shared.auth import OAuthClientInformationFull
from pydantic import ValidationError

from bastion.tools.server import SCOPES
from bastion.transports.http.ratelimit import WindowLimiter
from bastion.transports.http.redirects import registration_problem

logger = logging.getLogger("bastion.http.cimd")

MAX_URL_CHARS: Final = 2000
MAX_DOCUMENT_BYTES: Final = 64 * 1024
FETCH_TIMEOUT_S: Final = 5.0
CACHE_TTL_S: Final = 300.0
FAILURE_TTL_S: Final = 60.0
MAX_CACHED: Final = 1000
FETCHES_PER_HOST_PER_MINUTE: Final = 30
"""New fetches from one host a minute: URLs that differ by their path (each its own cache entry) would
otherwise make bastion fetch from a host as fast as an unauthenticated client asks."""
MAX_LOOKUPS: Final = 4
"""Name lookups at once, including those still running after their fetch gave up; the last is kept
for URLs that have fetched well before."""


class CimdRefused(Exception):
    """The URL or its document is refused; the message says why (for the log, not the client)."""


def is_url_client_id(client_id: str) -> bool:
    return client_id.startswith("https://")


def check_url(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an acceptable client-id URL, or CimdRefused."""
    if len(url) > MAX_URL_CHARS:
        raise CimdRefused("client id URL is too long")
    if not url.isascii():
        # HTTP and TLS carry ASCII names and paths (an internationalized one in its encoded form); an
        # "é" reached h11 and gave /authorize and /token a 500. Also no look-alike client ids on the consent page.
        raise CimdRefused("client id URL must be ASCII: percent-encode its path and give its host in punycode")
    try:
        parts = urlsplit(url)
        port = parts.port or 443
    except ValueError:
        raise CimdRefused("client id URL is malformed") from None
    if parts.scheme != "https" or not parts.hostname:
        raise CimdRefused("client id URL must be https with a host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise CimdRefused("client id URL must not carry user information")
    if parts.fragment or "#" in url or parts.query:
        raise CimdRefused("client id URL must have no query or fragment")
    if parts.path in ("", "/"):
        raise CimdRefused("client id URL must have a path")
    if any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in url):
        raise CimdRefused("client id URL contains control characters or spaces")
    return parts.hostname, port, parts.path


# Every block of the IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890 and successors),
# whatever their "globally reachable" column says: a client's metadata document has no business on an
# AS112 or AMT address, and the ones marked reachable are the easiest to forget. Plus multicast and
# broadcast, which are in other registries. Checked 2026-12 against iana-ipv4/ipv6-special-registry.
SPECIAL_IPV4: Final = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network" (RFC 791)
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # shared address space, CGNAT (RFC 6598)
        "127.0.0.0/8",  # loopback (RFC 1122)
        "169.254.0.0/16",  # link-local, cloud metadata (RFC 3927)
        "172.16.0.0/12",  # private (RFC 1918)
        "192.0.0.0/24",  # IETF protocol assignments, incl. DS-Lite, NAT64 discovery (RFC 6890, 7335, 8880)
        "192.0.2.0/24",  # TEST-NET-1 (RFC 5737)
        "192.31.196.0/24",  # AS112-v4 (RFC 7535)
        "192.52.193.0/24",  # AMT (RFC 7450)
        "192.88.99.0/24",  # deprecated 6to4 relay anycast (RFC 7526)
        "192.168.0.0/16",  # private (RFC 1918)
        "192.175.48.0/24",  # AS112 direct delegation (RFC 7534)
        "198.18.0.0/15",  # benchmarking (RFC 2544)
        "198.51.100.0/24",  # TEST-NET-2 (RFC 5737)
        "203.0.113.0/24",  # TEST-NET-3 (RFC 5737)
        "224.0.0.0/4",  # multicast (RFC 5771)
        "240.0.0.0/4",  # reserved, incl. limited broadcast 255.255.255.255 (RFC 1112, RFC 919)
    )
)
# IPv6: only global unicast (2000::/3, RFC 4291 §2.4) is fetched, which already leaves out ::/8
# (unspecified, loopback, IPv4-mapped ::ffff:0:0/96, IPv4-compatible ::/96), 64:ff9b::/96 and
# 64:ff9b:1::/48 (NAT64, RFC 6052, 8215), 100::/64 (discard), 5f00::/16 (SRv6), fc00::/7, fe80::/10 and
# ff00::/8; the special blocks inside 2000::/3 are listed here.
GLOBAL_UNICAST_V6: Final = ipaddress.IPv6Network("2000::/3")
SPECIAL_IPV6: Final = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "2001::/23",  # IETF protocol assignments: Teredo 2001::/32, benchmarking, AMT, AS112, ORCHID, DRIP
        "2001:db8::/32",  # documentation (RFC 3849)
        "2002::/16",  # 6to4 (RFC 3056): the IPv4 address inside could be anything
        "2620:4f:8000::/48",  # AS112-v6 direct delegation (RFC 7534)
        "3fff::/20",  # documentation (RFC 9637)
    )
)


def public_only(address: str) -> bool:
    """True if `address` is ordinary public unicast: outside every special-purpose block above.

    An IPv6 address that embeds an IPv4 one (mapped, compatible, NAT64, 6to4, Teredo) is refused
    outright rather than judged by the address inside: each of those forms reaches whatever IPv4
    address it carries, loopback and metadata included.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return ip.is_global and not any(ip in net for net in SPECIAL_IPV4)
    if ip.scope_id is not None or ip not in GLOBAL_UNICAST_V6:
        return False
    return ip.is_global and not any(ip in net for net in SPECIAL_IPV6)


# A host that closes or resets the connection (in the TLS handshake, or after the request): anyio says so
# with its own exceptions, which are neither OSError nor SSLError.
_BROKEN: Final = (OSError, ssl.SSLError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream)


class CimdFetcher:
    """Fetches and caches client metadata documents under the SSRF rules above."""

    def __init__(
        self,
        app_callbacks: Iterable[str],
        *,
        address_allowed: Callable[[str], bool] = public_only,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.app_callbacks = tuple(app_callbacks)
        self.address_allowed = address_allowed
        self.ssl_context = ssl_context or ssl.create_default_context()
        self._cache: dict[str, tuple[float, OAuthClientInformationFull | None]] = {}
        self._fetching: dict[str, anyio.Event] = {}
        self._per_host = WindowLimiter(FETCHES_PER_HOST_PER_MINUTE, 60.0)
        # URLs whose document was good since start, most recent last. Their refreshes skip the host budget
        # (the cache and one-fetch-per-URL already bound them to one a URL every CACHE_TTL_S), so strangers
        # spending a host's budget on other paths cannot turn its working client into "unknown client".
        # Simpler than a budget per (address, host): the fetcher never learns who asks (/token asks too).
        self._known_good: dict[str, None] = {}
        self._lookups = 0
        self._lookups_lock = threading.Lock()

    async def client(self, url: str) -> OAuthClientInformationFull | None:
        """The client the document describes, or None if it is refused (the reason is logged)."""
        while (fetching := self._fetching.get(url)) is not None:
            await fetching.wait()  # one fetch per URL at a time: the others read its answer
        cached = self._cache.get(url)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        try:
            target = check_url(url)  # before the budget: a malformed URL costs no fetch, so it spends nothing
        except CimdRefused as exc:
            logger.warning("client metadata document %s refused: %s", url[:200], exc)
            self._remember(url, None, FAILURE_TTL_S)
            return None
        host = target[0]
        if url not in self._known_good and not self._per_host.allow(host):
            # Not cached: the host's own client gets its document once the minute has passed.
            logger.warning(
                "client metadata document %s not fetched: %s fetches from %s this minute",
                url[:200],
                FETCHES_PER_HOST_PER_MINUTE,
                host[:100],
            )
            return None
        self._fetching[url] = done = anyio.Event()
        try:
            return await self._fetch(url, target)
        finally:
            del self._fetching[url]
            done.set()

    async def _fetch(self, url: str, target: tuple[str, int, str]) -> OAuthClientInformationFull | None:
        try:
            info: OAuthClientInformationFull | None = await self._load(url, target)
            ttl = CACHE_TTL_S
        except CimdRefused as exc:
            logger.warning("client metadata document %s refused: %s", url[:200], exc)
            info, ttl = None, FAILURE_TTL_S
        if info is not None:
            self._known_good.pop(url, None)
            self._known_good[url] = None
            while len(self._known_good) > MAX_CACHED:
                self._known_good.pop(next(iter(self._known_good)))
        self._remember(url, info, ttl)
        return info

    def _remember(self, url: str, info: OAuthClientInformationFull | None, ttl: float) -> None:
        while len(self._cache) >= MAX_CACHED:
            self._cache.pop(next(iter(self._cache)))
        self._cache[url] = (time.monotonic() + ttl, info)

    async def _load(self, url: str, target: tuple[str, int, str]) -> OAuthClientInformationFull:
        host, port, path = target
        body = b""
        with anyio.move_on_after(FETCH_TIMEOUT_S) as scope:
            address = await self._resolve(host, port, known=url in self._known_good)
            body = await self._get(address, host, port, path)
        if scope.cancel_called:
            raise CimdRefused(f"no complete answer within {FETCH_TIMEOUT_S:g} s")
        return self._parse(url, body)

    async def _lookup(self, host: str, port: int, *, known: bool) -> list[str]:
        """The addresses of `host`, looked up in a daemon thread of its own, counted until it returns.

        Not the loop's default executor (a few threads, shared with all else that resolves), nor anyio's
        worker threads (one given up on stops counting against its limiter, but keeps running): a lookup
        whose DNS never answers holds its thread until the system resolver gives up, and counts till then.
        """
        with self._lookups_lock:
            if self._lookups >= (MAX_LOOKUPS if known else MAX_LOOKUPS - 1):
                raise CimdRefused(f"{self._lookups} name lookups are already running: try again shortly")
            self._lookups += 1
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[str]] = loop.create_future()

        def settle(addresses: list[str], error: Exception | None) -> None:
            if answer.done():
                return  # the fetch gave up on it
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(addresses)

        def run() -> None:
            addresses: list[str] = []
            error: Exception | None = None
            try:
                addresses = [str(found[4][0]) for found in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
            except (OSError, ValueError) as exc:  # gaierror; UnicodeError for a name IDNA cannot encode
                error = exc
            finally:
                with self._lookups_lock:
                    self._lookups -= 1
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(settle, addresses, error)

        try:
            threading.Thread(target=run, name="cimd-lookup", daemon=True).start()
        except RuntimeError:  # no thread to be had (the process limit)
            with self._lookups_lock:
                self._lookups -= 1
            raise CimdRefused("no thread for a name lookup: try again shortly") from None
        return await answer

    async def _resolve(self, host: str, port: int, *, known: bool = False) -> str:
        try:
            found = await self._lookup(host, port, known=known)
        except (OSError, ValueError) as exc:
            raise CimdRefused(f"cannot resolve {host}: {exc}") from None
        addresses = sorted(set(found))
        if not addresses:
            raise CimdRefused(f"{host} has no address")
        refused = [a for a in addresses if not self.address_allowed(a)]
        if refused:
            raise CimdRefused(f"{host} resolves to a non-public address ({refused[0]})")
        return addresses[0]

    async def _get(self, address: str, host: str, port: int, path: str) -> bytes:
        try:
            stream = await anyio.connect_tcp(address, port, ssl_context=self.ssl_context, tls_hostname=host)
        except _BROKEN as exc:
            raise CimdRefused(f"cannot connect to {host}: {exc or type(exc).__name__}") from None
        try:
            return await self._exchange(stream, host, port, path)
        except h11.ProtocolError as exc:
            raise CimdRefused(f"malformed HTTP answer: {exc}") from None
        except UnicodeError:  # `check_url` refuses it first: never a traceback if it ever does not
            raise CimdRefused("client id URL is not ASCII") from None
        except _BROKEN as exc:
            raise CimdRefused(f"the connection to {host} broke: {exc or type(exc).__name__}") from None
        finally:
            # No TLS goodbye: waiting for the peer's close_notify would let it hold us past the time limit.
            await anyio.aclose_forcefully(stream)

    async def _exchange(self, stream: anyio.abc.ByteStream, host: str, port: int, path: str) -> bytes:
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=16 * 1024)
        request = h11.Request(
            method="GET",
            target=path,
            headers=[
                ("Host", host if port == 443 else f"{host}:{port}"),
                ("Accept", "application/json"),
                ("Connection", "close"),
            ],
        )
        body = bytearray()
        await stream.send(connection.send(request) + connection.send(h11.EndOfMessage()))
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive(16 * 1024)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    data = b""
                connection.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                if event.status_code != 200:
                    raise CimdRefused(f"answered {event.status_code} (redirects are not followed)")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise CimdRefused(f"document larger than {MAX_DOCUMENT_BYTES} bytes")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return bytes(body)

    def _parse(self, url: str, body: bytes) -> OAuthClientInformationFull:
        try:
            document = json.loads(body)
        except ValueError:
            raise CimdRefused("document is not JSON") from None
        if not isinstance(document, dict):
            raise CimdRefused("document is not a JSON object")
        if document.get("client_id") != url:
            raise CimdRefused("document's client_id is not its own URL")
        method = document.get("token_endpoint_auth_method", "none")
        if method != "none":
            raise CimdRefused("only public clients (token_endpoint_auth_method none) may use a metadata document")
        uris = document.get("redirect_uris")
        if not isinstance(uris, list) or not uris or len(uris) > 5 or not all(isinstance(u, str) for u in uris):
            raise CimdRefused("redirect_uris must list 1 to 5 URIs")
        for uri in uris:
            problem = registration_problem(uri, self.app_callbacks)
            if problem is not None:
                raise CimdRefused(problem)
        grants = document.get("grant_types", ["authorization_code", "refresh_token"])
        if not isinstance(grants, list) or not set(grants) <= {"authorization_code", "refresh_token"}:
            raise CimdRefused("grant_types may only be authorization_code, refresh_token")
        name = document.get("client_name")
        # The document's `scope` bounds what the consent page offers, as a registered client's does;
        # unknown scopes are dropped (as at /register), and none known means no bound.
        asked = document.get("scope")
        known = [scope for scope in SCOPES if isinstance(asked, str) and scope in asked.split()]
        try:
            return OAuthClientInformationFull.model_validate(
                {
                    "client_id": url,
                    "redirect_uris": uris,
                    "token_endpoint_auth_method": "none",
                    "grant_types": grants,
                    "response_types": ["code"],
                    "client_name": name[:200] if isinstance(name, str) else None,
                    "scope": " ".join(known) or None,
                }
            )
        except ValidationError:
            raise CimdRefused("document metadata is not valid") from None
