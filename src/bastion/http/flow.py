"""The browser side of the authorization code flow: /authorize, the login page, the consent page.

SECURITY BOUNDARY.
- /authorize validates everything (client, exact redirect URI, PKCE S256, resource, response type,
  repeated parameters) and, on any problem, shows an error page: it never redirects the browser before
  the administrator has logged in, so a registered attacker URI cannot be used as an open redirector
  (RFC 9700 §4.11.2).
- The request becomes a server-side transaction bound to this browser by a `__Host-` cookie
  (HttpOnly, Secure, SameSite=Strict). Every POST needs that cookie and the transaction's CSRF token;
  the transaction is decided once.
- Each authorization needs the administrator's password, in this transaction: there is no "already
  logged in" shortcut a new client could ride on (a consent cookie never carries over to another client).
- POSTs answer 303; pages cannot be framed; failures say the same thing whatever went wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import anyio
from starlette.requests import Request
from starlette.responses import Response

from bastion.http import pages
from bastion.http.password import AdminCredential
from bastion.http.provider import BastionAuthProvider, Transaction
from bastion.http.ratelimit import LoginLimiter
from bastion.http.redirects import LOOPBACK_HOSTS, matches_registered
from bastion.tools.server import SCOPES

BROWSER_COOKIE: Final = "__Host-bastion-browser"
_CHALLENGE: Final = re.compile(r"[A-Za-z0-9_-]{43}")
MAX_STATE_CHARS: Final = 2048
MAX_FORM_BYTES: Final = 16 * 1024
LOGIN_FAILED: Final = "Login failed."


def client_ip(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def single_params(raw_query: str | bytes) -> dict[str, str] | None:
    """Query or form parameters, or None if any is repeated (OAuth 2.1 §3.1: parameters MUST NOT repeat)."""
    text = raw_query.decode("latin-1") if isinstance(raw_query, bytes) else raw_query
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
    except ValueError:
        return None
    params: dict[str, str] = {}
    for key, value in pairs:
        if key in params:
            return None
        params[key] = value
    return params


class AuthorizationFlow:
    """Handlers for /authorize, /oauth/login and /oauth/consent."""

    def __init__(self, provider: BastionAuthProvider, credential: AdminCredential, limiter: LoginLimiter) -> None:
        self.provider = provider
        self.credential = credential
        self.limiter = limiter
        self.secure_cookie = True

    async def authorize(self, request: Request) -> Response:
        params = single_params(request.url.query)
        if params is None:
            return pages.error_page("invalid_request: a parameter is repeated or malformed")
        client_id = params.get("client_id", "")
        client = await self.provider.get_client(client_id) if client_id else None
        if client is None:
            return pages.error_page("invalid_request: unknown client")
        redirect_uri = params.get("redirect_uri", "")
        registered = [str(uri) for uri in client.redirect_uris or ()]
        if not redirect_uri or not matches_registered(redirect_uri, registered):
            return pages.error_page("invalid_request: redirect_uri is not registered for this client")
        if params.get("response_type") != "code":
            return pages.error_page("unsupported_response_type: only response_type=code is supported")
        if params.get("code_challenge_method") != "S256":
            return pages.error_page("invalid_request: PKCE with code_challenge_method=S256 is required")
        challenge = params.get("code_challenge", "")
        if not _CHALLENGE.fullmatch(challenge):
            return pages.error_page("invalid_request: code_challenge must be a base64url S256 challenge")
        resource = params.get("resource")
        if resource is not None and resource != self.provider.endpoints.resource:
            return pages.error_page("invalid_target: this server only issues tokens for its own MCP URL")
        state = params.get("state")
        if state is not None and len(state) > MAX_STATE_CHARS:
            return pages.error_page("invalid_request: state is too long")
        asked = set(params.get("scope", "").split())
        scopes = tuple(s for s in SCOPES if s in asked) or SCOPES
        browser = request.cookies.get(BROWSER_COOKIE) or secrets.token_urlsafe(32)
        txn = self.provider.start_transaction(
            client,
            redirect_uri=redirect_uri,
            scopes=scopes,
            state=state,
            code_challenge=challenge,
            browser_digest=_digest(browser),
        )
        response = pages.see_other(f"/oauth/login?{urlencode({'txn': txn.txn_id})}")
        self._set_browser_cookie(response, browser)
        return response

    def _set_browser_cookie(self, response: Response, value: str) -> None:
        response.set_cookie(
            BROWSER_COOKIE, value, path="/", secure=self.secure_cookie, httponly=True, samesite="strict"
        )

    def _txn_for_get(self, request: Request) -> Transaction | None:
        return self.provider.transaction(request.query_params.get("txn", ""))

    async def _form(self, request: Request) -> dict[str, str] | None:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
            return None
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return None
        return single_params(body.decode("utf-8", "replace"))

    def _bound(self, request: Request, txn: Transaction | None, form: dict[str, str]) -> bool:
        """The POST comes from the browser that opened the transaction, with its current CSRF token."""
        if txn is None:
            return False
        browser = request.cookies.get(BROWSER_COOKIE, "")
        return (
            bool(browser)
            and hmac.compare_digest(_digest(browser), txn.browser_digest)
            and hmac.compare_digest(form.get("csrf", ""), txn.csrf)
        )

    def _login_page(self, txn: Transaction, *, message: str = "", status: int = 200) -> Response:
        context = (
            f"<p>Log in to decide on the request of <strong>{pages.esc(txn.client_name or txn.client_id)}</strong>.</p>"
        )
        body = pages.login_form("/oauth/login", {"txn": txn.txn_id, "csrf": txn.csrf}, message=message, context=context)
        return pages.page("bastion: administrator login", body, status=status)

    async def login_get(self, request: Request) -> Response:
        txn = self._txn_for_get(request)
        if txn is None:
            return pages.error_page("This authorization request is unknown or has expired. Start again from the app.")
        if txn.authenticated:
            return pages.see_other(f"/oauth/consent?{urlencode({'txn': txn.txn_id})}")
        return self._login_page(txn)

    async def login_post(self, request: Request) -> Response:
        form = await self._form(request)
        if form is None:
            return pages.error_page("invalid form", status=400)
        txn = self.provider.transaction(form.get("txn", ""))
        if not self._bound(request, txn, form):
            return pages.error_page("This form is not valid for this browser (CSRF check failed).", status=403)
        assert txn is not None
        ip = client_ip(request)
        wait = self.limiter.retry_after(ip)
        if wait > 0:
            return pages.too_many(wait, "")
        ok = await anyio.to_thread.run_sync(self.credential.verify, form.get("password", ""))
        if not ok:
            self.limiter.failure(ip)
            return self._login_page(txn, message=LOGIN_FAILED, status=401)
        self.limiter.success(ip)
        txn.authenticated = True
        txn.credential_version = self.credential.version()
        txn.csrf = secrets.token_urlsafe(32)  # a new token for the next step
        return pages.see_other(f"/oauth/consent?{urlencode({'txn': txn.txn_id})}")

    async def consent_get(self, request: Request) -> Response:
        txn = self._txn_for_get(request)
        if txn is None:
            return pages.error_page("This authorization request is unknown or has expired. Start again from the app.")
        if not txn.authenticated:
            return pages.see_other(f"/oauth/login?{urlencode({'txn': txn.txn_id})}")
        target = urlsplit(txn.redirect_uri)
        host = target.hostname or target.scheme + ":"
        flagged = not (
            (target.scheme == "http" and host in LOOPBACK_HOSTS)
            or txn.redirect_uri in self.provider.config.app_callbacks
        )
        body = pages.consent_body(
            client_name=txn.client_name,
            client_id=txn.client_id,
            redirect_host=f"{target.scheme}://{target.netloc}" if target.netloc else txn.redirect_uri,
            flagged=flagged,
            scopes=txn.scopes,
            fields={"txn": txn.txn_id, "csrf": txn.csrf},
        )
        return pages.page("bastion: allow access?", body)

    async def consent_post(self, request: Request) -> Response:
        form = await self._form_multi(request)
        if form is None:
            return pages.error_page("invalid form", status=400)
        single, chosen = form
        txn = self.provider.transaction(single.get("txn", ""))
        if not self._bound(request, txn, single) or txn is None or not txn.authenticated:
            return pages.error_page("This form is not valid for this browser (CSRF check failed).", status=403)
        self.provider.finish_transaction(txn.txn_id)
        if not hmac.compare_digest(txn.credential_version, self.credential.version()):
            # The password changed (which revokes everything) after this login: the login no longer counts.
            return pages.error_page("The administrator password has changed. Start again from the app.", status=403)
        issuer = self.provider.endpoints.issuer
        granted = tuple(s for s in txn.scopes if s in chosen)
        if single.get("decision") != "approve" or not granted:
            return pages.see_other(_redirect(txn.redirect_uri, error="access_denied", state=txn.state, iss=issuer))
        code = self.provider.issue_code(txn, granted)
        return pages.see_other(_redirect(txn.redirect_uri, code=code, state=txn.state, iss=issuer))

    async def _form_multi(self, request: Request) -> tuple[dict[str, str], set[str]] | None:
        """The consent form: single-valued fields, plus the repeated `scope` checkboxes."""
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
            return None
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return None
        try:
            pairs = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=64)
        except ValueError:
            return None
        single: dict[str, str] = {}
        chosen: set[str] = set()
        for key, value in pairs:
            if key == "scope":
                chosen.add(value)
            elif key in single:
                return None
            else:
                single[key] = value
        return single, chosen


def _redirect(base: str, **params: str | None) -> str:
    """The client's redirect URI with our parameters added to its own query (RFC 6749 §4.1.2)."""
    extra = urlencode({k: v for k, v in params.items() if v is not None})
    parts = urlsplit(base)
    query = f"{parts.query}&{extra}" if parts.query else extra
    return parts._replace(query=query).geturl()
