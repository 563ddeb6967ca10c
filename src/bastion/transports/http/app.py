"""Assemble the HTTP application: /mcp (the SDK's streamable transport), the authorization server, pages.

Layers, outermost first:
0. `Observe`: /healthz, /readyz and /metrics, before the Host check (probes use 127.0.0.1; /metrics
   checks Host and its own access rule itself).
1. `HostGuard`: the Host header must name `public_url` (DNS-rebinding protection for every route; the
   SDK's transport checks Host and Origin again for /mcp). A loopback `public_url` is also reached as
   127.0.0.1, localhost and [::1] on its port: one server, whose protected-resource metadata and 401
   challenge name the URL the client used (its SDK checks that), and whose tokens stay bound to
   `<public_url>/mcp`.
2. `AccessLog`: method, path (never the query string, which could carry a token), status, address.
   Inside it `BrowserStepGuard`: /authorize, the login and consent pages and every /oauth and /admin
   form POST refuse what another page sends (Fetch Metadata), before any limit counts it.
3. `McpLane` (lane.py): a POST to /mcp (every tool call) gets the bearer check and the auth context
   below in one layer and goes straight to the /mcp endpoint of 5; everything else goes to Starlette.
4. The SDK's `AuthenticationMiddleware` with `BearerAuthBackend` over bastion's provider (the token is
   looked up by its digest, checked for expiry, revocation and resource), and `AuthContextMiddleware`.
5. Routes. /mcp: CORS for the configured origins (cors.py: Starlette's for a request with an Origin),
   then `RequireToken` (401/403), then `GrantCalls` (the 2026-07-28 era's calls in flight, by grant), then
   `SessionCap` (sessions per grant), then the SDK's app.
Beside them, with auth on, `end_revoked_forever` ends the MCP sessions and calls in flight of revoked or
expired grants.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import anyio
from mcp.server.auth.middleware.auth_context import AuthContextMiddleware
from mcp.server.auth.middleware.bearer_auth import BearerAuthBackend
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, request_response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bastion.app import Services
from bastion.config import Config
from bastion.safety.errors import ConfigError
from bastion.tools import CallRunner
from bastion.tools.server import SCOPES, BastionServer
from bastion.transports.http import pages
from bastion.transports.http.admin_pages import AdminPages
from bastion.transports.http.bodies import BodyBudget, Budgeted
from bastion.transports.http.cors import McpCors
from bastion.transports.http.dashboard import Dashboard
from bastion.transports.http.endpoints import (
    Registration,
    TokenEndpoint,
    authorization_server_metadata,
    protected_resource_metadata,
)
from bastion.transports.http.flow import (
    NOT_A_NAVIGATION,
    NOT_OUR_FORM,
    AuthorizationFlow,
    not_a_navigation,
    posted_by_another_page,
    speculative,
)
from bastion.transports.http.lane import McpLane
from bastion.transports.http.observe import Observe, read_scrape_token
from bastion.transports.http.password import AdminCredential, finish_cut_short_change
from bastion.transports.http.preview import PreviewApp
from bastion.transports.http.provider import BastionAuthProvider, Endpoints
from bastion.transports.http.ratelimit import LoginLimiter
from bastion.transports.http.scopes import RequireToken, ScopeMiddleware
from bastion.transports.http.sessions import GrantCalls, SessionCap, end_revoked_forever
from bastion.transports.http.store import AuthStore

access_logger = logging.getLogger("bastion.http.access")
PURGE_INTERVAL_S: Final = 300.0
_MCP_HEADERS: Final = ["authorization", "content-type", "mcp-session-id", "mcp-protocol-version", "last-event-id"]


def cors_middleware(handler: Callable[[Request], Awaitable[Response]], methods: list[str]) -> ASGIApp:
    """CORS for the endpoints browser-based clients call (MCP Inspector): any origin, never credentials."""
    return CORSMiddleware(
        request_response(handler),
        allow_origins=["*"],
        allow_methods=methods,
        allow_headers=["authorization", "content-type", "mcp-protocol-version"],
    )


LOOPBACK_NAMES: Final = ("127.0.0.1", "localhost", "[::1]")
"""The names of this machine a browser or client may use for a loopback `public_url`: one server."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def endpoints_for(config: Config, listen: str | None = None) -> Endpoints:
    """Issuer and resource from `public_url`; on a loopback listen address it may be left out, and a
    loopback `public_url` follows `--listen` (the server is reached where it listens)."""
    public_url = config.http.public_url
    address = listen or config.http.listen
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if public_url is None:
        if not _is_loopback(host):
            raise ConfigError('[http] public_url is not set: add it (e.g. public_url = "https://bastion.example.com")')
        public_url = f"http://{_url_host(host)}:{port}"
    elif listen is not None and is_loopback_url(public_url):
        public_url = _follow_listen(public_url, host, port)
    return Endpoints(issuer=public_url, resource=f"{public_url}/mcp", aliases=resource_aliases(public_url))


def _follow_listen(public_url: str, host: str, port: str) -> str:
    if _is_loopback(host):
        return f"http://{_url_host(host)}:{port}"
    if host in ("0.0.0.0", "::"):  # noqa: S104 (a wildcard listen is reached through public_url's host)
        return f"http://{_url_host(urlsplit(public_url).hostname or '127.0.0.1')}:{port}"
    raise ConfigError(
        f"public_url {public_url} is a loopback URL but --listen {host}:{port} is not: "
        "set [http] public_url to the URL clients use"
    )


def is_loopback_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "http" and _is_loopback(parts.hostname or "")


def loopback_origins(public_url: str) -> list[str]:
    """`public_url` and, when it is a loopback URL, the same port under each of LOOPBACK_NAMES."""
    if not is_loopback_url(public_url):
        return [public_url]
    port = urlsplit(public_url).port
    suffix = f":{port}" if port is not None else ""
    return [public_url, *(o for o in (f"http://{n}{suffix}" for n in LOOPBACK_NAMES) if o != public_url)]


def resource_aliases(public_url: str) -> tuple[str, ...]:
    """The MCP URLs that name this server besides `<public_url>/mcp` (loopback aliases only).

    RFC 8707 binds a token to a resource; a client that reached the server as localhost asks for
    http://localhost:P/mcp (its SDK checks the protected-resource metadata against the URL it was
    given). Tokens are still stored with, and checked against, the canonical `<public_url>/mcp`.
    """
    return tuple(f"{origin}/mcp" for origin in loopback_origins(public_url)[1:])


def _hosts_of(origin: str) -> list[str]:
    """The Host header values that name `origin` (with and without its default port)."""
    parts = urlsplit(origin)
    if parts.port is not None:
        return [parts.netloc]
    return [parts.netloc, f"{parts.netloc}:{443 if parts.scheme == 'https' else 80}"]


def allowed_hosts(public_url: str) -> list[str]:
    return [host for origin in loopback_origins(public_url) for host in _hosts_of(origin)]


def origin_of(public_url: str) -> str:
    parts = urlsplit(public_url)
    return f"{parts.scheme}://{parts.netloc}"


def _host_of(scope: Scope) -> str:
    for key, value in scope.get("headers", ()):
        if key == b"host":
            return str(value.decode("latin-1").lower())
    return ""


class ByHost:
    """One ASGI app per Host (HostGuard has admitted it): documents that name the URL the client used."""

    def __init__(self, apps: dict[str, ASGIApp], default: ASGIApp) -> None:
        self.apps = apps
        self.default = default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.apps.get(_host_of(scope), self.default)(scope, receive, send)


def per_origin(public_url: str, make: Callable[[str], ASGIApp]) -> ASGIApp:
    """`make(origin)` for `public_url` and each loopback alias, chosen by the request's Host."""
    default = make(public_url)
    apps: dict[str, ASGIApp] = {}
    for origin in loopback_origins(public_url):
        app = default if origin == public_url else make(origin)
        for host in _hosts_of(origin):
            apps[host] = app
    return ByHost(apps, default)


class HostGuard:
    """421 for a Host that is not ours; 403 for a foreign Origin at /mcp (a rebinding or cross-site page)."""

    def __init__(self, app: ASGIApp, hosts: list[str], origins: list[str]) -> None:
        self.app = app
        self.hosts = {h.lower() for h in hosts}
        self.origins = set(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if host not in self.hosts and scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        if host not in self.hosts:
            await _plain(send, 421, b"Misdirected Request: unknown Host\n")
            return
        origin = headers.get(b"origin")
        if origin is not None and scope["path"].startswith("/mcp") and origin.decode("latin-1") not in self.origins:
            await _plain(send, 403, b"Forbidden: Origin not allowed\n")
            return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            # The client left (or was cut off, a slow body) while its request was read: nobody to answer.
            return


async def _plain(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


NAVIGATION_STEPS: Final = ("/authorize", "/oauth/login", "/oauth/consent", "/admin/login")
"""Pages only the browser's own navigation opens: each /authorize counts against the browser's device
and adds a pending request."""
FORM_PREFIXES: Final = ("/oauth/", "/admin/")
"""Where every POST is a form of bastion's own pages (login, consent, the administrator's decisions)."""


class BrowserStepGuard:
    """403 for a request another page sent to the login and consent steps, before any limit counts it.

    A sandbox's preview page (another port of this host, same-site) could otherwise post wrong passwords
    with the administrator's device cookie (its back-off, up to `login_backoff_max_s`) and fetch
    /authorize until the device's pending requests are full. Fetch Metadata tells such requests from the
    administrator's own: a form POST must come from bastion's origin, a page must be a top-level navigation.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await pages.error_page(refusal, status=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _refusal(scope: Scope) -> str | None:
        path: str = scope["path"]
        if scope["method"] == "POST":
            if path.startswith(FORM_PREFIXES) and posted_by_another_page(Headers(scope=scope)):
                return NOT_OUR_FORM
        elif path in NAVIGATION_STEPS:  # GET and HEAD
            headers = Headers(scope=scope)
            if not_a_navigation(headers) or speculative(headers):
                return NOT_A_NAVIGATION
        return None


class CountCalls:
    """Keeps `CallRunner.requests_in_flight` to the /mcp POSTs being served, from the moment they arrive."""

    def __init__(self, app: ASGIApp, runner: CallRunner) -> None:
        self.app = app
        self.runner = runner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/mcp":
            await self.app(scope, receive, send)
            return
        self.runner.requests_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.runner.requests_in_flight -= 1


class AccessLog:
    """One line per request; the path only, so a token put in a query string never reaches a log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not access_logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info(
                "%s %s %s %d %.1fms",
                client[0],
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - started) * 1000,
            )


class CachedTokenVerifier:
    """The provider's token check, remembered until the database changes.

    A token's record only changes by a write (revocation, rotation, a grant revoked by `bastion admin`
    in another process), and SQLite's `PRAGMA data_version` changes on this watcher connection whenever
    another connection (the store's, or another process's) commits. So an answer is reused while the
    version is the same, and dropped at the first commit: a revocation takes effect at the next request,
    as without the cache. The token's expiry is checked at every use, its grant's (not in the answer)
    within `RECHECK_S`. Costs one PRAGMA (~3 us) instead of a digest, a join and two models per request.
    """

    MAX_ENTRIES: Final = 4096
    RECHECK_S: Final = 30.0

    def __init__(self, provider: BastionAuthProvider, db_path: Path) -> None:
        self.provider = provider
        self.watch = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        self.version = -1
        self.known: dict[str, tuple[AccessToken, float]] = {}

    async def verify_token(self, token: str) -> AccessToken | None:
        version = int(self.watch.execute("PRAGMA data_version").fetchone()[0])
        if version != self.version:
            self.known.clear()
            self.version = version
        # The recheck's age on the monotonic clock (a clock set back must not stretch it); expiry on the
        # wall clock, as the database stores it.
        checked = time.monotonic()
        found, checked_at = self.known.get(token, (None, 0.0))
        if found is None or checked - checked_at > self.RECHECK_S:
            found = await self.provider.load_access_token(token)
            if found is None:
                self.known.pop(token, None)
                return None
            if len(self.known) >= self.MAX_ENTRIES:
                self.known.clear()
            self.known[token] = (found, checked)
        if found.expires_at is not None and found.expires_at < time.time():
            return None
        return found

    def close(self) -> None:
        self.watch.close()


@dataclass
class HttpApp:
    app: ASGIApp
    endpoints: Endpoints
    store: AuthStore | None


def build_http_app(services: Services, server: BastionServer, *, listen: str | None = None) -> HttpApp:
    """The ASGI app for `bastion serve --http`. The caller runs it (uvicorn) and closes `store`."""
    config = services.config
    endpoints = endpoints_for(config, listen)
    # Before anything is opened: a bad token file stops the start with nothing to close.
    token_file = config.metrics.token_file
    scrape_digest = read_scrape_token(token_file) if token_file is not None else None
    public_url = endpoints.issuer
    hosts = allowed_hosts(public_url)
    origins = [*loopback_origins(public_url), *config.http.extra_origins]
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
    )
    server.streamable_http_app(streamable_http_path="/mcp", transport_security=security)
    session_manager = server.session_manager
    bodies = BodyBudget(config.http.max_request_bodies_mib << 20, config.http.request_body_timeout_s)
    mcp_app: ASGIApp = StreamableHTTPASGIApp(session_manager)
    routes: list[Route] = []
    middleware: list[Middleware] = []
    store: AuthStore | None = None
    calls: GrantCalls | None = None
    verifier: CachedTokenVerifier | None = None
    backend: BearerAuthBackend | None = None
    if config.http.auth:
        store = AuthStore(config.db_path)
        finish_cut_short_change(config.admin_hash_path, store)
        provider = BastionAuthProvider(store, config.http, endpoints)
        credential = AdminCredential(config.admin_hash_path)
        limiter = LoginLimiter(
            free=config.http.login_failures_before_backoff,
            max_s=config.http.login_backoff_max_s,
            global_per_minute=config.http.global_login_failures_per_minute,
            metrics=services.metrics,
        )
        flow = AuthorizationFlow(provider, credential, limiter)
        tokens = TokenEndpoint(provider)
        registration = Registration(provider)
        admin = AdminPages(store, credential, limiter, config, rebind=provider.rebind_browser, audit=services.audit)
        dashboard = Dashboard(admin, services.sandboxes, services.audit)
        as_meta = authorization_server_metadata(endpoints.issuer)
        get_options = ["GET", "OPTIONS"]
        post_options = ["POST", "OPTIONS"]
        # RFC 9728 §3.3: the document's `resource` must be the URL the client used (clients check it).
        pr_meta = per_origin(
            public_url,
            lambda origin: cors_middleware(
                protected_resource_metadata(endpoints.issuer, f"{origin}/mcp").handle, get_options
            ),
        )
        routes += [
            Route(
                "/.well-known/oauth-authorization-server",
                cors_middleware(as_meta.handle, get_options),
                methods=get_options,
            ),
            Route("/.well-known/oauth-protected-resource/mcp", pr_meta, methods=get_options),
            Route("/.well-known/oauth-protected-resource", pr_meta, methods=get_options),
            Route("/register", cors_middleware(registration.handle, post_options), methods=post_options),
            Route("/token", cors_middleware(tokens.token, post_options), methods=post_options),
            Route("/revoke", cors_middleware(tokens.revoke, post_options), methods=post_options),
            Route("/authorize", flow.authorize, methods=["GET"]),
            Route("/oauth/login", flow.login_get, methods=["GET"]),
            Route("/oauth/login", flow.login_post, methods=["POST"]),
            Route("/oauth/consent", flow.consent_get, methods=["GET"]),
            Route("/oauth/consent", flow.consent_post, methods=["POST"]),
            *admin.routes(),
            *dashboard.routes(),
        ]
        server.middleware.append(ScopeMiddleware(server))
        calls = GrantCalls(SessionCap(mcp_app, session_manager, config.http.max_sessions_per_grant))
        mcp_app = per_origin(
            public_url,
            lambda origin: RequireToken(
                calls,
                tool_scopes=server.tool_scopes,
                resource_metadata=f"{origin}/.well-known/oauth-protected-resource/mcp",
                scopes=" ".join(SCOPES),
                bodies=bodies,
            ),
        )
        # No resource_server_url: load_access_token already requires the canonical resource, exactly (the
        # SDK's check would parse both URLs with pydantic at every request).
        verifier = CachedTokenVerifier(provider, config.db_path)
        backend = BearerAuthBackend(verifier)
        middleware = [Middleware(AuthenticationMiddleware, backend=backend), Middleware(AuthContextMiddleware)]
    if not config.http.auth:  # every local client is one grant to the caps
        mcp_app = Budgeted(SessionCap(mcp_app, session_manager, config.http.max_sessions_per_grant), bodies)
    mcp_endpoint = McpCors(
        mcp_app,
        allow_origins=origins,
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=_MCP_HEADERS,
        expose_headers=["WWW-Authenticate", "Mcp-Session-Id", "Mcp-Protocol-Version"],
    )
    # First: the router tries routes in order, and nearly every request is for /mcp.
    routes.insert(0, Route("/mcp", mcp_endpoint, methods=["GET", "POST", "DELETE", "OPTIONS"]))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with session_manager.run(), anyio.create_task_group() as tasks:
            if store is not None and calls is not None:
                tasks.start_soon(_purge_forever, store, config.http.unused_client_ttl_s)
                tasks.start_soon(end_revoked_forever, session_manager, calls, store.live_grants)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                if verifier is not None:
                    verifier.close()

    starlette = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    lane = McpLane(starlette, mcp_endpoint, backend)
    guarded_app = HostGuard(CountCalls(AccessLog(BrowserStepGuard(lane)), server.runner), hosts, origins)
    port = int((listen or config.http.listen).rpartition(":")[2])
    app = Observe(guarded_app, services, hosts, port, scrape_digest)
    return HttpApp(app=app, endpoints=endpoints, store=store)


def build_preview_app(services: Services, built: HttpApp, listen: str) -> tuple[ASGIApp, str]:
    """The preview listener's app and origin (`[http] preview_listen`); makes expose_port give URLs there.

    Raises:
        ConfigError: the preview origin is missing (non-loopback) or is the origin of the admin pages.
    """
    http = services.config.http
    host, _, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    origin = http.preview_url
    if origin is None:
        if not _is_loopback(host):
            raise ConfigError("[http] preview_url is not set: add it (e.g. https://bastion.example.com:8443)")
        origin = f"http://{_url_host(host)}:{port}"
    main = urlsplit(built.endpoints.issuer)
    preview = urlsplit(origin)
    if origin_of(origin) == origin_of(built.endpoints.issuer):
        raise ConfigError("[http] preview_listen must be another origin than public_url: give it another port")
    if http.auth and preview.hostname != main.hostname:
        # The login cookie is host-only: only another port of the same host receives it.
        raise ConfigError(
            "[http] preview_url must be public_url's host on another port (the login cookie is sent there)"
        )
    if services.previews is None:
        raise ConfigError("preview URLs need sandboxes: set [sandboxes] enabled = true or leave preview_listen out")
    services.previews.base_url = origin
    app = PreviewApp(services.previews, http, services.audit, built.store, origin_of(origin))
    return HostGuard(app, allowed_hosts(origin), []), origin


async def _purge_forever(store: AuthStore, unused_client_ttl_s: float) -> None:
    while True:
        await anyio.sleep(PURGE_INTERVAL_S)
        store.purge_expired()
        store.expire_unused_clients(unused_client_ttl_s)
