"""Races on a sandbox's code contexts through the real tools, in real sandboxes: calls that start,
or restart, contexts at the same time. Each test checks the answer every call gets (a typed refusal,
never an internal error), how many kernels run in the sandbox afterwards (`ps` inside it), and that
the contexts left still work."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mcp import Client

from bastion.sandbox import KERNEL_PATH
from bastion.workbench.code import MAX_CONTEXTS
from tests.helpers import call, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

# The refusal of a call finding its context busy with another call (CONFLICT).
BUSY = "is running other code"
# The kernels' command lines; the bracket keeps grep's own out of its count.
COUNT_KERNELS = f"ps -eo args | grep -c '[{KERNEL_PATH[0]}]{KERNEL_PATH[1:]}'"


async def run(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, **args)


async def kernels(client: Client, sandbox_id: str) -> int:
    result = await sh(client, sandbox_id, COUNT_KERNELS)
    return int(result["detail"]["stdout"])


async def listed(client: Client, sandbox_id: str) -> list[str]:
    result = await call(client, "list_code_contexts", sandbox_id=sandbox_id)
    return sorted(context["context"] for context in result["detail"]["contexts"])


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert all(record.exc_info is None for record in caplog.records), caplog.text
    assert "Traceback" not in caplog.text


async def test_30_concurrent_starts_of_distinct_contexts_stop_at_the_limit(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: 30 execute_code calls at once, each naming a new context. The limit was checked before the
    kernel started and the context stored only after: all 30 passed, 30 kernels ran. Invariant: exactly
    MAX_CONTEXTS start, the rest are refused with the limit's RESOURCE_LIMIT, and the sandbox runs exactly
    that many kernels, each of them a listed, working context. Does not prove which calls win."""
    caplog.set_level(logging.WARNING)
    sandbox = await create(client)
    names = [f"c{i}" for i in range(30)]
    results = await asyncio.gather(*(run(client, sandbox, "1", context=name) for name in names))
    started = sorted((name for name, result in zip(names, results, strict=True) if result["ok"]), key=names.index)
    refused = [result for result in results if not result["ok"]]
    assert len(started) == MAX_CONTEXTS, [result["code"] for result in results]
    assert {result["code"] for result in refused} == {"RESOURCE_LIMIT"}, refused
    assert all(f"{MAX_CONTEXTS} contexts are open" in result["reason"] for result in refused), refused
    assert await kernels(client, sandbox) == MAX_CONTEXTS
    assert await listed(client, sandbox) == sorted(started)
    for name in started:
        again = await run(client, sandbox, "2 + 2", context=name)
        assert again["detail"]["value"] == "4", again
    assert_no_traceback(caplog)


async def test_10_concurrent_calls_starting_one_new_context_start_one_kernel(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: 10 execute_code calls at once on one new context name, three rounds. Each started a kernel of
    its own and only the last was kept: the others ran on, unlisted and unkillable, until the sandbox closed.
    Invariant: the calls share one start; each is answered (the code ran, or CONFLICT: the context was busy
    with another of them), the sandbox runs one kernel, and a restart leaves one. Does not prove which call
    runs first."""
    caplog.set_level(logging.WARNING)
    sandbox = await create(client)
    for _ in range(3):
        results = await asyncio.gather(*(run(client, sandbox, "1", context="same") for _ in range(10)))
        assert all(result["ok"] or BUSY in result["reason"] for result in results), results
        assert any(result["ok"] for result in results)
        assert await kernels(client, sandbox) == 1, caplog.text
    assert await listed(client, sandbox) == ["same"]
    fresh = await run(client, sandbox, "3 * 3", context="same", restart=True)
    assert fresh["detail"]["value"] == "9", fresh
    assert await kernels(client, sandbox) == 1
    assert_no_traceback(caplog)


async def test_2_concurrent_restarts_of_one_context_both_answer_and_leave_one_kernel(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: two execute_code(restart=true) calls at once on a running context. Both killed it, and the
    second's `del` of the entry raised KeyError: INTERNAL_ERROR, with a traceback in the server's log.
    Invariant: both are answered with a result of the code or a typed refusal (CONFLICT: the one fresh
    context was busy with the other call), one kernel runs afterwards, and the context works (its state
    is fresh). Does not prove which call runs its code first."""
    caplog.set_level(logging.WARNING)
    sandbox = await create(client)
    assert (await run(client, sandbox, "x = 1"))["ok"]
    for _ in range(3):
        results = await asyncio.gather(*(run(client, sandbox, "1", restart=True) for _ in range(2)))
        assert all(result["ok"] or BUSY in result["reason"] for result in results), results
        assert any(result["ok"] for result in results)
        assert await kernels(client, sandbox) == 1, caplog.text  # the log says if the sandbox itself ended
    assert await listed(client, sandbox) == ["default"]
    after = await run(client, sandbox, "'x' in globals()")
    assert after["detail"]["value"] == "False", after
    assert_no_traceback(caplog)
