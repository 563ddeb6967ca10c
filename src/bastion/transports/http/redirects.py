"""Redirect URI rules: what a client may register, and what /authorize accepts.

SECURITY BOUNDARY (RFC 9700 §4.1, OAuth 2.1 §2.3.1, RFC 8252 §7.3):
- registered: https with a plain host (no userinfo, no wildcard, no fragment), http on a loopback host
  (127.0.0.1, [::1], localhost), or one of the configured native-app callbacks, matched exactly;
- at /authorize: the registered URI, compared in one normal form at both ends (`normal_form`: scheme and
  host lower-cased, RFC 3986 §6.2.2.1, nothing else: paths are case-sensitive), except that for an http
  loopback URI the port may differ (native apps bind an ephemeral port). Path and query stay byte-equal.
- a URI that the SDK's URL model would store differently (a default port, dot segments, an empty path,
  an IDN host) is refused at registration, naming the form to register instead: what is stored is then
  what the client sends, up to the case of scheme and host.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final
from urllib.parse import SplitResult, urlsplit

from pydantic import AnyUrl, ValidationError

LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})
MAX_URI_CHARS: Final = 2000


def _split(uri: str) -> SplitResult | None:
    try:
        parts = urlsplit(uri)
        _ = parts.port  # raises ValueError on a malformed port
    except ValueError:
        return None
    return parts


def normal_form(uri: str) -> str:
    """`uri` with its scheme and host lower-cased (RFC 3986 §6.2.2.1); userinfo, port, path, query as sent."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hostport = authority.rpartition("@")
    return f"{scheme.lower()}://{userinfo}{at}{hostport.lower()}{tail}"


def _stored_form_problem(uri: str) -> str | None:
    """The SDK keeps redirect URIs as pydantic URLs: refuse one whose stored form would not match it."""
    try:
        stored = str(AnyUrl(uri))
    except ValidationError:
        return "redirect URI is not a valid URL"
    if normal_form(stored) != normal_form(uri):
        return f"redirect URI is not in normal form: register {stored[:MAX_URI_CHARS]!r} instead"
    return None


def registration_problem(uri: str, app_callbacks: Iterable[str]) -> str | None:
    """Why `uri` may not be registered as a redirect URI, or None if it may."""
    if normal_form(uri) in {normal_form(callback) for callback in app_callbacks}:
        return None
    if len(uri) > MAX_URI_CHARS:
        return "redirect URI is too long"
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F or ch in "\\<>\"'`{}|^" for ch in uri):
        return "redirect URI contains characters that are not allowed"
    parts = _split(uri)
    if parts is None:
        return "redirect URI is not a valid URL"
    if "#" in uri:
        return "redirect URI must not have a fragment"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "redirect URI must not contain user information"
    host = parts.hostname or ""
    if not host or "*" in host or "%" in host:
        return "redirect URI must name a plain host"
    scheme = parts.scheme.lower()
    if scheme != "https" and not (scheme == "http" and host in LOOPBACK_HOSTS):
        return "redirect URI must be https, http on a loopback address, or a known app callback"
    return _stored_form_problem(uri)


def matches_registered(requested: str, registered: Iterable[str]) -> bool:
    """True if `requested` is a registered URI, or one with only the port changed on an http loopback URI.

    Both sides are compared in `normal_form`, so a URI registered as `https://Example.com/CB` (stored as
    `https://example.com/CB`) matches what the client sends, and `/cb` never matches `/CB`.
    """
    requested = normal_form(requested)
    registered = tuple(normal_form(uri) for uri in registered)
    if requested in registered:
        return True
    asked = _split(requested)
    if asked is None or asked.scheme != "http" or asked.hostname not in LOOPBACK_HOSTS or "@" in asked.netloc:
        return False
    for uri in registered:
        known = _split(uri)
        if known is None or known.scheme != "http" or known.hostname not in LOOPBACK_HOSTS:
            continue
        same = (
            known.hostname == asked.hostname
            and known.path == asked.path
            and known.query == asked.query
            and not known.fragment
            and not asked.fragment
            and "#" not in requested
        )
        if same and _host_spelling(known) == _host_spelling(asked):
            return True
    return False


def _host_spelling(parts: SplitResult) -> str:
    """The host as written in the netloc (without the port), so 127.0.0.1 never matches localhost."""
    netloc = parts.netloc
    if netloc.startswith("["):
        return netloc[: netloc.index("]") + 1]
    return netloc.rsplit(":", 1)[0] if ":" in netloc else netloc
