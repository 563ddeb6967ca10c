"""Sandbox figures (issue #3), each against a baseline measured in the same run.

1. create_sandbox p50, server-side (SandboxManager.create, no MCP transport): from the warm
   pool (the default) and cold (warm_pool = 0). Target <= 25 ms cold, ~1 ms pooled; anchors:
   E2B ~150 ms, `srt -- true` measured on this machine 315 ms. Then a burst: BURST creates back
   to back with the default pool of 1, p50 and p90 (target p90 < 30 ms: the pool refills fast enough).
2. run_command("true") in a warm sandbox over MCP stdio, against the naive unsandboxed
   server of bench/naive_server.py, calls alternating. Target <= 1.2x (issue 19). Reported beside it,
   alternating in the same run: the same with the audit records never synced, and with none written
   (bench/audit_variant.py): the audit log's share of the difference.
3. Density: 200 idle sandboxes at once: memory per idle sandbox (target <= 4 MiB beyond
   the workspace files) and run_command("true") p50 with 200 idle against 1 (target <= 1.2x).
   "Idle" as the reaper leaves them: awake (only the resident agent waits; commands are
   spawned on demand), then after 120 s with nothing running and an empty /tmp asleep (no
   process; files kept).
4. A noisy neighbour: run_command("true") p50 in one sandbox while another (pids 64, half a core) runs a
   fork bomb that presses on its pids limit, against the p50 with that neighbour idle, measured before
   and after the bomb and averaged (target <= 3x). The test suite asserts the bomb's bounds and the
   server's CPU per call; wall-clock latency beside the rest of a suite on two cores is this benchmark's.

Run: .venv/bin/python bench/bench_sandbox.py [--density N] (1,000 is the issue's figure: several
minutes and ~7 GiB while they are awake; make bench runs 200)
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

from audit_variant import MODES, stdio_server
from bastion.app import build_server, build_services
from bastion.config import load_config

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
PYTHON = REPO / ".venv" / "bin" / "python"
MIB = 1024 * 1024
SETTLE_S = 2.0
BURST = 50


def demo(tmp: Path, *, warm_pool: int, max_sandboxes: int) -> Path:
    subprocess.run([str(BASTION), "init", str(tmp / "demo")], check=True, capture_output=True)
    config = tmp / "demo" / "bastion.toml"
    text = config.read_text().replace("max_sandboxes = 16", f"max_sandboxes = {max_sandboxes}")
    text = text.replace("lifetime_s = 86400", f"lifetime_s = 86400\nwarm_pool = {warm_pool}")
    config.write_text(text)
    return config


def ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def create_p50(config: Path, *, warm: bool, count: int = 30) -> float:
    services = build_services(load_config(config))
    samples = []
    try:
        for _ in range(count):
            if warm:
                services.sandboxes.refill_pool()
                await anyio.sleep(0.25)  # an agent does not create sandboxes back to back
            started = time.perf_counter()
            box = await services.sandboxes.create(owner="bench")
            samples.append(time.perf_counter() - started)
            await services.sandboxes.close(box.id)
    finally:
        services.close()
    return ms(samples)


async def burst(config: Path, count: int = BURST) -> tuple[float, float]:
    """`count` creates back to back from a full pool of one: (p50, p90) in ms."""
    services = build_services(load_config(config))
    samples = []
    boxes = []
    try:
        services.sandboxes.refill_pool()
        while not services.sandboxes.pool_size:
            await anyio.sleep(0.01)
        for _ in range(count):
            started = time.perf_counter()
            boxes.append(await services.sandboxes.create(owner="bench"))
            samples.append(time.perf_counter() - started)
        for box in boxes:
            await services.sandboxes.close(box.id)
    finally:
        services.close()
    return ms(samples), statistics.quantiles(samples, n=10)[-1] * 1000


async def stdio_ratio(configs: dict[str, Path], calls: int) -> dict[str, float]:
    """p50 ms of run_command("true") over stdio: the naive server, and each bastion server in its own
    warm sandbox (`configs`: "bastion" and the audit variants of bench/audit_variant.py), calls alternating."""
    naive = StdioServerParameters(command=str(PYTHON), args=[str(REPO / "bench" / "naive_server.py"), "/tmp"])
    servers = {"naive": naive}
    for label, config in configs.items():
        argv = ["serve", "--config", str(config), "--stdio"]
        servers[label] = (
            StdioServerParameters(command=str(BASTION), args=argv)
            if label == "bastion"
            else (stdio_server(label, config))
        )
    samples: dict[str, list[float]] = {label: [] for label in servers}
    async with AsyncExitStack() as stack:
        clients = {label: await stack.enter_async_context(Client(server)) for label, server in servers.items()}
        args: dict[str, dict[str, Any]] = {}
        for label, client in clients.items():
            if label == "naive":
                args[label] = {"command": "true"}
                continue
            created = await client.call_tool("create_sandbox", {})
            assert created.structured_content is not None
            args[label] = {"command": "true", "sandbox_id": created.structured_content["detail"]["sandbox_id"]}
        for i in range(calls + 30):
            for label, client in clients.items():
                started = time.perf_counter()
                result = await client.call_tool("run_command", args[label])
                elapsed = time.perf_counter() - started
                if result.is_error:
                    raise SystemExit(f"run_command failed on {label}: {result.content}")
                if i >= 30:
                    samples[label].append(elapsed)
    return {label: ms(times) for label, times in samples.items()}


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable in /proc/meminfo")


async def density(config: Path, count: int) -> tuple[float, float, float, float]:
    """run_command p50 with 1 sandbox and with `count`; memory per idle sandbox awake (its
    agent waiting) and asleep (as after 120 s unused).

    The figure with 1 is taken before the others exist and again after they are closed, and
    averaged: on a small machine the p50 drifts by more than the effect being measured.
    """
    services = build_services(load_config(config))
    server = build_server(services, caller="bench")
    try:
        first = await services.sandboxes.create(owner="bench")
        args = {"command": "true", "sandbox_id": first.id}
        await anyio.sleep(SETTLE_S)  # the warm pool refills in the background
        one_before = await timed_calls(server, args)
        before = mem_available()
        boxes = [await services.sandboxes.create(owner="bench") for _ in range(count - 1)]
        await anyio.sleep(SETTLE_S)
        awake = mem_available()
        for box in boxes:
            box.last_used -= 3600  # idle for an hour, as far as the reaper can tell
        services.sandboxes.sleep_idle()
        await anyio.sleep(SETTLE_S)
        asleep = mem_available()
        many = await timed_calls(server, args)
        for box in boxes:
            await services.sandboxes.close(box.id)
        await anyio.sleep(SETTLE_S)
        one_after = await timed_calls(server, args)
    finally:
        services.close()
    return (one_before + one_after) / 2, many, (before - awake) / (count - 1), (before - asleep) / (count - 1)


async def timed_calls(server: object, args: dict[str, Any], calls: int = 300) -> float:
    samples = []
    for i in range(calls + 20):
        await anyio.sleep(0.001)  # an agent's calls come one after another, not back to back
        started = time.perf_counter()
        await server.call_tool("run_command", args)  # type: ignore[attr-defined]
        if i >= 20:
            samples.append(time.perf_counter() - started)
    return ms(samples)


# The classic shell bomb, relaunched by a python3 that reaps everything whenever it collapses, so it
# presses on the pids limit for the whole run (as in tests/workbench/test_isolation.py).
FORK_BOMB = "/usr/bin/python3 -I -S -c " + shlex.quote(
    "import os, subprocess\n"
    "while True:\n"
    "    try:\n"
    "        subprocess.Popen(['sh', '-c', 'b(){ b & b & wait; }; b'], stderr=subprocess.DEVNULL)\n"
    "    except OSError:\n"
    "        pass\n"
    "    try:\n"
    "        while os.waitpid(-1, os.WNOHANG)[0]:\n"
    "            pass\n"
    "    except ChildProcessError:\n"
    "        pass\n"
)


async def neighbour(config: Path, calls: int) -> tuple[float, float]:
    """run_command("true") p50 in one sandbox with its neighbour idle (before and after, averaged) and
    with the neighbour running FORK_BOMB at its pids limit."""
    services = build_services(load_config(config))
    server = build_server(services, caller="bench")
    try:
        quiet = await services.sandboxes.create(owner="bench")
        noisy = await services.sandboxes.create(owner="bench", limits={"pids": 64, "cpu_cores": 0.5})
        args = {"command": "true", "sandbox_id": quiet.id}
        idle_before = await timed_calls(server, args, calls)
        bomb = {"command": FORK_BOMB, "sandbox_id": noisy.id, "timeout_s": 600}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: server.call_tool("run_command", bomb))
            while (usage := noisy.workspace.sandbox.usage()) is None or usage.pids < 48:
                await anyio.sleep(0.05)
            bombed = await timed_calls(server, args, calls)
            tasks.cancel_scope.cancel()
        while (usage := noisy.workspace.sandbox.usage()) is not None and usage.pids > 8:
            await anyio.sleep(0.05)
        idle_after = await timed_calls(server, args, calls)
    finally:
        services.close()
    return (idle_before + idle_after) / 2, bombed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--density", type=int, default=200)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        pooled = demo(Path(tmp) / "pooled", warm_pool=1, max_sandboxes=max(args.density, BURST) + 8)
        cold = demo(Path(tmp) / "cold", warm_pool=0, max_sandboxes=8)
        warm_ms = anyio.run(lambda: create_p50(pooled, warm=True))
        cold_ms = anyio.run(lambda: create_p50(cold, warm=False))
        print(f"create_sandbox p50, server-side: {warm_ms:.2f} ms from the warm pool, {cold_ms:.2f} ms cold")
        print("  target <= 25 ms; anchors: E2B ~150 ms, srt -- true 315 ms on this machine")
        ok &= cold_ms <= 25
        burst_p50, burst_p90 = anyio.run(burst, pooled)
        print(f"burst of {BURST} creates back to back (pool of 1): p50 {burst_p50:.2f} ms, p90 {burst_p90:.2f} ms")
        print("  target: p90 < 30 ms")
        ok &= burst_p90 < 30
        configs = {"bastion": pooled}
        for mode in MODES:  # each a demo of its own: a server's state folder is its alone
            configs[mode] = demo(Path(tmp) / mode, warm_pool=1, max_sandboxes=8)
        p50 = anyio.run(stdio_ratio, configs, args.calls)
        base_ms, ours_ms = p50["naive"], p50["bastion"]
        ratio = ours_ms / base_ms
        ok &= ratio <= 1.2
        print(f"run_command('true') p50 over stdio: naive {base_ms:.3f} ms, sandbox {ours_ms:.3f} ms, {ratio:.2f}x")
        unsynced, unaudited = p50["unsynced"] / base_ms, p50["none"] / base_ms
        print(f"  target <= 1.2x; same run, reported (bench/audit_variant.py): records never synced {unsynced:.2f}x,")
        print(f"  no audit record {unaudited:.2f}x")
        one, many, per_awake, per_asleep = anyio.run(density, pooled, args.density)
        print(f"density: {args.density} idle sandboxes")
        print(f"  memory per idle sandbox (MemAvailable): {per_asleep / MIB:.2f} MiB asleep (idle 120 s),")
        print(f"  {per_awake / MIB:.2f} MiB awake (its agent waiting for a command)")
        print(f"  run_command('true') p50 in-process: {one:.3f} ms with 1, {many:.3f} ms with {args.density}")
        print(f"  ratio {many / one:.2f}x; targets: <= 4 MiB per idle sandbox, <= 1.2x")
        ok &= per_asleep <= 4 * MIB and many / one <= 1.2
        idle, bombed = anyio.run(neighbour, pooled, args.calls)
        print(f"run_command('true') p50 in-process beside a fork bomb (pids 64, half a core): {idle:.3f} ms with")
        print(f"  the neighbour idle, {bombed:.3f} ms during the bomb, {bombed / idle:.2f}x; target <= 3x")
        ok &= bombed / idle <= 3
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
