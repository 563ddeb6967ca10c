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

import os
from pathlib import Path

import pytest

from .driver import (
    Plan,
    ServerProbe,
    audit_mismatches,
    count_audit,
    env_float,
    env_int,
    load_server,
    machine_line,
    merged,
    run_load,
    today,
    tool_table,
    verify_audit,
    write_section,
)

pytestmark = [pytest.mark.bwrap, pytest.mark.root]

FAST = Plan(sandboxes=20, clients=8, duration_s=45)


def full_plan() -> Plan:
    return Plan(
        sandboxes=env_int("BASTION_LOAD_SANDBOXES", 100),
        clients=env_int("BASTION_LOAD_CLIENTS", 32),
        duration_s=env_float("BASTION_LOAD_SECONDS", 300),
    )


def report_path(tmp_path: Path) -> Path:
    return Path(os.environ.get("BASTION_LOAD_REPORT") or tmp_path / "load-report.md")


async def check_load(tmp_path: Path, plan: Plan) -> None:
    root = tmp_path / "server"
    with load_server(root, plan) as server:
        probe = ServerProbe(server.process.pid, root)
        before = await probe.settled()
        tallies, phase = await run_load(server, plan)
        after = await probe.settled(expected=before)
        audit = count_audit(server.root / "state" / "audit.jsonl")
        verified = verify_audit(server)
        log = server.log()
    total = merged(tallies)
    seconds = phase.mix_ended - phase.mix_started
    throughput = phase.calls_in_mix / seconds
    mismatches = audit_mismatches(total, audit)
    write_section(
        report_path(tmp_path),
        "## Load",
        f"Run {today()} on {machine_line()}: {plan.sandboxes} sandboxes, {plan.clients} HTTP clients (bearer "
        f"tokens, both protocol eras), {seconds:.0f} s of mix; {phase.calls_in_mix} calls in the mix, "
        f"**{throughput:.1f} calls/s**. Latency is the client's, per call, set-up and tear-down included.\n\n"
        f"{tool_table(total)}\n\n"
        f"Unexpected errors: {sum(t.unexpected for t in total.tools.values())}. Audit: {audit.records} records, "
        f"every answer's end record present exactly once: {'yes' if not mismatches else mismatches}; "
        f"`bastion audit verify`: {'intact' if verified.returncode == 0 else verified.stdout.strip()}. "
        f"Held before and after (closed): {before.line()} / {after.line()}.",
    )
    assert not total.failures, total.failures
    assert not mismatches, mismatches
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "Traceback" not in log, log[-4000:]
    assert after == before, f"left behind: before {before.line()}, after {after.line()}"


@pytest.mark.anyio
async def test_load_mix_of_clients_and_sandboxes_loses_no_call_and_no_audit_record(tmp_path: Path) -> None:
    await check_load(tmp_path, FAST)


@pytest.mark.load
@pytest.mark.anyio
async def test_full_load_100_sandboxes_32_clients_5_minutes(tmp_path: Path) -> None:
    await check_load(tmp_path, full_plan())
