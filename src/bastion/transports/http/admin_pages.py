"""The administrator's login, logout and decisions: revoke a grant (or all), approve or deny an approval.

The pages themselves (overview, sandboxes, audit log, egress, clients, approvals) are in `dashboard.py`.

SECURITY BOUNDARY. A session is a 256-bit cookie (`__Host-`, HttpOnly, Secure, SameSite=Strict) stored
as a digest; every POST needs the session's CSRF token; the login form's CSRF token is bound to a
browser cookie (no login CSRF), and a successful login issues that cookie a fresh value. Logins share
the rate limiter of the authorization flow (one argon2 check per address, two server-wide).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bastion.config import Config
from bastion.safety.approvals import ApprovalQueue
from bastion.safety.audit import AuditLog
from bastion.safety.errors import BastionError
from bastion.safety.results import ResultCode
from bastion.transports.http import pages
from bastion.transports.http.devices import TrustedDevices
from bastion.transports.http.flow import (
    BROWSER_COOKIE,
    CSRF_FAILED,
    LOGIN_FAILED,
    browser_digest,
    check_password,
    form_body,
    same_token,
    single_params,
)
from bastion.transports.http.password import AdminCredential
from bastion.transports.http.ratelimit import LoginLimiter, LoginRefused
from bastion.transports.http.store import AuthStore

SESSION_COOKIE: Final = "__Host-bastion-admin"
_DECIDE_STATUS: Final = {ResultCode.NOT_FOUND: 404, ResultCode.CONFLICT: 409, ResultCode.AUDIT_UNAVAILABLE: 503}
WEB_DECIDER: Final = "administrator (web)"
PASSWORD_CHANGED: Final = "The password changed during this login: log in with the new one."  # noqa: S105 - a message, not a password


class AdminPages:
    def __init__(
        self,
        store: AuthStore,
        credential: AdminCredential,
        limiter: LoginLimiter,
        config: Config,
        *,
        rebind: Callable[[str, str], None] | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        """`rebind(old digest, new digest)`: moves the browser's pending authorization requests to the
        cookie value a login here issues (`BastionAuthProvider.rebind_browser`), so a login page open in
        another tab still works after it. `audit`: the server's audit log, where each approval decision is
        written before it is made (without it, decisions are refused)."""
        self.audit = audit
        self.store = store
        self.rebind = rebind
        self.credential = credential
        self.limiter = limiter
        self.config = config
        self._key = secrets.token_bytes(32)
        self.approvals = ApprovalQueue(config.db_path)
        """The same queue (same SQLite table) the gateway and `bastion approvals` use."""

    def routes(self) -> list[Route]:
        return [
            Route("/admin/login", self.login_get, methods=["GET"]),
            Route("/admin/login", self.login_post, methods=["POST"]),
            Route("/admin/logout", self.checked_post(self.logout), methods=["POST"]),
            Route("/admin/revoke", self.checked_post(self.revoke), methods=["POST"]),
            Route("/admin/approvals", self.checked_post(self.decide), methods=["POST"]),
        ]

    # -- sessions and CSRF ----------------------------------------------------------------------------

    def _login_csrf(self, browser: str) -> str:
        return hmac.new(self._key, b"admin-login:" + browser.encode(), hashlib.sha256).hexdigest()

    def session_csrf(self, request: Request) -> str | None:
        session = request.cookies.get(SESSION_COOKIE)
        return self.store.admin_session_csrf(session) if session else None

    async def form(self, request: Request) -> dict[str, str] | None:
        body = await form_body(request)
        return None if body is None else single_params(body)

    def checked_post(self, handler: Callable[[Request, dict[str, str], str], Any]) -> Callable[[Request], Any]:
        """Wrap a POST handler: a live session and its CSRF token, or 403."""

        async def checked(request: Request) -> Response:
            csrf = self.session_csrf(request)
            form = await self.form(request)
            if csrf is None or form is None or not same_token(form.get("csrf", ""), csrf):
                return pages.error_page(CSRF_FAILED, status=403)
            result: Response = await handler(request, form, csrf)
            return result

        return checked

    # -- login ----------------------------------------------------------------------------------------

    def _login_page(self, browser: str, *, message: str = "", status: int = 200) -> Response:
        body = pages.login_form("/admin/login", {"csrf": self._login_csrf(browser)}, message=message)
        return pages.page("bastion: administrator login", body, status=status)

    async def login_get(self, request: Request) -> Response:
        browser = request.cookies.get(BROWSER_COOKIE) or secrets.token_urlsafe(32)
        response = self._login_page(browser)
        response.set_cookie(BROWSER_COOKIE, browser, path="/", secure=True, httponly=True, samesite="strict")
        return response

    async def login_post(self, request: Request) -> Response:
        browser = request.cookies.get(BROWSER_COOKIE, "")
        form = await self.form(request)
        if form is None or not browser or not same_token(form.get("csrf", ""), self._login_csrf(browser)):
            return pages.error_page(CSRF_FAILED, status=403)
        try:
            checked = await check_password(self.limiter, self.credential, request, form.get("password", ""))
        except LoginRefused as exc:
            return pages.too_many(exc.retry_after_s, exc.reason, status=exc.status)
        if checked is None:
            return self._login_page(browser, message=LOGIN_FAILED, status=401)
        session, _ = self.store.new_admin_session(self.config.http.admin_session_lifetime_s)
        if not self.credential.is_current(checked):
            # Found by attack: set-password (which ends every session) ran during the check; asked once the
            # session exists, so a revocation just before its insert is seen too.
            self.store.end_admin_session(session)
            return self._login_page(browser, message=PASSWORD_CHANGED, status=403)
        response = pages.see_other("/admin")
        response.set_cookie(
            SESSION_COOKIE,
            session,
            path="/",
            secure=True,
            httponly=True,
            samesite="strict",
            max_age=int(self.config.http.admin_session_lifetime_s),
        )
        # A browser value planted before the login never outlives it (session fixation).
        fresh = secrets.token_urlsafe(32)
        response.set_cookie(BROWSER_COOKIE, fresh, path="/", secure=True, httponly=True, samesite="strict")
        if self.rebind is not None:
            self.rebind(browser_digest(browser), browser_digest(fresh))
        TrustedDevices(self.credential).set_cookie(response, version=checked)
        return response

    async def logout(self, request: Request, form: dict[str, str], csrf: str) -> Response:
        self.store.end_admin_session(request.cookies.get(SESSION_COOKIE, ""))
        response = pages.see_other("/admin/login")
        response.delete_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True, samesite="strict")
        return response

    async def revoke(self, request: Request, form: dict[str, str], csrf: str) -> Response:
        grant = form.get("grant", "")
        if grant == "*":
            self.store.revoke_everything("revoked by the administrator (revoke all)")
            response = pages.see_other("/admin/login")
            response.delete_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True, samesite="strict")
            return response
        self.store.revoke_grant(grant, "revoked by the administrator")
        return pages.see_other("/admin")

    async def decide(self, request: Request, form: dict[str, str], csrf: str) -> Response:
        approval_id, decision = form.get("id", ""), form.get("decision")
        if decision not in ("approve", "deny"):
            return pages.error_page("decision must be approve or deny", status=400)
        if self.audit is None:  # fail closed: a decision is never made unrecorded
            return pages.error_page(
                "the audit log is not available to this page: decide with 'bastion approvals'", status=503
            )
        try:
            await self.approvals.decide_recorded(
                self.audit,
                approval_id,
                "approve" if decision == "approve" else "deny",
                by=WEB_DECIDER,
                channel="web",
                reason=form.get("reason", ""),
            )
        except BastionError as exc:
            # Answered here, not carried in a redirect's query: a link could then show any text as ours.
            return pages.error_page(exc.reason, status=_DECIDE_STATUS.get(exc.code, 400))
        return pages.see_other("/admin/approvals")
