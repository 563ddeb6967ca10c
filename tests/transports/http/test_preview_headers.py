"""The preview proxy's header and path rules (`bastion.transports.http.preview`), as pure functions.

What this proves: bastion's cookies, Authorization and hop-by-hop headers never go to the app; the app's
cookies stay on its preview's path and cannot use bastion's names, `__Host-`/`__Secure-` or a Domain;
dot segments after the token (plain or percent-encoded) are refused. The live behaviour is in test_preview.py.
"""

from __future__ import annotations

import pytest

from bastion.transports.http.preview import confine_cookie, request_headers, response_headers, split_target

TOKEN = "t" * 43


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
        (b"cookie", b"__Host-bastion-admin=s; __Host-bastion-browser=b; BASTION_x=1; theirs=1"),
        (b"authorization", b"Bearer x"),
        (b"connection", b"keep-alive, x-private"),
        (b"x-private", b"1"),
        (b"proxy-authorization", b"Basic y"),
        (b"accept", b"text/html"),
    ]
    assert request_headers(headers, 8000, 0) == [
        (b"host", b"127.0.0.1:8000"),
        (b"content-length", b"0"),
        (b"cookie", b"theirs=1"),
        (b"accept", b"text/html"),
    ]


@pytest.mark.parametrize(
    ("header", "confined"),
    [
        ("a=1", "a=1; Path=/preview/T/"),
        ("a=1; Path=/; HttpOnly", "a=1; HttpOnly; Path=/preview/T/"),
        ("a=1; path=/admin; Secure", "a=1; Secure; Path=/preview/T/"),
        ("a=1; Domain=example.com", None),
        ("__Host-bastion-admin=evil; Path=/; Secure", None),
        ("__Secure-x=1", None),
        ("bastion-anything=1", None),
        ("=novalue", None),
    ],
)
def test_the_apps_cookies_stay_on_its_preview(header: str, confined: str | None) -> None:
    assert confine_cookie(header, "/preview/T") == confined


def test_response_headers_drop_host_wide_ones_and_prefix_redirects() -> None:
    headers = [
        (b"strict-transport-security", b"max-age=1"),
        (b"clear-site-data", b'"*"'),
        (b"service-worker-allowed", b"/"),
        (b"www-authenticate", b'Basic realm="bastion admin"'),
        (b"location", b"/next"),
        (b"content-type", b"text/html"),
        (b"transfer-encoding", b"chunked"),
    ]
    assert response_headers(headers, TOKEN) == [
        (b"location", f"/preview/{TOKEN}/next".encode()),
        (b"content-type", b"text/html"),
    ]
