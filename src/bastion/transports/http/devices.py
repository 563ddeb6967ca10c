"""Device cookies: a browser that has logged in before keeps its own login limits.

SECURITY BOUNDARY (best effort: these serve the login limits, they never authenticate anything).
Per-address limits cannot tell the administrator from an attacker on the same host (both are 127.0.0.1),
and an address is cheap to change (an IPv6 /48 holds 65,536 /64s). So a successful login also gives the
browser a device cookie (OWASP "Slow Down Online Guessing Attacks with Device Cookies"): a signed id and
issue time, `__Host-`, HttpOnly, Secure, SameSite=Strict, 30 days. An attempt that carries a valid one is
counted against that device, not its address, and has a password check reserved for it server-wide, so
failures and floods from elsewhere, even from the same address, never lock that browser out; its own
failures back it off as an address's would.

The key is derived from the administrator's argon2 hash file (secret, mode 0600, salted): cookies survive
a restart and all stop working when the password changes. A cookie only ever proves that this browser
logged in once; the password is still checked every time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Final

from starlette.responses import Response

from bastion.transports.http.password import AdminCredential

DEVICE_COOKIE: Final = "__Host-bastion-device"
DEVICE_LIFETIME_S: Final = 30 * 86_400
_MAX_COOKIE_CHARS: Final = 200


class TrustedDevices:
    """Issues and checks device cookies for the one administrator credential."""

    def __init__(self, credential: AdminCredential) -> None:
        self.credential = credential

    def _mac(self, payload: str, version: str | None = None) -> str:
        known = self.credential.version() if version is None else version
        key = hashlib.sha256(b"bastion device cookie\0" + known.encode()).digest()
        digest = hmac.new(key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self, version: str | None = None) -> str:
        """A new cookie value: `<id>.<issued at>.<mac>`, for the password `version` (default: the current one)."""
        payload = f"{secrets.token_urlsafe(16)}.{int(time.time())}"
        return f"{payload}.{self._mac(payload, version)}"

    def device(self, value: str) -> str | None:
        """The device id a cookie value proves, or None (absent, forged, expired, or an older password's)."""
        if not value or len(value) > _MAX_COOKIE_CHARS or not self.credential.version():
            return None
        payload, _, mac = value.rpartition(".")
        device_id, _, issued = payload.partition(".")
        if not device_id or not issued.isdigit() or not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            return None
        if not 0 <= time.time() - int(issued) < DEVICE_LIFETIME_S:
            return None
        return device_id

    def set_cookie(self, response: Response, *, version: str, secure: bool = True) -> None:
        """Give the browser a fresh device cookie after a login checked against password `version`: signed for
        that one, so a login that overlapped a password change gets no cookie the new password honours."""
        response.set_cookie(
            DEVICE_COOKIE,
            self.issue(version),
            max_age=DEVICE_LIFETIME_S,
            path="/",
            secure=secure,
            httponly=True,
            samesite="strict",
        )
