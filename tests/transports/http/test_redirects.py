"""Redirect-URI rules as data: what may be registered, and what /authorize matches.

What this proves: the registration rules and the loopback any-port rule on listed and generated
inputs (only the port of an http loopback URI may differ; anything else must be byte-equal).
What it does not prove: the HTTP handling around them (test_negative covers that live).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.transports.http.redirects import matches_registered, normal_form, registration_problem

APPS = ("cursor://anysphere.cursor-mcp/oauth/callback",)


@pytest.mark.parametrize(
    "uri",
    [
        "https://claude.ai/api/mcp/auth_callback",
        "http://127.0.0.1/callback",
        "http://localhost:33418/",
        "http://[::1]:8080/cb",
        "cursor://anysphere.cursor-mcp/oauth/callback",
        "https://vscode.dev/redirect?x=1",
    ],
)
def test_registrable(uri: str) -> None:
    assert registration_problem(uri, APPS) is None


@pytest.mark.parametrize(
    "uri",
    [
        "javascript:alert(1)",
        "data:text/html,x",
        "file:///etc/passwd",
        "http://evil.example/cb",
        "https://x.example/cb#f",
        "https://*.x.example/cb",
        "https://u:p@x.example/cb",
        "https://x.example:99999/cb",
        "cursor://anysphere.cursor-mcp/oauth/callback/",
        "vscode://evil/cb",
        "https://x.example/c b",
        "https:///nohost",
        "https://" + "a" * 3000 + ".example/",
    ],
)
def test_not_registrable(uri: str) -> None:
    assert registration_problem(uri, APPS) is not None


def test_loopback_port_may_change_only_the_port() -> None:
    registered = ["http://127.0.0.1/callback"]
    assert matches_registered("http://127.0.0.1:53123/callback", registered)
    assert matches_registered("http://127.0.0.1/callback", registered)
    for other in (
        "http://127.0.0.1:53123/other",
        "http://localhost:53123/callback",
        "https://127.0.0.1:53123/callback",
        "http://127.0.0.1:53123/callback?x=1",
        "http://127.0.0.1:53123/callback#x",
        "http://u@127.0.0.1:53123/callback",
        "http://127.0.0.1.evil.example:53123/callback",
    ):
        assert not matches_registered(other, registered), other


def test_https_is_exact_but_for_the_case_of_scheme_and_host() -> None:
    registered = ["https://claude.ai/api/mcp/auth_callback"]
    assert matches_registered("https://claude.ai/api/mcp/auth_callback", registered)
    assert not matches_registered("https://claude.ai:443/api/mcp/auth_callback", registered)
    # RFC 3986 §6.2.2.1: scheme and host are case-insensitive; the path is not.
    assert matches_registered("HTTPS://CLAUDE.ai/api/mcp/auth_callback", registered)
    assert not matches_registered("https://claude.ai/api/MCP/auth_callback", registered)
    assert not matches_registered("https://claude.ai/api/mcp/auth_callback/", registered)


@pytest.mark.parametrize(
    ("uri", "normal"),
    [
        ("HTTPS://Claude.AI/api/CB?Q=A", "https://claude.ai/api/CB?Q=A"),
        ("http://LocalHost:3000/Callback", "http://localhost:3000/Callback"),
        ("http://[::1]:8080/CB", "http://[::1]:8080/CB"),
        ("cursor://anysphere.cursor-mcp/oauth/callback", "cursor://anysphere.cursor-mcp/oauth/callback"),
    ],
)
def test_normal_form_changes_only_scheme_and_host(uri: str, normal: str) -> None:
    assert normal_form(uri) == normal
    assert normal_form(normal) == normal


@pytest.mark.parametrize(
    ("uri", "instead"),
    [
        ("https://x.example", "https://x.example/"),
        ("https://x.example:443/cb", "https://x.example/cb"),
        ("http://127.0.0.1:80/cb", "http://127.0.0.1/cb"),
        ("https://x.example/a/../cb", "https://x.example/cb"),
        ("https://bücher.example/cb", "https://xn--bcher-kva.example/cb"),
    ],
)
def test_redirect_uri_the_sdk_would_store_differently_is_refused(uri: str, instead: str) -> None:
    """What is stored must be what the client will send (up to the case of scheme and host)."""
    problem = registration_problem(uri, APPS)
    assert problem is not None
    assert repr(instead) in problem
    assert registration_problem(instead, APPS) is None


@given(st.text(max_size=200))
def test_matching_never_accepts_what_is_not_registered_or_loopback(uri: str) -> None:
    registered = ["https://claude.ai/api/mcp/auth_callback", "http://127.0.0.1/callback"]
    if matches_registered(uri, registered):
        normal = normal_form(uri)
        assert normal in registered or normal.startswith("http://127.0.0.1:")
        assert uri.endswith("/callback")


@given(st.integers(min_value=1, max_value=65535))
def test_any_port_on_a_registered_loopback_uri(port: int) -> None:
    assert matches_registered(f"http://[::1]:{port}/cb", ["http://[::1]/cb"])
    assert not matches_registered(f"http://[::1]:{port}/cb", ["http://127.0.0.1/cb"])
