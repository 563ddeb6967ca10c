"""Fixtures: a live `bastion serve --http` per module, fresh ones for tests that change its state, and a
socket pair for the preview relay tests."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from .live import TRUST_LOOPBACK_PROXY, Browser, LiveServer, live_server

# The shared server takes many registrations and authorization requests from one address (every test
# registers its own client, and many leave a request undecided).
SHARED_HTTP = (
    'extra_origins = ["http://localhost:6274"]\nregistrations_per_ip_per_hour = 10000\nmax_clients = 100000\n'
    "authorize_per_ip_per_minute = 100000\npending_authorizations_per_ip = 1000\n"
    # Tests play other addresses with X-Forwarded-For, as a reverse proxy on loopback would send it.
    f"{TRUST_LOOPBACK_PROXY}"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One live server shared by a module's tests (each test registers its own clients)."""
    with live_server(tmp_path_factory.mktemp("http") / "demo", http_extra=SHARED_HTTP) as live:
        yield live


@pytest.fixture
def start_server(tmp_path: Path) -> Callable[..., AbstractContextManager[LiveServer]]:
    """A fresh server, for tests that lock out logins or revoke everything."""
    count = 0

    def start(**kwargs: object) -> AbstractContextManager[LiveServer]:
        nonlocal count
        count += 1
        return live_server(tmp_path / f"demo{count}", **kwargs)  # type: ignore[arg-type]

    return start


@pytest.fixture
def start_proxied_server(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> Callable[..., AbstractContextManager[LiveServer]]:
    """A fresh server behind a (played) reverse proxy on loopback: X-Forwarded-For names the client."""
    return functools.partial(start_server, behind_proxy=True)


@pytest.fixture
def browsers() -> Iterator[Callable[[LiveServer], Browser]]:
    """Scripted browsers, closed at the end of the test."""
    made: list[Browser] = []

    def make(server: LiveServer) -> Browser:
        browser = Browser(server)
        made.append(browser)
        return browser

    yield make
    for browser in made:
        browser.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The relay's side and the app's side of one connection, both non-blocking."""
    proxy_side, app_side = socket.socketpair()
    for sock in (proxy_side, app_side):
        sock.setblocking(False)
    yield proxy_side, app_side
    proxy_side.close()
    app_side.close()
