"""The machine-facing OAuth endpoints: /token, /revoke, /register and the metadata documents.

SECURITY BOUNDARY. /token (RFC 6749 §4.1.3, §6; OAuth 2.1; RFC 7636; RFC 8707):
- form bodies only, no repeated parameters, client authenticated as registered (secrets compared as
  SHA-256 digests in constant time); a failed client authentication is 401 invalid_client;
- a code is single-use and consumed atomically; presenting a used code revokes its whole grant;
- a refresh token is single-use and rotated; presenting a rotated one revokes the whole grant (reuse
  detection, RFC 9700 §4.14.2). Two concurrent refreshes with one token are treated the same way: there
  is no grace window;
- `resource`, when sent, must be this server's MCP URL (invalid_target otherwise); tokens are bound to it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import time
from typing import Final
from urllib.parse import unquote

from mcp.server.auth.handlers.metadata import MetadataHandler, ProtectedResourceMetadataHandler
from mcp.server.auth.handlers.register import RegistrationHandler
from mcp.server.auth.settings import ClientRegistrationOptions
from mcp.shared.auth import OAuthClientInformationFull, OAuthMetadata, ProtectedResourceMetadata
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bastion.http.flow import client_ip, single_params
from bastion.http.provider import MAX_REDIRECT_URIS, BastionAuthProvider, registering_ip
from bastion.http.ratelimit import WindowLimiter
from bastion.http.redirects import registration_problem
from bastion.http.store import IssuedTokens, digest
from bastion.tools.server import SCOPES

MAX_BODY_BYTES: Final = 64 * 1024
_VERIFIER: Final = re.compile(r"[A-Za-z0-9._~-]{43,128}")
_NO_STORE: Final = {"Cache-Control": "no-store", "Pragma": "no-cache"}


def oauth_error(error: str, description: str, status: int = 400, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"error": error, "error_description": description}, status_code=status, headers={**_NO_STORE, **(headers or {})}
    )


async def read_limited(request: Request, limit: int) -> bytes | None:
    if int(request.headers.get("content-length") or 0) > limit:
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


class TokenEndpoint:
    """/token and /revoke."""

    def __init__(self, provider: BastionAuthProvider) -> None:
        self.provider = provider

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
        if redirect_uri != record.redirect_uri:
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
        if record.used_at is not None:
            self.provider.revoke_grant(record.grant_id, "rotated refresh token reused")
            return oauth_error("invalid_grant", "the refresh token is invalid")
        now = time.time()
        if record.expires_at < now or record.grant_expires_at < now:
            return oauth_error("invalid_grant", "the refresh token has expired")
        scope = form.get("scope")
        scopes = tuple(scope.split()) if scope else record.scopes
        if not set(scopes) <= set(record.scopes):
            return oauth_error("invalid_scope", "a refresh may only ask for scopes already granted")
        issued = self.provider.rotate(token, tuple(s for s in SCOPES if s in scopes))
        if issued is None:
            self.provider.revoke_grant(record.grant_id, "refresh token used twice at once")
            return oauth_error("invalid_grant", "the refresh token is invalid")
        return self._tokens(issued)

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


class Registration:
    """/register: the SDK's RFC 7591 handler behind bastion's caps (per address, in total)."""

    def __init__(self, provider: BastionAuthProvider) -> None:
        self.provider = provider
        config = provider.config
        self.per_ip = WindowLimiter(config.registrations_per_ip_per_hour, 3600.0)
        # No valid_scopes: unknown scopes are narrowed by the provider, not refused (claude.ai sends one).
        self.handler = RegistrationHandler(self.provider, ClientRegistrationOptions(enabled=True))  # type: ignore[arg-type]

    async def handle(self, request: Request) -> Response:
        config = self.provider.config
        ip = client_ip(request)
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            return oauth_error("invalid_client_metadata", "the registration is too large", 413)
        self.provider.store.expire_unused_clients(config.unused_client_ttl_s)
        if self.provider.store.client_count() >= config.max_clients:
            return oauth_error("temporarily_unavailable", "too many registered clients", 429, {"Retry-After": "3600"})
        if not self.per_ip.allow(ip):
            return oauth_error("temporarily_unavailable", "too many registrations", 429, {"Retry-After": "3600"})
        body = await read_limited(request, MAX_BODY_BYTES)
        if body is None:
            return oauth_error("invalid_client_metadata", "the registration is too large", 413)
        problem = self._redirect_problem(body)
        if problem is not None:
            return oauth_error("invalid_redirect_uri", problem)

        async def replay() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        token = registering_ip.set(ip)  # the provider records which address registered the client
        try:
            return await self.handler.handle(Request(request.scope, replay))
        finally:
            registering_ip.reset(token)

    def _redirect_problem(self, body: bytes) -> str | None:
        """Check redirect_uris as sent, before the SDK's URL model normalises them (RFC 7591 §2)."""
        try:
            data = json.loads(body)
        except ValueError:
            return None  # the SDK answers invalid_client_metadata
        uris = data.get("redirect_uris") if isinstance(data, dict) else None
        if not isinstance(uris, list) or not uris:
            return "redirect_uris is required"
        if len(uris) > MAX_REDIRECT_URIS:
            return f"at most {MAX_REDIRECT_URIS} redirect URIs"
        for uri in uris:
            if not isinstance(uri, str):
                return "redirect URIs must be strings"
            problem = registration_problem(uri, self.provider.config.app_callbacks)
            if problem is not None:
                return problem
        return None


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
    return MetadataHandler(metadata)


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
    return ProtectedResourceMetadataHandler(metadata)
