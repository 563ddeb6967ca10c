"""Client ID Metadata Documents: a stranger cannot spend a host's fetch budget or the resolver's threads.

What this proves, with the real fetcher against a real local HTTPS server (standing in for a public host
by replacing only the address predicate, as test_cimd.py does) and against a live server: URLs refused by
their shape spend none of a host's 30 fetches a minute; a URL whose document was good refreshes outside
that budget, so strangers spending it on other paths cannot make a working client "unknown"; lookups of
names whose DNS never answers run in threads of their own, at most `MAX_LOOKUPS` at once (one kept for
known URLs), refused at once past that, and never hold the event loop's shared executor. No DNS here: a
name that never answers is played by `socket.getaddrinfo` waiting for the test to let it go. What it does
not prove: a first fetch of a URL while strangers spend its host's budget with well-formed URLs (each a
real fetch from that host, 30 a minute): that one waits for the minute to pass.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import anyio
import httpx2
import pytest

from bastion.transports.http import cimd

from .clients import assert_clients_connect
from .live import LiveServer, pkce
from .test_cimd import DocumentServer, fetcher_for

pytestmark = pytest.mark.anyio
NEVER_ANSWERS = ".never-answers.test"


def _authorize(client_id: str, challenge: str) -> str:
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": "http://127.0.0.1/callback",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    return f"/authorize?{httpx2.QueryParams(query)}"


def test_malformed_urls_on_a_host_do_not_spend_its_fetch_budget(
    start_proxied_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """The attack against a live server: from another address (played with X-Forwarded-For: all of loopback
    is one address now), 30 /authorize with client_id
    URLs on the victim's host that have a space in the path. Before, each spent one of the host's 30
    fetches a minute though none was fetched, and the host's real client URL was then "not fetched" and
    /authorize said "unknown client" for the rest of the minute, every minute. Invariant: a URL refused by
    its shape costs none of the budget, so the real URL is fetched (here: refused by the address guard,
    127.0.0.1 not being public, which shows the fetch ran); registered clients still connect."""
    with start_proxied_server() as server:
        _, challenge = pkce()
        host = f"127.0.0.1:{server.port}"
        with server.http(headers={"X-Forwarded-For": "198.51.100.7"}) as stranger:
            for n in range(cimd.FETCHES_PER_HOST_PER_MINUTE):  # also /authorize's limit per address
                answer = stranger.get(_authorize(f"https://{host}/x {n}", challenge))
                assert answer.status_code == 400
                assert "unknown client" in answer.text
        real = f"https://{host}/oauth/client-metadata.json"
        with server.http(headers={"X-Forwarded-For": "198.51.100.8"}) as raw:
            assert raw.get(_authorize(real, challenge)).status_code == 400
        log = server.log()
        assert "not fetched" not in log
        assert f"{real} refused: 127.0.0.1 resolves to a non-public address" in log
        assert_clients_connect(server)


@pytest.fixture
def documents(tmp_path: Any) -> Iterator[DocumentServer]:
    server = DocumentServer(tmp_path)
    yield server
    server.close()


async def test_a_stranger_spending_a_hosts_budget_cannot_make_a_known_client_unknown(
    documents: DocumentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: once a client's document has fetched, a stranger spends its host's budget (bad
    documents on other paths, each a real fetch) and waits for the cached answer to expire. Before, the
    client's own URL was then "not fetched" (unknown client) until the minute passed, as often as the
    stranger liked. Invariant: a URL that fetched well refreshes outside the budget (still one fetch per
    cache lifetime); malformed URLs spend nothing; a URL never fetched waits for the minute (the limit
    still holds for strangers)."""
    monkeypatch.setattr(cimd, "FETCHES_PER_HOST_PER_MINUTE", 3)
    monkeypatch.setattr(cimd, "CACHE_TTL_S", 0.0)  # every ask after a good fetch is a refresh
    fetcher = fetcher_for(documents)
    good = documents.url("/client.json")
    assert await fetcher.client(good) is not None
    for n in range(10):
        assert await fetcher.client(documents.url(f"/bad {n}.json")) is None  # malformed: no fetch
    assert sum(documents.hits.values()) == 1
    for path in ("/redirect.json", "/big.json"):
        assert await fetcher.client(documents.url(path)) is None  # fetched, refused: the budget is spent
    assert await fetcher.client(documents.url("/never-fetched.json")) is None
    assert "/never-fetched.json" not in documents.hits
    for expected_hits in (2, 3):
        refreshed = await fetcher.client(good)
        assert refreshed is not None
        assert refreshed.client_id == good
        assert documents.hits["/client.json"] == expected_hits


async def test_hostnames_whose_dns_never_answers_cannot_hold_the_loops_executor(
    documents: DocumentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: client_id URLs on 40 different names whose DNS never answers (distinct hosts, so the
    per-host budget does not apply). Before, each lookup took a thread of the event loop's default
    executor (min(32, CPUs + 4) threads) and kept it after the fetch gave up at its time limit: once they
    were all held, everything else that runs there (other name lookups) waited. Invariant: lookups run in
    threads of their own, at most MAX_LOOKUPS at once counting those given up on, the others refused at
    once; the default executor stays free, and a known client's URL still refreshes (the kept slot)."""
    released = threading.Event()
    real_getaddrinfo = socket.getaddrinfo

    def never_answers(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode("ascii") if isinstance(host, bytes) else str(host)  # anyio passes it encoded
        if name.endswith(NEVER_ANSWERS):
            released.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(cimd, "FETCH_TIMEOUT_S", 2.0)
    monkeypatch.setattr(cimd, "CACHE_TTL_S", 0.0)
    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    fetcher = fetcher_for(documents)
    good = documents.url("/client.json")
    try:
        assert await fetcher.client(good) is not None
        started = time.monotonic()
        async with anyio.create_task_group() as tasks:
            for n in range(40):
                tasks.start_soon(fetcher.client, f"https://h{n}{NEVER_ANSWERS}/client.json")
        assert time.monotonic() - started < 10
        with anyio.fail_after(5):  # the loop's shared executor is free
            await asyncio.get_running_loop().run_in_executor(None, int)
        assert await fetcher.client(good) is not None  # the slot kept for known URLs
        started = time.monotonic()
        assert await fetcher.client(f"https://late{NEVER_ANSWERS}/client.json") is None
        assert time.monotonic() - started < 1, "refused at once, not after the time limit"
        assert _lookup_threads() <= cimd.MAX_LOOKUPS
    finally:
        released.set()
    with anyio.fail_after(10):
        while _lookup_threads():
            await anyio.sleep(0.01)


def _lookup_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "cimd-lookup")
