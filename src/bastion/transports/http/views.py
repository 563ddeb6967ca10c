"""Jinja2 for the administrator's pages: autoescape on everywhere, undefined names are errors.

Every value a client or an agent chose (a client name, a sandbox label, an audit field) reaches a
template as data and is escaped by Jinja2; `shown` also makes invisible and bidi characters visible
(Trojan Source, CVE-2021-42574) and the templates wrap such names in `<bdi>`. No template holds a
script or a style attribute: the pages' CSP allows only the stylesheet at /static/bastion.css.
"""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import resources
from typing import Final

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from bastion.transports.http.pages import PAGE_HEADERS, shown

STYLESHEET_PATH: Final = "/static/bastion.css"
_STYLESHEET: Final = resources.files("bastion.transports.http").joinpath("static/bastion.css").read_bytes()

_ENV: Final = jinja2.Environment(
    loader=jinja2.PackageLoader("bastion.transports.http", "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def when(ts: object) -> str:
    """A Unix time as UTC to the second; '-' for none."""
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def size(value: object) -> str:
    """Bytes in binary units, e.g. 12.5 MiB."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} GiB"


def duration(seconds: object) -> str:
    """Seconds as the two largest units, e.g. 3h 12m."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return "-"
    left = int(seconds)
    parts = [(left // 86400, "d"), (left // 3600 % 24, "h"), (left // 60 % 60, "m"), (left % 60, "s")]
    shown_parts = [f"{n}{unit}" for n, unit in parts if n] or ["0s"]
    return " ".join(shown_parts[:2])


_ENV.filters.update(shown=shown, when=when, size=size, duration=duration)


def render(name: str, *, status: int = 200, **context: object) -> HTMLResponse:
    """A page from `templates/<name>`, with the headers every page has (CSP, no framing, no caching)."""
    text = _ENV.get_template(name).render(stylesheet=STYLESHEET_PATH, **context)
    return HTMLResponse(text, status_code=status, headers=PAGE_HEADERS)


async def stylesheet(request: Request) -> Response:
    """The one stylesheet of every page: the CSP's `style-src 'self'` allows it and nothing inline."""
    headers = {"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff"}
    return Response(_STYLESHEET, media_type="text/css", headers=headers)
