"""The browser side of the authorization code flow: /authorize, the login page, the consent page.

SECURITY BOUNDARY.
- /authorize validates everything (client, exact redirect URI, PKCE S256, resource, response type,
  repeated parameters) and, on any problem, shows an error page: it never redirects the browser before
  the administrator has logged in, so a registered attacker URI cannot be used as an open redirector
  (RFC 9700 §4.11.2).
- The request becomes a server-side transaction bound to this browser by a `__Host-` cookie
  (HttpOnly, Secure, SameSite=Strict). Every step checks that binding (the login page, the consent page
  and both POSTs; every POST also needs the transaction's CSRF token); the transaction is decided once.
- Cookies are not separated by port, so a page on another loopback port can plant that cookie: a
  successful login therefore issues a fresh value and moves the transaction to it (session fixation,
  OWASP ASVS V3.2.1), so a planted value opens nothing once the administrator has logged in.
- Password checks go through `LoginLimiter` (reserved before the argon2 work, one per address, two at a
  time server-wide); one request's login form takes `MAX_LOGIN_TRIES` passwords, then it is closed (its
  form posted from rotating addresses was an unlimited supply of guesses). /authorize is rate limited and
  its pending requests capped per address, and a flood never drops a request in progress: it is refused
  instead. A browser that has logged in before is counted by its device cookie instead of its address
  (`devices.py`): an attacker on the same host shares the administrator's address, never that cookie.
- A client's registered `scope` bounds what /authorize offers; without a known scope in the request
  only the least-privileged toolset is ticked on the consent page; `gateway:*` is never ticked, whatever
  the client asks: only the administrator ticks it.
- Each authorization needs the administrator's password, in this transaction: there is no "already
  logged in" shortcut a new client could ride on (a consent cookie never carries over to another client).
- POSTs answer 303; pages cannot be framed; failures say the same thing whatever went wrong.
- Only the administrator's own navigations and forms reach these steps (Fetch Metadata, `app.py`'s
  `BrowserStepGuard`): a sandbox's preview page is same-site (another port of the host), so its scripts
  would otherwise send the SameSite=Strict cookies with their requests, spend the device's login
  back-off and fill its pending requests. The refusal comes before anything is counted.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from bastion.safety.errors import NotFound, ResourceLimit
from bastion.tools.server import GATEWAY_DEPLOY, GATEWAY_READ, ORGANIZER, SCOPES, WORKBENCH
from bastion.transports.http import pages
from bastion.transports.http.devices import DEVICE_COOKIE, DEVICE_LIFETIME_S, TrustedDevices
from bastion.transports.http.password import AdminCredential
from bastion.transports.http.provider import MAX_LOGIN_TRIES, BastionAuthProvider, Transaction
from bastion.transports.http.ratelimit import LoginLimiter, LoginRefused, WindowLimiter, address_key, device_key
from bastion.transports.http.redirects import LOOPBACK_HOSTS, matches_registered

BROWSER_COOKIE: Final = "__Host-bastion-browser"
_CHALLENGE: Final = re.compile(r"[A-Za-z0-9_-]{43}")
MAX_STATE_CHARS: Final = 2048
MAX_FORM_BYTES: Final = 16 * 1024
LOGIN_FAILED: Final = "Login failed."
EXPIRED: Final = "This request expired or was already decided: start again from the app."
TOO_MANY_TRIES: Final = "Too many wrong passwords for this request: start again from the app."
CLIENT_GONE: Final = "This app's registration was removed while you were deciding: start again from the app."
PASSWORD_CHANGED: Final = "The administrator password has changed. Start again from the app."  # noqa: S105 - a message, not a password
OTHER_BROWSER: Final = "This request was started in another browser: start again from the app in this one."
CSRF_FAILED: Final = "This form is not valid for this browser (CSRF check failed)."
NOT_OUR_FORM: Final = "This form was sent by another site's page, not by bastion's: submit it from bastion's own page."
NOT_A_NAVIGATION: Final = "This page opens only in the browser's own window, not inside or from another site's page."
# Least privileged first: the organizer only moves files inside the inboxes (journalled, undoable);
# the workbench runs commands; the gateway acts on production hosts.
BY_PRIVILEGE: Final = (ORGANIZER, WORKBENCH, GATEWAY_READ, GATEWAY_DEPLOY)


def client_ip(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def posted_by_another_page(headers: Headers) -> bool:
    """A POST that a page of another origin sent (a fetch, or a form it submitted), by Fetch Metadata.

    Another port of this host is same-site, so SameSite=Strict does not keep its requests from carrying
    the administrator's cookies; `Sec-Fetch-Site` (W3C Fetch Metadata, sent to https and loopback URLs)
    tells them apart. `none` is the user's own action; a client without Fetch Metadata is let through
    (it has no browser's cookies to borrow).
    """
    return headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none")


def not_a_navigation(headers: Headers) -> bool:
    """A request that is not a top-level navigation (fetch, img, a frame), by Fetch Metadata.

    A navigation from any site must work: claude.ai sends the browser here cross-site, the MCP Inspector
    from another localhost port (same-site). A script's fetch or a frame is refused: X-Frame-Options stops
    a frame's display, not the work behind it. A client without Fetch Metadata is let through.
    """
    mode, dest = headers.get("sec-fetch-mode", "navigate"), headers.get("sec-fetch-dest", "document")
    return mode != "navigate" or dest != "document"


def speculative(headers: Headers) -> bool:
    """A prefetch or prerender the browser made because a page asked for it (speculation rules, a
    `<link rel=prefetch>`), by its purpose header: `Sec-Purpose` (Chromium), `Purpose`, `X-Purpose` or `X-Moz`.

    Chromium sends such a request as if the user had opened the page (`Sec-Fetch-Site: none`, a navigation
    of a document) and with the SameSite=Strict cookies: a page on another port listed /authorize twelve
    times and filled the administrator's pending requests without a click. Refused, the browser drops it and
    asks again, for real, if the administrator opens the page.
    """
    for name in ("sec-purpose", "purpose", "x-purpose", "x-moz"):
        value = headers.get(name, "").lower()
        if "prefetch" in value or "prerender" in value or "preview" in value:
            return True
    return False


def browser_digest(value: str) -> str:
    """What a transaction keeps of the browser cookie it is bound to."""
    return hashlib.sha256(value.encode()).hexdigest()


def same_token(given: str, expected: str) -> bool:
    """Constant-time equality of a token a browser sent; any text, never an error.

    `hmac.compare_digest` raises TypeError on non-ASCII str, which a form field may be: bytes never do.
    """
    return hmac.compare_digest(given.encode(), expected.encode())


async def check_password(
    limiter: LoginLimiter, credential: AdminCredential, request: Request, password: str
) -> str | None:
    """The argon2 check behind the limiter: reserved first (waiting for a turn if the shared slot is busy),
    released whatever happens. A valid device cookie counts the attempt against that browser rather than its
    address (`devices.py`). Returns the version of the password matched (`AdminCredential.verify`), or None.

    Raises:
        LoginRefused: the attempt is refused before any argon2 work (429 or 503).
    """
    device = TrustedDevices(credential).device(request.cookies.get(DEVICE_COOKIE, ""))
    attempt = await limiter.acquire(client_ip(request), device=device)
    checked: str | None = None
    try:
        checked = await anyio.to_thread.run_sync(credential.verify, password)
    finally:
        limiter.finish(attempt, checked is not None)
    return checked


def offered_scopes(asked: str, registered: str | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The scopes the consent page offers and those it ticks; None if every scope asked is outside the
    client's registered ones.

    The registered `scope` (RFC 7591 §2) bounds the request. Scopes the request names are offered and
    ticked, but never `gateway:*`: the MCP SDK's client asks for every scope the 401 names (all four), so
    a ticked gateway scope was one click from production. With none it names (claude.ai asks for
    `claudeai`), every scope within the bound is offered and only the least-privileged non-gateway one is
    ticked: the administrator ticks more on purpose.
    """
    bound = set(SCOPES) & set((registered or "").split()) or set(SCOPES)
    named = set(SCOPES) & set(asked.split())
    if named:
        chosen = tuple(s for s in SCOPES if s in named and s in bound)
        return (chosen, tuple(s for s in chosen if not is_gateway(s))) if chosen else None
    offered = tuple(s for s in SCOPES if s in bound)
    least = next((s for s in BY_PRIVILEGE if s in bound and not is_gateway(s)), None)
    return offered, (least,) if least else ()


def is_gateway(scope: str) -> bool:
    """A scope that acts on production hosts: offered when asked, never ticked for the administrator."""
    return scope.startswith("gateway:")


def declared_length(request: Request) -> int:
    """The Content-Length header as a number (0 if absent); a malformed one counts as too large."""
    value = request.headers.get("content-length")
    if value is None:
        return 0
    return int(value) if value.isascii() and value.isdigit() else 1 << 62


async def form_body(request: Request) -> str | None:
    """A form POST's body as text, or None if it is not urlencoded or longer than `MAX_FORM_BYTES`
    (declared or sent: a huge declared length also stretched the connection's body deadline)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return None
    if declared_length(request) > MAX_FORM_BYTES:
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    return body.decode("utf-8", "replace")


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
        # Redirect URIs the administrator approved since start: the "check this address" box is shown the
        # first time only (claude.ai registers a new client per connection, each with its callback).
        self.approved_redirects: set[str] = set()
        self.secure_cookie = True
        self.authorize_limit = WindowLimiter(provider.config.authorize_per_ip_per_minute, 60.0)

    def _requester(self, request: Request) -> str:
        """Whom /authorize counts: a browser that has logged in before (its device cookie, sent on a
        navigation the administrator or a local app starts, SameSite=Strict), else its address. An
        attacker on the same host shares the address, never the device.

        A navigation a page of this host started (another port: `Sec-Fetch-Site: same-site`) counts apart:
        a sandbox's preview page that got one click kept its popup's handle and set its location to
        /authorize again and again, each a real navigation with the device cookie, until the device's
        pending requests were full and the administrator's own were refused. Such pages can now fill only
        their own share (the MCP Inspector, on another localhost port, shares it with them); a client that
        opens the browser (`none`) or a site elsewhere (claude.ai, `cross-site`) keeps the rest."""
        device = TrustedDevices(self.credential).device(request.cookies.get(DEVICE_COOKIE, ""))
        key = device_key(device) if device else address_key(client_ip(request))
        return f"{key}:same-site" if request.headers.get("sec-fetch-site") == "same-site" else key

    async def authorize(self, request: Request) -> Response:
        address = self._requester(request)
        if not self.authorize_limit.allow(address):
            wait = self.authorize_limit.retry_after(address)
            return pages.too_many(wait, "Too many authorization requests from this address: try again in a minute.")
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
        if resource is not None and not self.provider.endpoints.accepts_resource(resource):
            return pages.error_page("invalid_target: this server only issues tokens for its own MCP URL")
        state = params.get("state")
        if state is not None and len(state) > MAX_STATE_CHARS:
            return pages.error_page("invalid_request: state is too long")
        scopes = offered_scopes(params.get("scope", ""), client.scope)
        if scopes is None:
            return pages.error_page("invalid_scope: this client did not register the scopes it asks for")
        browser = request.cookies.get(BROWSER_COOKIE) or secrets.token_urlsafe(32)
        try:
            txn = self.provider.start_transaction(
                client,
                redirect_uri=redirect_uri,
                scopes=scopes[0],
                checked=scopes[1],
                state=state,
                code_challenge=challenge,
                browser_digest=browser_digest(browser),
                address=address,
            )
        except ResourceLimit as exc:
            return pages.too_many(60.0, exc.reason)
        response = pages.see_other(f"/oauth/login?{urlencode({'txn': txn.txn_id})}")
        self._set_browser_cookie(response, browser)
        return response

    def _set_browser_cookie(self, response: Response, value: str) -> None:
        # As long as the device cookie: a script (all a sandbox's preview page has: the preview relay drops
        # bastion's Set-Cookie) cannot overwrite an HttpOnly cookie, so while this one lasts, across browser
        # restarts too, no other page can plant a value. A login still replaces it (session fixation).
        response.set_cookie(
            BROWSER_COOKIE,
            value,
            max_age=DEVICE_LIFETIME_S,
            path="/",
            secure=self.secure_cookie,
            httponly=True,
            samesite="strict",
        )

    def _txn_for_get(self, request: Request) -> Transaction | None:
        return self.provider.transaction(request.query_params.get("txn", ""))

    def _same_browser(self, request: Request, txn: Transaction, *, required: bool = True) -> bool:
        """The request carries the cookie the transaction is bound to.

        `required=False` lets a request without the cookie through (the login page only): a SameSite=Strict
        cookie is withheld on a navigation a cross-site page started (claude.ai sends the browser to
        /authorize), and the login POST, same-site, needs it anyway. A different value is always refused.
        """
        browser = request.cookies.get(BROWSER_COOKIE, "")
        if not browser:
            return not required
        return hmac.compare_digest(browser_digest(browser), txn.browser_digest)

    async def _form(self, request: Request) -> dict[str, str] | None:
        body = await form_body(request)
        return None if body is None else single_params(body)

    def _bound(self, request: Request, txn: Transaction, form: dict[str, str]) -> bool:
        """The POST comes from the browser that opened the transaction, with its current CSRF token."""
        return self._same_browser(request, txn) and same_token(form.get("csrf", ""), txn.csrf)

    def _login_page(self, txn: Transaction, *, message: str = "", status: int = 200) -> Response:
        name = pages.label(txn.client_name or txn.client_id)
        context = f"<p>Log in to decide on the request of <strong>{name}</strong>.</p>"
        body = pages.login_form("/oauth/login", {"txn": txn.txn_id, "csrf": txn.csrf}, message=message, context=context)
        return pages.page("bastion: administrator login", body, status=status)

    async def login_get(self, request: Request) -> Response:
        txn = self._txn_for_get(request)
        if txn is None:
            return pages.error_page(EXPIRED)
        if not self._same_browser(request, txn, required=False):
            return pages.error_page(OTHER_BROWSER, status=403)
        if txn.authenticated:
            return pages.see_other(f"/oauth/consent?{urlencode({'txn': txn.txn_id})}")
        return self._login_page(txn)

    async def login_post(self, request: Request) -> Response:
        form = await self._form(request)
        if form is None:
            return pages.error_page("invalid form", status=400)
        txn = self.provider.transaction(form.get("txn", ""))
        if txn is None:
            return pages.error_page(EXPIRED, status=403)
        if not self._bound(request, txn, form):
            return pages.error_page(CSRF_FAILED, status=403)
        if txn.login_tries >= MAX_LOGIN_TRIES:
            self.provider.finish_transaction(txn.txn_id)
            return pages.error_page(TOO_MANY_TRIES, status=403)
        # Reserved before the check: one request's form posted from many addresses at once gets its tries, no more.
        txn.login_tries += 1
        try:
            checked = await check_password(self.limiter, self.credential, request, form.get("password", ""))
        except LoginRefused as exc:
            txn.login_tries -= 1  # refused before any check
            return pages.too_many(exc.retry_after_s, exc.reason, status=exc.status)
        if checked is None and txn.login_tries >= MAX_LOGIN_TRIES:
            self.provider.finish_transaction(txn.txn_id)
            return pages.error_page(TOO_MANY_TRIES, status=401)
        if checked is None:
            return self._login_page(txn, message=LOGIN_FAILED, status=401)
        if self.provider.transaction(txn.txn_id) is not txn:
            return pages.error_page(EXPIRED, status=403)  # it expired during the check
        if not self.credential.is_current(checked):
            self.provider.finish_transaction(txn.txn_id)
            return pages.error_page(PASSWORD_CHANGED, status=403)  # set-password ran during the check
        txn.authenticated = True
        txn.credential_version = checked
        txn.csrf = secrets.token_urlsafe(32)  # a new token for the next step
        fresh = secrets.token_urlsafe(32)
        self.provider.rebind_browser(txn.browser_digest, browser_digest(fresh))
        response = pages.see_other(f"/oauth/consent?{urlencode({'txn': txn.txn_id})}")
        self._set_browser_cookie(response, fresh)
        TrustedDevices(self.credential).set_cookie(response, version=checked, secure=self.secure_cookie)
        return response

    async def consent_get(self, request: Request) -> Response:
        txn = self._txn_for_get(request)
        if txn is None:
            return pages.error_page(EXPIRED)
        if not self._same_browser(request, txn):
            return pages.error_page(OTHER_BROWSER, status=403)
        if not txn.authenticated:
            return pages.see_other(f"/oauth/login?{urlencode({'txn': txn.txn_id})}")
        target = urlsplit(txn.redirect_uri)
        host = target.hostname or target.scheme + ":"
        flagged = not (
            (target.scheme == "http" and host in LOOPBACK_HOSTS)
            or txn.redirect_uri in self.provider.config.app_callbacks
            or txn.redirect_uri in self.approved_redirects
        )
        body = pages.consent_body(
            client_name=txn.client_name,
            client_id=txn.client_id,
            redirect_host=f"{target.scheme}://{target.netloc}" if target.netloc else txn.redirect_uri,
            flagged=flagged,
            scopes=txn.scopes,
            checked=txn.checked,
            fields={"txn": txn.txn_id, "csrf": txn.csrf},
        )
        return pages.page("bastion: allow access?", body)

    async def consent_post(self, request: Request) -> Response:
        form = await self._form_multi(request)
        if form is None:
            return pages.error_page("invalid form", status=400)
        single, chosen = form
        txn = self.provider.transaction(single.get("txn", ""))
        if txn is None:
            return pages.error_page(EXPIRED, status=403)
        if not self._bound(request, txn, single) or not txn.authenticated:
            return pages.error_page(CSRF_FAILED, status=403)
        self.provider.finish_transaction(txn.txn_id)
        if not self.credential.is_current(txn.credential_version):
            # The password changed (which revokes everything) after this login: the login no longer counts.
            return pages.error_page(PASSWORD_CHANGED, status=403)
        issuer = self.provider.endpoints.issuer
        granted = tuple(s for s in txn.scopes if s in chosen)
        if single.get("decision") != "approve" or not granted:
            return pages.see_other(_redirect(txn.redirect_uri, error="access_denied", state=txn.state, iss=issuer))
        try:
            code = self.provider.issue_code(txn, granted)
        except NotFound:
            return pages.error_page(CLIENT_GONE, status=403)
        if not self.credential.is_current(txn.credential_version):
            # Asked again once the grant exists: set-password's revocation may have run just before it was made.
            self.provider.revoke_code_grant(code, "admin password changed")
            return pages.error_page(PASSWORD_CHANGED, status=403)
        self.approved_redirects.add(txn.redirect_uri)
        return pages.see_other(_redirect(txn.redirect_uri, code=code, state=txn.state, iss=issuer))

    async def _form_multi(self, request: Request) -> tuple[dict[str, str], set[str]] | None:
        """The consent form: single-valued fields, plus the repeated `scope` checkboxes."""
        body = await form_body(request)
        if body is None:
            return None
        try:
            pairs = parse_qsl(body, keep_blank_values=True, max_num_fields=64)
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
