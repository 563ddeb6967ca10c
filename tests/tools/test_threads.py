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

from bastion.tools.threads import MAX_THREADS_PER_CALLER, MAX_THREADS_PER_PLACE, CallerBound, ThreadShares

pytestmark = pytest.mark.anyio


class _Place:
    """A workspace or an inbox, for the shares: any object a weak reference can name."""


class _Blocked:
    """Work that waits in its thread until released, counting how many run at once (now and at most)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(30)
        with self._lock:
            self.running -= 1

    async def until_running(self, count: int) -> None:
        """Wait until `count` run, and the tasks that could start more are all waiting."""
        with anyio.fail_after(10):
            while self.running < count:
                await anyio.sleep(0.01)
        await anyio.wait_all_tasks_blocked()


def _as(client_id: str) -> None:
    token = AccessToken(token=f"t-{client_id}", client_id=client_id, scopes=["workbench"], expires_at=None)
    auth_context_var.set(AuthenticatedUser(token))


async def test_one_callers_burst_over_many_places_leaves_threads_for_another_caller() -> None:
    """Found by review: shares per workspace only (4 each) let one agent with 11 sandboxes hold 44 threads,
    more than anyio's 40, and another agent's read waited behind all of its calls. A caller holds at most
    MAX_THREADS_PER_CALLER threads across its places."""
    shares = ThreadShares()
    places = [_Place() for _ in range(11)]
    work = _Blocked()
    other_ran = anyio.Event()

    async def burst(place: _Place) -> None:
        _as("agent-a")
        await shares.run(place, work)

    async def other() -> None:
        _as("agent-b")
        await shares.run(_Place(), lambda: None)
        other_ran.set()

    async with anyio.create_task_group() as group:
        for n in range(66):
            group.start_soon(burst, places[n % len(places)])
        await work.until_running(MAX_THREADS_PER_CALLER)
        group.start_soon(other)
        with anyio.fail_after(10):
            await other_ran.wait()  # while every call of agent-a's is still held
        assert work.running == MAX_THREADS_PER_CALLER
        work.release.set()
    assert work.most == MAX_THREADS_PER_CALLER


async def test_one_place_holds_at_most_its_share() -> None:
    shares = ThreadShares()
    place = _Place()
    work = _Blocked()
    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(shares.run, place, work)
        await work.until_running(MAX_THREADS_PER_PLACE)
        assert work.running == MAX_THREADS_PER_PLACE
        work.release.set()
    assert work.most == MAX_THREADS_PER_PLACE


async def test_one_callers_searches_waiting_for_its_full_share_leave_another_callers_search_alone() -> None:
    """Found by review: searches take their bound (2) before the shares, and the bound was one for the whole
    server, so agent-a's two searches, waiting for agent-a's caller share that its other calls filled, held
    both slots and agent-b's search waited for agent-a's calls to end. The bound is per caller."""
    shares, searches = ThreadShares(), CallerBound(2)
    work = _Blocked()
    searched = anyio.Event()

    async def slow_call() -> None:
        _as("agent-a")
        await shares.run(_Place(), work)

    async def search(client_id: str, done: anyio.Event | None = None) -> None:
        _as(client_id)
        await shares.run(_Place(), lambda: None, limiter=searches.mine())
        if done is not None:
            done.set()

    async with anyio.create_task_group() as group:
        for _ in range(MAX_THREADS_PER_CALLER):
            group.start_soon(slow_call)
        await work.until_running(MAX_THREADS_PER_CALLER)  # agent-a's caller share is full
        for _ in range(2):
            group.start_soon(search, "agent-a")
        await anyio.wait_all_tasks_blocked()
        group.start_soon(search, "agent-b", searched)
        with anyio.fail_after(10):
            await searched.wait()  # while agent-a's calls and searches are all still waiting
        assert work.running == MAX_THREADS_PER_CALLER
        work.release.set()
