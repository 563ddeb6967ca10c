"""Load (issue 19): many HTTP clients, a population of sandboxes, a mix of calls, nothing lost.

What this proves, against a real `bastion serve --http` with real bwrap sandboxes (disk quota,
cgroups, warm pool) and real SDK clients with bearer tokens on both protocol eras: under concurrency,
no call fails other than the refusals the mix asks for (path escapes, missing files, a closed
sandbox), every answer is right (what a client reads back is what it wrote, code cells compute, a
closed sandbox is gone for everyone), every answered call has its audit `end` record exactly once (by
the `audit_id` of each answer) and no start record is left without its end, `bastion audit verify`
passes, the server logs no traceback, and once the population is closed the server holds what it held
before (cgroups, mounts, loop devices, processes). p50/p99 per tool and throughput go to a markdown
report (BASTION_LOAD_REPORT, else the test's temp folder).

What it does not prove: figures on another machine; faults (the fault suite); hours of running (soak).
The fast variant runs by default; the full one (issue sizes: 100 sandboxes, 32 clients, 5 minutes) is
marked `load`: `make load`, sizes overridable with BASTION_LOAD_SANDBOXES, _CLIENTS, _SECONDS.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .driver import Plan, env_float, env_int, run_checked
from .measure import machine_line, report_path, today, tool_table, write_section

pytestmark = [pytest.mark.bwrap, pytest.mark.root]

FAST = Plan(sandboxes=20, clients=8, duration_s=35)


def full_plan() -> Plan:
    return Plan(
        sandboxes=env_int("BASTION_LOAD_SANDBOXES", 100),
        clients=env_int("BASTION_LOAD_CLIENTS", 32),
        duration_s=env_float("BASTION_LOAD_SECONDS", 300),
    )


async def check_load(tmp_path: Path, plan: Plan) -> None:
    run = await run_checked(tmp_path / "server", plan)
    write_section(
        report_path(tmp_path),
        "## Load",
        f"Run {today()} on {machine_line()}: {plan.sandboxes} sandboxes, {plan.clients} HTTP clients (bearer "
        f"tokens, both protocol eras), {run.seconds:.0f} s of mix as fast as the clients go: "
        f"{run.phase.calls_in_mix} calls, **{run.throughput:.1f} calls/s**. Latency is each call's as its "
        f"client saw it (set-up and tear-down calls included).\n\n{tool_table(run.tally)}\n\n{run.summary()}",
    )
    problems = run.problems()
    assert not problems, "\n".join(problems)


@pytest.mark.anyio
async def test_load_mix_of_clients_and_sandboxes_loses_no_call_and_no_audit_record(tmp_path: Path) -> None:
    await check_load(tmp_path, FAST)


@pytest.mark.load
@pytest.mark.anyio
async def test_full_load_100_sandboxes_32_clients_5_minutes(tmp_path: Path) -> None:
    await check_load(tmp_path, full_plan())
