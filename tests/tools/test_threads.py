"""ThreadShares: a place's and a caller's share of the worker threads, with real threads.

What this proves: one caller's burst across many places (an agent's many sandboxes) holds at most its
caller's share, so another caller's work gets a thread at once; and a place's share bounds one place.
Callers are told apart as the HTTP transport tells them, by the OAuth token in the request's context.
"""

from __future__ import annotations

import threading

import anyio
import pytest
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from bastion.tools.threads import MAX_THREADS_PER_CALLER, MAX_THREADS_PER_PLACE, ThreadShares

pytestmark = pytest.mark.anyio


class _Place:
    """A workspace or an inbox, for the shares: any object a weak reference can name."""


def _as(client_id: str) -> None:
    token = AccessToken(token=f"t-{client_id}", client_id=client_id, scopes=["workbench"], expires_at=None)
    auth_context_var.set(AuthenticatedUser(token))


async def test_one_callers_burst_over_many_places_leaves_threads_for_another_caller() -> None:
    """Found by review: shares per workspace only (4 each) let one agent with 11 sandboxes hold 44 threads,
    more than anyio's 40, and another agent's read waited behind all of its calls. A caller holds at most
    MAX_THREADS_PER_CALLER threads across its places."""
    shares = ThreadShares()
    places = [_Place() for _ in range(11)]
    release = threading.Event()
    running = [0]
    most = [0]
    lock = threading.Lock()

    def blocked() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1

    other_ran = anyio.Event()

    async def burst(place: _Place) -> None:
        _as("agent-a")
        await shares.run(place, blocked)

    async def other() -> None:
        _as("agent-b")
        await shares.run(_Place(), lambda: None)
        other_ran.set()

    async with anyio.create_task_group() as group:
        for n in range(66):
            group.start_soon(burst, places[n % len(places)])
        with anyio.fail_after(10):
            while running[0] < MAX_THREADS_PER_CALLER:
                await anyio.sleep(0.01)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(other)
        with anyio.fail_after(10):
            await other_ran.wait()  # while every call of agent-a's is still held
        assert running[0] == MAX_THREADS_PER_CALLER
        release.set()
    assert most[0] == MAX_THREADS_PER_CALLER


async def test_one_place_holds_at_most_its_share() -> None:
    shares = ThreadShares()
    place = _Place()
    release = threading.Event()
    running = [0]
    most = [0]
    lock = threading.Lock()

    def blocked() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1

    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(shares.run, place, blocked)
        with anyio.fail_after(10):
            while running[0] < MAX_THREADS_PER_PLACE:
                await anyio.sleep(0.01)
        await anyio.wait_all_tasks_blocked()
        assert running[0] == MAX_THREADS_PER_PLACE
        release.set()
    assert most[0] == MAX_THREADS_PER_PLACE
