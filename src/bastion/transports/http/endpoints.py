"""The machine-facing OAuth endpoints: /token, /revoke, /register and the metadata documents.

SECURITY BOUNDARY. /token (RFC 6749 §4.1.3, §6; OAuth 2.1; RFC 7636; RFC 8707):
- form bodies only, no repeated parameters, client authenticated as registered (secrets compared as
  SHA-256 digests in constant time); a failed client authentication is 401 invalid_client;
- a code is single-use and consumed atomically; presenting a used code revokes its whole grant;
- a refresh token is single-use and rotated; presenting a rotated one revokes the whole grant (reuse
  detection, RFC 9700 §4.14.2), except within `refresh_reuse_grace_s` (10 s) of its rotation, when the
  same client asking for the same scopes gets the same new pair again: two sessions sharing one
  credential store refresh at once, and must not revoke each other. The successor is kept in memory only;
- `resource`, when sent, must be this server's MCP URL (invalid_target otherwise); tokens are bound to it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote

from mcp.server.auth.handlers.metadata import MetadataHandler, ProtectedResourceMetadataHandler
from mcp.server.auth.handlers.register import RegistrationHandler
from mcp.server.auth.settings import ClientRegistrationOptions
from mcp.shared.auth import OAuthClientInformationFull, OAuthMetadata, ProtectedResourceMetadata
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bastion.tools.server import SCOPES
from bastion.transports.http.flow import client_ip, declared_length, single_params
from bastion.transports.http.provider import MAX_REDIRECT_URIS, BastionAuthProvider, registering_ip
from bastion.transports.http.ratelimit import WindowLimiter, address_key
from bastion.transports.http.redirects import normal_form, registration_problem
from bastion.transports.http.store import IssuedTokens, digest

logger = logging.getLogger("bastion.http.endpoints")

MAX_BODY_BYTES: Final = 64 * 1024
_MAX_TRACKED_ADDRESSES: Final = 10_000
_MAX_SUCCESSORS: Final = 10_000
ROTATIONS_PER_MINUTE: Final = 60
"""Refresh-token rotations per grant and minute (a client refreshes about once an hour); past it 429: each
rotation writes rows and costs a sync."""
_VERIFIER: Final = re.compile(r"[A-Za-z0-9._~-]{43,128}")
_NO_STORE: Final = {"Cache-Control": "no-store", "Pragma": "no-cache", "X-Content-Type-Options": "nosniff"}


def oauth_error(error: str, description: str, status: int = 400, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"error": error, "error_description": description}, status_code=status, headers={**_NO_STORE, **(headers or {})}
    )


async def read_limited(request: Request, limit: int) -> bytes | None:
    if declared_length(request) > limit:
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return body


class ClientAuthFailed(Exception):
    def __init__(self, description: str, *, basic: bool) -> None:
        super().__init__(description)
        self.description = description
        self.basic = basic


@dataclass(frozen=True)
class _Successor:
    """The pair a refresh token was rotated into, kept in memory for the grace window only."""

    client_id: str
    scopes: tuple[str, ...]
    issued: IssuedTokens
    until: float


class TokenEndpoint:
    """/token and /revoke."""

    def __init__(self, provider: BastionAuthProvider) -> None:
        self.provider = provider
        # digest of a rotated refresh token -> its successor. In memory only (one server per state
        # folder): no token is ever stored in the clear, and a restart just ends the grace windows.
        self._successors: dict[str, _Successor] = {}
        self._rotations = WindowLimiter(ROTATIONS_PER_MINUTE, 60.0)  # per grant

    async def _form(self, request: Request) -> dict[str, str] | Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
            return oauth_error("invalid_request", "the body must be application/x-www-form-urlencoded")
        body = await read_limited(request, MAX_BODY_BYTES)
        if body is None:
            return oauth_error("invalid_request", "the body is too large", 413)
        params = single_params(body.decode("utf-8", "replace"))
        if params is None:
            return oauth_error("invalid_request", "a parameter is repeated or malformed")
        return params

    async def _client(self, request: Request, form: dict[str, str]) -> OAuthClientInformationFull:
        """Authenticate the client as it registered (RFC 6749 §2.3)."""
        header = request.headers.get("authorization", "")
        basic = header[:6].lower() == "basic "
        basic_id = basic_secret = None
        if basic:
            try:
                decoded = base64.b64decode(header[6:], validate=True).decode("utf-8")
                raw_id, sep, raw_secret = decoded.partition(":")
                if not sep:
                    raise ValueError("no colon")
                basic_id, basic_secret = unquote(raw_id), unquote(raw_secret)
            except (ValueError, UnicodeDecodeError, binascii.Error):
                raise ClientAuthFailed("malformed Basic credentials", basic=True) from None
        client_id = form.get("client_id") or basic_id or ""
        if basic_id is not None and client_id != basic_id:
            raise ClientAuthFailed("client_id does not match the Basic credentials", basic=True)
        client = await self.provider.get_client(client_id) if client_id else None
        if client is None:
            raise ClientAuthFailed("unknown client", basic=basic)
        method = client.token_endpoint_auth_method or "client_secret_post"
        stored = self.provider.client_secret_digest(client_id)
        if method == "none":
            if basic or "client_secret" in form:
                raise ClientAuthFailed("this client is public: send no secret", basic=basic)
            return client
        presented = basic_secret if method == "client_secret_basic" else form.get("client_secret")
        if method == "client_secret_basic" and not basic:
            raise ClientAuthFailed("this client authenticates with HTTP Basic", basic=False)
        if not presented or not stored or not hmac.compare_digest(digest(presented), stored):
            raise ClientAuthFailed("client authentication failed", basic=basic)
        return client

    @staticmethod
    def _auth_error(exc: ClientAuthFailed) -> Response:
        headers = {"WWW-Authenticate": 'Basic realm="bastion"'} if exc.basic else None
        return oauth_error("invalid_client", exc.description, 401, headers)

    def _tokens(self, issued: IssuedTokens) -> Response:
        body = {
            "access_token": issued.access_token,
            "token_type": "Bearer",
            "expires_in": issued.expires_in,
            "refresh_token": issued.refresh_token,
            "scope": " ".join(issued.scopes),
        }
        return JSONResponse(body, headers=_NO_STORE)

    async def token(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        try:
            client = await self._client(request, form)
        except ClientAuthFailed as exc:
            return self._auth_error(exc)
        grant_type = form.get("grant_type")
        resource = form.get("resource")
        if grant_type not in ("authorization_code", "refresh_token") or grant_type not in client.grant_types:
            return oauth_error("unsupported_grant_type", "only authorization_code and refresh_token are supported")
        if resource is not None and not self.provider.endpoints.accepts_resource(resource):
            return oauth_error("invalid_target", "this server only issues tokens for its own MCP URL")
        if grant_type == "authorization_code":
            return self._code_grant(client.client_id or "", form)
        return self._refresh_grant(client.client_id or "", form)

    def _code_grant(self, client_id: str, form: dict[str, str]) -> Response:
        code, verifier, redirect_uri = form.get("code"), form.get("code_verifier"), form.get("redirect_uri")
        if not code or not redirect_uri:
            return oauth_error("invalid_request", "code and redirect_uri are required")
        if verifier is None or not _VERIFIER.fullmatch(verifier):
            return oauth_error("invalid_request", "code_verifier is missing or malformed (RFC 7636 §4.1)")
        record = self.provider.store.code(code)
        if record is None or record.client_id != client_id:
            return oauth_error("invalid_grant", "the code is invalid")
        if record.used_at is not None:
            # OAuth 2.1 §4.1.3: a code used twice means it leaked: revoke what it gave.
            self.provider.revoke_grant(record.grant_id, "authorization code replayed")
            return oauth_error("invalid_grant", "the code is invalid")
        if record.expires_at < time.time():
            return oauth_error("invalid_grant", "the code is invalid")
        if normal_form(redirect_uri) != normal_form(record.redirect_uri):
            return oauth_error("invalid_grant", "redirect_uri does not match the authorization request")
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
        if not hmac.compare_digest(challenge, record.code_challenge):
            return oauth_error("invalid_grant", "code_verifier does not match the code_challenge")
        issued = self.provider.redeem_code(code)
        if issued is None:
            self.provider.revoke_grant(record.grant_id, "authorization code redeemed twice at once")
            return oauth_error("invalid_grant", "the code is invalid")
        return self._tokens(issued)

    def _refresh_grant(self, client_id: str, form: dict[str, str]) -> Response:
        token = form.get("refresh_token")
        if not token:
            return oauth_error("invalid_request", "refresh_token is required")
        record = self.provider.store.token(token, "refresh") if len(token) <= 128 else None
        if record is None or record.client_id != client_id:
            return oauth_error("invalid_grant", "the refresh token is invalid")
        scope = form.get("scope")
        scopes = tuple(s for s in SCOPES if s in (scope.split() if scope else record.scopes))
        if record.used_at is not None:
            again = self._successor(token, client_id, scopes, used_at=record.used_at)
            if again is not None:
                return self._tokens(again)
            self.provider.revoke_grant(record.grant_id, "rotated refresh token reused")
            return oauth_error("invalid_grant", "the refresh token is invalid")
        now = time.time()
        if record.expires_at < now or record.grant_expires_at < now:
            return oauth_error("invalid_grant", "the refresh token has expired")
        if not set(scope.split() if scope else ()) <= set(record.scopes):
            return oauth_error("invalid_scope", "a refresh may only ask for scopes already granted")
        if not self._rotations.allow(record.grant_id):
            wait = max(1, math.ceil(self._rotations.retry_after(record.grant_id)))
            description = f"more than {ROTATIONS_PER_MINUTE} refreshes a minute for this grant: retry later"
            return oauth_error("invalid_request", description, 429, {"Retry-After": str(wait)})
        issued = self.provider.rotate(token, scopes)
        if issued is None:
            self.provider.revoke_grant(record.grant_id, "refresh token used twice at once")
            return oauth_error("invalid_grant", "the refresh token is invalid")
        self._remember(token, client_id, scopes, issued)
        return self._tokens(issued)

    def _remember(self, token: str, client_id: str, scopes: tuple[str, ...], issued: IssuedTokens) -> None:
        grace = self.provider.config.refresh_reuse_grace_s
        if grace <= 0:
            return
        now = time.monotonic()
        for key in [k for k, v in self._successors.items() if v.until < now]:
            del self._successors[key]
        while len(self._successors) >= _MAX_SUCCESSORS:
            self._successors.pop(next(iter(self._successors)))
        self._successors[digest(token)] = _Successor(client_id, scopes, issued, now + grace)

    def _successor(self, token: str, client_id: str, scopes: tuple[str, ...], *, used_at: float) -> IssuedTokens | None:
        """The pair `token` was just rotated into, if the same client asks again for the same scopes within
        the grace window (two sessions sharing one credential store refresh at once); else None (reuse).

        The window is judged twice: by the in-memory deadline and by the rotation time in the database.
        """
        kept = self._successors.get(digest(token))
        if kept is None or kept.until < time.monotonic() or kept.client_id != client_id or kept.scopes != scopes:
            return None
        if time.time() - used_at > self.provider.config.refresh_reuse_grace_s:
            return None
        if self.provider.store.token(kept.issued.refresh_token, "refresh") is None:
            return None  # the grant was revoked meanwhile
        logger.info("refresh token of client %s presented again within the grace window", client_id)
        return kept.issued

    async def revoke(self, request: Request) -> Response:
        """RFC 7009: 200 whatever the token; only the client's own tokens are revoked (their whole grant)."""
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        try:
            client = await self._client(request, form)
        except ClientAuthFailed as exc:
            return self._auth_error(exc)
        token = form.get("token")
        if not token:
            return oauth_error("invalid_request", "token is required")
        found = self.provider.store.grant_of_token(token) if len(token) <= 128 else None
        if found is not None and found[1] == client.client_id:
            self.provider.revoke_grant(found[0], "revoked by the client")
        return Response(status_code=200, headers=_NO_STORE)


@dataclass
class RegistrationQuota:
    """At most `limit` successful registrations per address (IPv6: per /64) in a sliding hour.

    A registration reserves its place before it runs and gives it back if it fails, so concurrent
    requests cannot overshoot and a refused registration costs nothing.
    """

    limit: int
    window_s: float = 3600.0
    _events: dict[str, deque[float]] = field(default_factory=dict)

    def reserve(self, key: str) -> float | None:
        """Take a place for `key` and return its timestamp, or None if the quota is spent."""
        now = time.monotonic()
        events = self._events.pop(key, None) or deque()
        while events and events[0] < now - self.window_s:
            events.popleft()
        self._events[key] = events  # most recent last, for eviction
        if len(events) >= self.limit:
            return None
        events.append(now)
        while len(self._events) > _MAX_TRACKED_ADDRESSES:
            self._events.pop(next(iter(self._events)))
        return now

    def release(self, key: str, stamp: float) -> None:
        events = self._events.get(key)
        if events is not None and stamp in events:
            events.remove(stamp)

    def retry_after(self, key: str) -> float:
        events = self._events.get(key)
        return max(1.0, events[0] + self.window_s - time.monotonic()) if events else 1.0


def parse_json(body: bytes) -> object:
    """JSON from an unauthenticated peer. Raises ValueError for anything else, deep nesting included."""
    try:
        return json.loads(body)
    except RecursionError:
        # CPython's decoder recurses once per level; a 100,000-deep array must be a 400, not a 500.
        raise ValueError("JSON nested too deeply") from None


class Registration:
    """/register: the SDK's RFC 7591 handler behind bastion's caps (per address, in total).

    Failed registrations do not use the address's quota; when the table is full, never-used clients
    older than `unused_client_min_age_s` are evicted, oldest first, before anyone is refused.
    """

    def __init__(self, provider: BastionAuthProvider) -> None:
        self.provider = provider
        config = provider.config
        self.quota = RegistrationQuota(config.registrations_per_ip_per_hour)
        # No valid_scopes: unknown scopes are narrowed by the provider, not refused (claude.ai sends one).
        self.handler = RegistrationHandler(self.provider, ClientRegistrationOptions(enabled=True))  # type: ignore[arg-type]

    async def handle(self, request: Request) -> Response:
        response = await self._handle(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    async def _handle(self, request: Request) -> Response:
        ip = client_ip(request)
        key = address_key(ip)
        if declared_length(request) > MAX_BODY_BYTES:
            return oauth_error("invalid_client_metadata", "the registration is too large", 413)
        body = await read_limited(request, MAX_BODY_BYTES)
        if body is None:
            return oauth_error("invalid_client_metadata", "the registration is too large", 413)
        problem = self._metadata_problem(body)
        if problem is not None:
            return oauth_error(*problem)
        full = self._table_full()
        if full is not None:
            return full
        stamp = self.quota.reserve(key)
        if stamp is None:
            retry = f"{self.quota.retry_after(key):.0f}"
            return oauth_error(
                "temporarily_unavailable", "too many registrations from this address", 429, {"Retry-After": retry}
            )

        async def replay() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        token = registering_ip.set(ip)  # the provider records which address registered the client
        try:
            response = await self.handler.handle(Request(request.scope, replay))
        finally:
            registering_ip.reset(token)
        if response.status_code != 201:
            self.quota.release(key, stamp)
        return response

    def _table_full(self) -> Response | None:
        """None if a client may be added (evicting never-used ones if needed), else the 429 to send."""
        config = self.provider.config
        store = self.provider.store
        store.expire_unused_clients(config.unused_client_ttl_s)
        excess = store.client_count() - config.max_clients + 1
        if excess > 0 and store.evict_unused_clients(excess, config.unused_client_min_age_s) > 0:
            logger.warning("client table full: evicted never-used clients to register a new one")
            excess = store.client_count() - config.max_clients + 1
        if excess <= 0:
            return None
        oldest = store.oldest_unused_client_at()
        wait = (
            config.unused_client_min_age_s if oldest is None else oldest + config.unused_client_min_age_s - time.time()
        )
        return oauth_error(
            "temporarily_unavailable",
            "too many registered clients: the administrator can remove unused ones with 'bastion admin clients prune'",
            429,
            {"Retry-After": f"{max(1.0, wait):.0f}"},
        )

    def _metadata_problem(self, body: bytes) -> tuple[str, str] | None:
        """(error, description) if the body is not JSON metadata with acceptable redirect URIs (RFC 7591 §2).

        The URIs are checked as sent, before the SDK's URL model normalises them.
        """
        try:
            data = parse_json(body)
        except ValueError as exc:
            return "invalid_client_metadata", f"the registration is not valid JSON ({str(exc)[:100]})"
        if not isinstance(data, dict):
            return "invalid_client_metadata", "the registration must be a JSON object"
        uris = data.get("redirect_uris")
        if not isinstance(uris, list) or not uris:
            return "invalid_redirect_uri", "redirect_uris is required"
        if len(uris) > MAX_REDIRECT_URIS:
            return "invalid_redirect_uri", f"at most {MAX_REDIRECT_URIS} redirect URIs"
        for uri in uris:
            if not isinstance(uri, str):
                return "invalid_redirect_uri", "redirect URIs must be strings"
            problem = registration_problem(uri, self.provider.config.app_callbacks)
            if problem is not None:
                return "invalid_redirect_uri", problem
        return None


class _NoSniffMetadata(MetadataHandler):
    async def handle(self, request: Request) -> Response:
        response = await super().handle(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


class _NoSniffResourceMetadata(ProtectedResourceMetadataHandler):
    async def handle(self, request: Request) -> Response:
        response = await super().handle(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def authorization_server_metadata(issuer: str) -> MetadataHandler:
    """RFC 8414: what the server really supports (public clients, refresh, S256 only, `iss` in responses)."""
    methods = ["none", "client_secret_post", "client_secret_basic"]
    metadata = OAuthMetadata.model_validate(
        {
            "issuer": issuer,
            "authorization_endpoint": f"{issuer}/authorize",
            "token_endpoint": f"{issuer}/token",
            "registration_endpoint": f"{issuer}/register",
            "revocation_endpoint": f"{issuer}/revoke",
            "scopes_supported": list(SCOPES),
            "response_types_supported": ["code"],
            "response_modes_supported": ["query"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
            "token_endpoint_auth_methods_supported": methods,
            "revocation_endpoint_auth_methods_supported": methods,
            "code_challenge_methods_supported": ["S256"],
            "authorization_response_iss_parameter_supported": True,
            "client_id_metadata_document_supported": True,
        }
    )
    return _NoSniffMetadata(metadata)


def protected_resource_metadata(issuer: str, resource: str) -> ProtectedResourceMetadataHandler:
    """RFC 9728, served at both the path-suffixed and the root well-known URL."""
    metadata = ProtectedResourceMetadata.model_validate(
        {
            "resource": resource,
            "authorization_servers": [issuer],
            "scopes_supported": list(SCOPES),
            "bearer_methods_supported": ["header"],
            "resource_name": "bastion",
        }
    )
    return _NoSniffResourceMetadata(metadata)
