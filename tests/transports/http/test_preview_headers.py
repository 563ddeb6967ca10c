"""The preview proxy's header and path rules (`bastion.transports.http.preview`), as pure functions.

What this proves: Authorization, hop-by-hop headers and every cookie but the app's own never go to the app;
the app's cookies are renamed with its preview's prefix, stay on its preview's path and cannot use bastion's
names, `__Host-`/`__Secure-` or a Domain; dot segments after the token (plain or percent-encoded) are refused.
The live behaviour is in test_preview.py and test_preview_cookies.py.
"""

from __future__ import annotations

import re

import pytest

from bastion.transports.http.preview import (
    confine_cookie,
    cookie_prefix,
    request_headers,
    response_headers,
    split_target,
)
from bastion.workbench.previews import token_id

TOKEN = "t" * 43
OTHER = "o" * 43
MINE = cookie_prefix(TOKEN)


@pytest.mark.parametrize(
    "path",
    [f"/preview/{TOKEN}/..", f"/preview/{TOKEN}/%2e%2e/x", f"/preview/{TOKEN}/a/%2E/b", "/preview/short/", "/admin"],
)
def test_split_target_refuses_dot_segments_and_other_shapes(path: str) -> None:
    assert split_target(path) is None


def test_split_target_keeps_the_path_for_the_app() -> None:
    assert split_target(f"/preview/{TOKEN}/a/b%20c") == (TOKEN, "/a/b%20c")
    assert split_target(f"/preview/{TOKEN}") == (TOKEN, "")


def test_request_headers_drop_bastions_cookies_authorization_and_hop_by_hop() -> None:
    headers = [
        (b"host", b"127.0.0.1:9999"),
        (b"cookie", f"__Host-bastion-admin=s; __Host-bastion-browser=b; BASTION_x=1; {MINE}sid=1".encode()),
        (b"authorization", b"Bearer x"),
        (b"connection", b"keep-alive, x-private"),
        (b"x-private", b"1"),
        (b"proxy-authorization", b"Basic y"),
        (b"accept", b"text/html"),
    ]
    assert request_headers(headers, 8000, 0, TOKEN) == [
        (b"host", b"127.0.0.1:8000"),
        (b"content-length", b"0"),
        (b"cookie", b"sid=1"),
        (b"accept", b"text/html"),
    ]


def test_a_preview_app_is_sent_only_the_cookies_its_own_responses_set() -> None:
    """Attack: the browser sends the host's every cookie to the preview origin: another port's app's login
    cookie, another preview's `Path=/` script cookie or its prefixed app cookie, a nameless cookie holding
    the prefix, the bare prefix. Invariant: none reaches the app; its own come back under their names."""
    cookies = (
        f"jupyter_session=HOST-SECRET; auth_token=B-SECRET; {cookie_prefix(OTHER)}sid=B; {MINE}; {MINE}=x; "
        f"{MINE.upper()}sid=u; x{MINE}sid=x; {MINE}sid=mine; {MINE}theme=dark=1"
    )
    headers = request_headers([(b"cookie", cookies.encode())], 8000, 0, TOKEN)
    assert headers[2:] == [(b"cookie", b"sid=mine; theme=dark=1")]
    only_others = [(b"cookie", b"jupyter_session=HOST-SECRET; auth_token=B-SECRET")]
    assert request_headers(only_others, 8000, 0, TOKEN)[2:] == []


def test_the_cookie_prefix_comes_from_the_secret_token_not_its_audited_digest() -> None:
    assert cookie_prefix(TOKEN) != cookie_prefix(OTHER)
    assert re.fullmatch(r"pv[0-9a-f]{12}_", MINE)
    assert token_id(TOKEN) not in MINE


@pytest.mark.parametrize(
    ("header", "confined"),
    [
        ("a=1", "{p}a=1; Path=/preview/T/; Priority=Low"),
        ("a=1; Path=/; HttpOnly", "{p}a=1; HttpOnly; Path=/preview/T/; Priority=Low"),
        ("a=1; path=/admin; Secure", "{p}a=1; Secure; Path=/preview/T/; Priority=Low"),
        (" a = 1 ; Max-Age=0", "{p}a=1; Max-Age=0; Path=/preview/T/; Priority=Low"),
        ("a=1; Priority=High; Secure", "{p}a=1; Secure; Path=/preview/T/; Priority=Low"),
        ("a=1; Domain=example.com", None),
        ("__Host-bastion-admin=evil; Path=/; Secure", None),
        ("__Secure-x=1", None),
        ("bastion-anything=1", None),
        ("=novalue", None),
        ("nameless", None),
    ],
)
def test_the_apps_cookies_stay_on_its_preview(header: str, confined: str | None) -> None:
    expected = None if confined is None else confined.format(p=cookie_prefix("T"))
    assert confine_cookie(header, "T") == expected


def test_response_headers_drop_host_wide_ones_and_prefix_redirects() -> None:
    headers = [
        (b"strict-transport-security", b"max-age=1"),
        (b"clear-site-data", b'"*"'),
        (b"service-worker-allowed", b"/"),
        (b"www-authenticate", b'Basic realm="bastion admin"'),
        (b"location", b"/next"),
        (b"set-cookie", b"sid=1; Path=/; HttpOnly"),
        (b"content-type", b"text/html"),
        (b"transfer-encoding", b"chunked"),
    ]
    assert response_headers(headers, TOKEN) == [
        (b"location", f"/preview/{TOKEN}/next".encode()),
        (b"set-cookie", f"{MINE}sid=1; HttpOnly; Path=/preview/{TOKEN}/; Priority=Low".encode()),
        (b"content-type", b"text/html"),
    ]
