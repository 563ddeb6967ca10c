"""Soak (issue 19): the load mix at a steady rate for minutes; nothing grows.

What this proves, against the same real server, sandboxes and clients as tests/load/test_load.py: at a
steady rate of calls, after a warm-up, the server's resident memory and open file descriptors stay
within 10% of their post-warm-up level (medians of the samples in a window after the warm-up and in
the last window), and once every sandbox is closed it holds exactly what it held before: no cgroup,
mount, loop device or process left by the hundreds of sandboxes created and closed meanwhile. The
load test's checks hold too (no unexpected error, every audit end record once, audit verify, no
traceback). Figures go to the report's "## Soak" section.

What it does not prove: a leak slower than 10% over the run's length (the full run is 30 minutes:
`make soak`; BASTION_SOAK_SECONDS, _RATE, _SANDBOXES, _CLIENTS override its sizes); memory the kernel
holds for the server (page cache, slabs) rather than the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .driver import Plan, Run, env_float, env_int, run_checked
from .measure import machine_line, report_path, today, tool_table, write_section

pytestmark = [pytest.mark.bwrap, pytest.mark.root]

DRIFT_MAX = 0.10
MIB = 1024 * 1024


@dataclass(frozen=True)
class Soak:
    plan: Plan
    warmup_s: float
    window_s: float
    every_s: float


FAST = Soak(Plan(sandboxes=10, clients=4, duration_s=180, rate=15), warmup_s=35, window_s=20, every_s=2)


def full_soak() -> Soak:
    plan = Plan(
        sandboxes=env_int("BASTION_SOAK_SANDBOXES", 100),
        clients=env_int("BASTION_SOAK_CLIENTS", 32),
        duration_s=env_float("BASTION_SOAK_SECONDS", 1800),
        rate=env_float("BASTION_SOAK_RATE", 30),
    )
    return Soak(plan, warmup_s=min(300, plan.duration_s / 5), window_s=min(120, plan.duration_s / 10), every_s=5)


def drift(start: float, end: float) -> float:
    return (end - start) / start


async def check_soak(tmp_path: Path, soak: Soak) -> None:
    run = await run_checked(tmp_path / "server", soak.plan, sample_every_s=soak.every_s)
    begin = run.phase.mix_started + soak.warmup_s
    rss_warm, fds_warm = run.sampler.level(begin, begin + soak.window_s)
    rss_end, fds_end = run.sampler.level(run.phase.mix_ended - soak.window_s, run.phase.mix_ended + 1)
    write_section(report_path(tmp_path), "## Soak", report(run, soak, (rss_warm, rss_end), (fds_warm, fds_end)))
    problems = run.problems()
    if abs(drift(rss_warm, rss_end)) > DRIFT_MAX:
        problems.append(f"RSS went from {rss_warm / MIB:.1f} MiB after warm-up to {rss_end / MIB:.1f} MiB")
    if abs(drift(fds_warm, fds_end)) > DRIFT_MAX:
        problems.append(f"open fds went from {fds_warm:.0f} after warm-up to {fds_end:.0f}")
    assert not problems, "\n".join(problems)


def report(run: Run, soak: Soak, rss: tuple[float, float], fds: tuple[float, float]) -> str:
    plan = run.plan
    peak = max(run.sampler.holdings, key=lambda h: h.cgroups)
    return (
        f"Run {today()} on {machine_line()}: {plan.sandboxes} sandboxes, {plan.clients} HTTP clients, "
        f"{run.seconds / 60:.1f} min at a steady {plan.rate:g} calls/s asked "
        f"({run.throughput:.1f} calls/s served, {run.phase.calls_in_mix} calls). Server sampled every "
        f"{soak.every_s:g} s; levels are medians over {soak.window_s:g} s, the first after a "
        f"{soak.warmup_s:g} s warm-up, the last at the end.\n\n"
        f"| | after warm-up | at the end | drift |\n|---|---:|---:|---:|\n"
        f"| RSS (MiB) | {rss[0] / MIB:.1f} | {rss[1] / MIB:.1f} | {drift(*rss):+.1%} |\n"
        f"| open fds | {fds[0]:.0f} | {fds[1]:.0f} | {drift(*fds):+.1%} |\n\n"
        f"RSS (MiB) and open fds, medians of each tenth of the mix: {trend(run)}.\n\n"
        f"Peak during the run: {peak.line()}.\n\n{tool_table(run.tally)}\n\n{run.summary()}"
    )


def trend(run: Run) -> str:
    start, step = run.phase.mix_started, run.seconds / 10
    levels = [run.sampler.level(start + i * step, start + (i + 1) * step) for i in range(10)]
    return ", ".join(f"{rss / MIB:.1f}/{fds:.0f}" for rss, fds in levels)


@pytest.mark.anyio
async def test_soak_at_a_steady_rate_leaks_no_memory_fds_or_sandbox_leftovers(tmp_path: Path) -> None:
    await check_soak(tmp_path, FAST)


@pytest.mark.load
@pytest.mark.anyio
async def test_full_soak_30_minutes(tmp_path: Path) -> None:
    await check_soak(tmp_path, full_soak())
