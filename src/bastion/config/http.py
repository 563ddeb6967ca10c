"""`[http]`: Streamable HTTP serving and the built-in OAuth 2.1 authorization server.

Private: import these names from `bastion.config`.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Final
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from bastion.config.base import Model

# Known native-app callbacks (RFC 8252 private-use schemes) accepted at registration by exact match.
_PORT: Final = re.compile(r"[0-9]{1,5}")
"""ASCII digits only: `str.isdigit` passes '²' (which `int` refuses) and other scripts' digits (which it takes)."""


def split_listen(value: str) -> tuple[str, int] | None:
    """HOST:PORT (IPv6 in brackets) as (host, port) with a port from 1 to 65535, or None."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


DEFAULT_APP_CALLBACKS: Final = ("cursor://anysphere.cursor-mcp/oauth/callback",)


class HttpConfig(Model):
    """Streamable HTTP serving and the built-in OAuth 2.1 authorization server (`bastion serve --http`)."""

    public_url: str | None = None
    """The origin clients use, e.g. https://bastion.example.com (no path). Drives the issuer, the resource
    URL (`<public_url>/mcp`) and the Host/Origin values accepted (DNS-rebinding protection)."""
    listen: str = "127.0.0.1:8765"
    """HOST:PORT to bind; `--listen` overrides it."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth: bool = True
    """Dangerous when false: /mcp then needs no token. Refused unless `listen` is a loopback address."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks (e.g. 127.0.0.1, 10.0.0.0/8) of reverse proxies in front of bastion whose
    X-Forwarded-For and X-Forwarded-Proto are believed. Empty (the default): those headers are ignored and
    each connection's own address is what the per-address limits count, so a process on this host cannot
    claim to be many addresses. Set it only to a proxy that overwrites (not appends to) X-Forwarded-For."""
    extra_origins: tuple[str, ...] = ()
    """Browser origins besides public_url allowed to call /mcp (e.g. the MCP Inspector's http://localhost:6274)."""
    app_callbacks: tuple[str, ...] = DEFAULT_APP_CALLBACKS
    """Non-https redirect URIs a client may register, matched exactly."""
    max_clients: Annotated[int, Field(ge=1, le=100_000)] = 200
    registrations_per_ip_per_hour: Annotated[int, Field(ge=1, le=10_000)] = 20
    unused_client_ttl_s: Annotated[float, Field(gt=0)] = 86_400.0
    unused_client_min_age_s: Annotated[float, Field(ge=60, le=86_400)] = 900.0
    """When the client table is full, never-used clients older than this are evicted (oldest first) to
    make room: longer than an authorization request lives (10 minutes), so one under way is kept."""
    code_lifetime_s: Annotated[float, Field(ge=60, le=120)] = 60.0
    access_token_lifetime_s: Annotated[float, Field(ge=60, le=86_400)] = 3600.0
    refresh_token_lifetime_s: Annotated[float, Field(ge=60)] = 30 * 86_400.0
    """A refresh token unused this long expires; each rotation starts a new one."""
    refresh_reuse_grace_s: Annotated[float, Field(ge=0, le=60)] = 10.0
    """A rotated refresh token presented again by the same client within this time gets the same new pair
    (two sessions sharing one credential store refresh at once); later, reuse revokes the grant. 0: none."""
    grant_lifetime_s: Annotated[float, Field(ge=60)] = 90 * 86_400.0
    """After this, the client must ask the administrator again, whatever its refresh tokens."""
    login_failures_before_backoff: Annotated[int, Field(ge=1, le=100)] = 5
    login_backoff_max_s: Annotated[float, Field(gt=0, le=86_400)] = 900.0
    global_login_failures_per_minute: Annotated[int, Field(ge=1, le=10_000)] = 30
    """Login attempts from all addresses in a minute before addresses that have failed wait for the minute
    to pass; an address with no failure on record may still log in."""
    authorize_per_ip_per_minute: Annotated[int, Field(ge=1, le=100_000)] = 30
    """/authorize requests from one address (an IPv6 /64) in a minute; more get 429."""
    pending_authorizations_per_ip: Annotated[int, Field(ge=1, le=1000)] = 10
    """Authorization requests from one address waiting for the administrator; a new one past it gets 429
    (none waiting is dropped)."""
    admin_session_lifetime_s: Annotated[float, Field(ge=60, le=86_400)] = 3600.0
    max_connections: Annotated[int, Field(ge=16, le=100_000)] = 1024
    """Open HTTP connections at most (lowered to fit the open-file limit). Past it, a new connection closes
    the one that has waited longest for its request; when all are being served, the new one is refused."""
    request_head_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    """A request's head (line and headers) must arrive within this of the connection opening or of the
    previous response; a slow sender (slowloris) is disconnected. It also closes an idle kept-alive
    connection: keep it above clients' pool expiry (5 s for httpx), or a reused one may be cut mid-request."""
    request_body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A request's body must arrive within this, plus its declared length at 32 KiB/s."""
    max_unsent_mib: Annotated[int, Field(ge=1, le=1 << 20)] = 64
    """Answers written that their clients have not read yet (the server's buffers and the kernel's send
    queues), across connections, in MiB at most. Past it, the connections that have held theirs longest are
    reset: a client that does not read its answers cannot make the server hold them (the calls ran and are
    audited; only the unread answers are lost)."""
    send_stall_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A connection holding an answer of which its client reads nothing for this long is reset."""
    max_request_bodies_mib: Annotated[int, Field(ge=8, le=1 << 20)] = 32
    """Request bodies at /mcp being read or served at once, across clients, in MiB at most (each counts
    its declared length). A request past it waits up to `request_body_timeout_s` for room, then gets 503."""
    max_sessions_per_grant: Annotated[int, Field(ge=1, le=10_000)] = 64
    """Open MCP sessions (2025-11-25 handshake era) per grant. A new one past it closes that grant's
    session idle the longest; when none is idle it gets 429."""
    preview_listen: str | None = None
    """HOST:PORT of a second listener that serves preview URLs (expose_port) and nothing else; unset: no
    preview URLs. A separate origin on purpose: a page a sandbox serves must never share the origin of
    /admin and /oauth (its scripts could read those pages with the administrator's cookies). Same host
    as `public_url`, another port: browsers send the login cookie to every port of a host, which is how a
    non-public preview knows the administrator."""
    preview_url: str | None = None
    """The origin browsers use for `preview_listen`, e.g. https://bastion.example.com:8443; on a loopback
    `preview_listen` it may be left out (http://HOST:PORT)."""
    preview_public_allowed: bool = False
    """Dangerous when true: expose_port(public=true) gives a URL anyone who has it can open, with no login."""
    preview_lifetime_s: Annotated[float, Field(ge=60, le=30 * 86_400)] = 8 * 3600.0
    """A preview URL stops working this long after expose_port (or when its sandbox closes)."""
    preview_max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 16 << 20
    """A request body to a preview past this gets 413."""
    preview_max_response_bytes: Annotated[int, Field(ge=1024, le=1 << 34)] = 64 << 20
    """A response body from a sandbox's app is cut off past this."""
    preview_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A sandbox's app must answer (headers) within this, and send each further chunk within it."""
    preview_requests_per_minute: Annotated[int, Field(ge=1, le=1_000_000)] = 1200
    """Requests (and WebSocket opens) per minute, per preview URL and per client address; more get 429."""

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise ValueError(f"public_url {value!r} must be an http(s) origin such as https://bastion.example.com")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"public_url {value!r} must have no path, query or fragment: bastion serves at its root")
        if parts.scheme == "http" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"public_url {value!r} is plain http on a non-loopback host: use https")
        return value.rstrip("/")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        if split_listen(value) is None:
            raise ValueError(f"listen {value!r} must be HOST:PORT, e.g. 127.0.0.1:8765")
        return value

    @field_validator("preview_listen")
    @classmethod
    def _check_preview_listen(cls, value: str | None) -> str | None:
        return None if value is None else cls._check_listen(value)

    @field_validator("preview_url")
    @classmethod
    def _check_preview_url(cls, value: str | None) -> str | None:
        return None if value is None else cls._check_public_url(value)

    @field_validator("trusted_proxies")
    @classmethod
    def _check_trusted_proxies(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies entry {value!r} must be an IP address or network such as 10.0.0.0/8"
                ) from None
        return values

    @field_validator("app_callbacks")
    @classmethod
    def _check_app_callbacks(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            scheme = value.partition(":")[0].lower()
            if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) or scheme in ("javascript", "data", "file", "vbscript"):
                raise ValueError(f"app callback {value!r} must be an absolute URI with a private-use scheme")
        return values
