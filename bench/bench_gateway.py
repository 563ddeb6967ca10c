"""biscuit_status round trip: a warm SSH connection vs a fresh one per call vs the `ssh` CLI, in one run.

A real OpenSSH server on loopback plays the production host (tests/gateway/lab.py: the
authorized_keys line from `bastion gateway authorized-keys`, dispatch.py as the forced
command, a small Python action program). The three ways alternate call by call so they
see the same machine noise:
  warm   biscuit_status through bastion's tool (SDK in-process client), connection reused
  fresh  the same tool, with the gateway's connection closed before each call
  cli    `ssh -i KEY host "status biscuit"` (a new process and connection per call)
  host   dispatch.py run directly on the host, no SSH: the floor (two Python start-ups)
The figure is reported, not a target (issue #6). Needs root (sshd) and openssh-server.
Run: .venv/bin/python bench/bench_gateway.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.gateway.lab import GatewayLab  # noqa: E402

from bastion.app import build_server, build_services  # noqa: E402
from bastion.config import load_config  # noqa: E402

WARMUP_CALLS = 5


async def measure(lab: GatewayLab, calls: int) -> dict[str, list[float]]:
    services = build_services(load_config(lab.config_path))
    gateway = services.gateways["biscuit"]
    samples: dict[str, list[float]] = {"warm": [], "fresh": [], "cli": [], "host": []}
    target = lab.root / "target"
    dispatch = ["/usr/bin/python3", "-I", str(target / "dispatch.py"), "--config", str(target / "dispatch.toml")]
    args = {"project": "biscuit"}
    try:
        async with Client(build_server(services, caller="bench")) as client:

            async def tool() -> float:
                started = time.perf_counter()
                result = await client.call_tool("biscuit_status", args)
                elapsed = (time.perf_counter() - started) * 1000
                if result.is_error:
                    raise SystemExit(f"biscuit_status failed: {result.content}")
                return elapsed

            def cli() -> float:
                started = time.perf_counter()
                done = lab.ssh("status biscuit")
                elapsed = (time.perf_counter() - started) * 1000
                if done.returncode != 0:
                    raise SystemExit(f"ssh failed: {done.stderr}")
                return elapsed

            def host() -> float:
                started = time.perf_counter()
                done = subprocess.run(
                    dispatch, env={"SSH_ORIGINAL_COMMAND": "status biscuit"}, capture_output=True, check=False
                )
                elapsed = (time.perf_counter() - started) * 1000
                if done.returncode != 0:
                    raise SystemExit(f"dispatch failed: {done.stderr!r}")
                return elapsed

            for _ in range(WARMUP_CALLS):
                await tool()
                cli()
            for _ in range(calls):
                samples["warm"].append(await tool())
                await gateway.close()
                samples["fresh"].append(await tool())
                samples["cli"].append(cli())
                samples["host"].append(host())
    finally:
        services.close()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bastion-bench-gw-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        lab = GatewayLab.start(Path(tmp) / "lab")
        try:
            samples = anyio.run(measure, lab, args.calls)
        finally:
            lab.stop()
    p50 = {name: statistics.median(values) for name, values in samples.items()}
    print(f"biscuit_status round trip, p50 of {args.calls} calls each (alternating):")
    for name, label in (
        ("warm", "bastion tool, warm SSH connection"),
        ("fresh", "bastion tool, fresh SSH connection"),
        ("cli", "ssh from the command line"),
        ("host", "dispatch.py on the host, no SSH"),
    ):
        print(f"  {label:<36} {p50[name]:8.2f} ms")
    print(f"  fresh / warm = {p50['fresh'] / p50['warm']:.2f}x; cli / warm = {p50['cli'] / p50['warm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
