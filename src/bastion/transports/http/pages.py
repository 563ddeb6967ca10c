"""HTML for the administrator's pages: login, consent, errors, admin. Every value is escaped.

Headers on every page (RFC 9700 §4.16, MCP security best practices, consent UI): no framing
(`frame-ancestors 'none'`, `X-Frame-Options: DENY`), no caching, no referrer, no scripts, and no inline
style: the one stylesheet is /static/bastion.css (`style-src 'self'`). The administrator's dashboard
pages are Jinja2 templates (`views.py`); these f-string helpers remain for the login and consent pages.
"""

from __future__ import annotations

import html
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Final

from starlette.responses import HTMLResponse, RedirectResponse, Response

_CSP: Final = "default-src 'none'; style-src 'self'; frame-ancestors 'none'; base-uri 'none'"
PAGE_HEADERS: Final = {
    "Content-Security-Policy": _CSP,
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "Pragma": "no-cache",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}

SCOPE_TEXT: Final = {
    "workbench": "Workbench: run commands and read and write files in workspaces and sandboxes",
    "organizer": "Organizer: list, plan and move files in the inboxes",
    "gateway:read": "Gateway (read): read-only actions on production hosts",
    "gateway:deploy": "Gateway (deploy): deploy actions on production hosts (each may need approval)",
}


# Control, format (bidi overrides such as U+202E, zero-width), private-use, surrogate and line/paragraph
# separators: in a name they can make it read as another (Trojan Source, CVE-2021-42574).
_HIDDEN_CATEGORIES: Final = frozenset({"Cc", "Cf", "Co", "Cs", "Zl", "Zp"})


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def shown(value: object) -> str:
    """A name a client chose with every invisible or bidi character shown as `\\uXXXX`; not HTML-escaped
    (the caller or the template escapes it)."""
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in _HIDDEN_CATEGORIES else c for c in str(value))


def label(value: str) -> str:
    """A name a client chose, escaped, with every invisible or bidi character shown as `\\uXXXX`, isolated."""
    return f"<bdi>{esc(shown(value))}</bdi>"


def page(title: str, body: str, *, status: int = 200, headers: Mapping[str, str] | None = None) -> HTMLResponse:
    document = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/bastion.css"></head>'
        f"<body><h1>{esc(title)}</h1>{body}</body></html>"
    )
    return HTMLResponse(document, status_code=status, headers={**PAGE_HEADERS, **(headers or {})})


def error_page(message: str, *, status: int = 400) -> HTMLResponse:
    """A refusal shown to the browser; never a redirect to a URI we could not trust."""
    return page("bastion: request refused", f'<p class="err">{esc(message)}</p>', status=status)


def see_other(url: str, headers: Mapping[str, str] | None = None) -> RedirectResponse:
    """303 after a POST, so the browser never re-posts the form (RFC 9700 §4.12: never 307)."""
    return RedirectResponse(url, status_code=303, headers={**PAGE_HEADERS, **(headers or {})})


def hidden(fields: Mapping[str, str]) -> str:
    return "".join(f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">' for k, v in fields.items())


def login_form(action: str, fields: Mapping[str, str], *, message: str = "", context: str = "") -> str:
    note = f'<p class="err" role="alert">{esc(message)}</p>' if message else ""
    return (
        f"{context}{note}<form method="
        f'"post" action="{esc(action)}">{hidden(fields)}'
        '<p><label>Administrator password<br><input type="password" name="password" autocomplete="current-password"'
        ' required autofocus size="30"></label></p><p><button type="submit">Log in</button></p></form>'
    )


def consent_body(
    *,
    client_name: str,
    client_id: str,
    redirect_host: str,
    flagged: bool,
    scopes: Iterable[str],
    checked: Iterable[str],
    fields: Mapping[str, str],
) -> str:
    """The consent form: `scopes` offered, only `checked` ticked (the administrator ticks the rest)."""
    name = label(client_name) if client_name else "<em>(no name given)</em>"
    ticked = set(checked)
    warn = (
        '<div class="box warn"><strong>Check this address.</strong> It is not a loopback address or a known app: '
        "approve only if you started this connection from it.</div>"
        if flagged
        else ""
    )
    boxes = "".join(
        f'<p><label><input type="checkbox" name="scope" value="{esc(s)}"{" checked" if s in ticked else ""}> '
        f"{esc(SCOPE_TEXT.get(s, s))}"
        f" (<code>{esc(s)}</code>)</label></p>"
        for s in scopes
    )
    return (
        f'<div class="box"><p>The application <strong>{name}</strong> asks for access to this bastion server.</p>'
        f"<p>Client id: <code>{label(client_id)}</code></p>"
        f"<p>After your answer, your browser goes to: <strong>{label(redirect_host)}</strong></p></div>{warn}"
        f'<form method="post" action="/oauth/consent">{hidden(fields)}'
        f"<p>Allow it to use (only what is ticked is granted):</p>{boxes}"
        '<p><button type="submit" name="decision" value="approve">Approve</button>'
        '<button type="submit" name="decision" value="deny">Deny</button></p></form>'
    )


def too_many(retry_after: float, message: str = "", *, status: int = 429) -> Response:
    """429 (or 503 when the server is busy) with Retry-After: the request was refused before any work."""
    seconds = max(1, int(retry_after + 0.999))
    text = message or f"Too many failed attempts. Try again in {seconds} s."
    return page(
        "bastion: too many attempts",
        f'<p class="err" role="alert">{esc(text)}</p>',
        status=status,
        headers={"Retry-After": str(seconds)},
    )
