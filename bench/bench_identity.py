"""What an identity of its own costs (issue #12), against the old mapping in the same run.

A root server used to start bubblewrap as root, so the sandbox's uid 1000 was the host's root.
Now each sandbox starts as an id of its own (setpriv before bwrap) and host workspaces are bound
through an idmapped mount. Both ways run here, in turns, in one process, on one machine:

1. create_sandbox p50, server-side (SandboxManager.create): from the warm pool and cold.
2. run_command("true") p50 through the server's tools (in-process, no transport), in a warm sandbox.

Target: each at most 1.10x the old mapping. Needs root (the old mapping only exists for root).
Run: .venv/bin/python bench/bench_identity.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio

import bastion.app
from bastion.app import Services, build_server, build_services
from bastion.config import Config, load_config
from bastion.sandbox.identity import IdentityPool

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
ROUNDS = 6
CREATES = 12
CALLS = 150
TARGET = 1.10


def old_mapping(config: Config) -> IdentityPool:
    """The mapping before issue #12: a pool that never switches, so bwrap runs as the server (root)."""
    return IdentityPool(*config.sandboxes.host_ids, server_uid=1, server_gid=1)


def services_for(config: Config, *, old: bool) -> Services:
    real = bastion.app.open_identities
    if old:
        bastion.app.open_identities = old_mapping
    try:
        return build_services(config)
    finally:
        bastion.app.open_identities = real


def demo(folder: Path, warm_pool: int) -> Config:
    subprocess.run([str(BASTION), "init", str(folder)], check=True, capture_output=True)
    path = folder / "bastion.toml"
    path.write_text(path.read_text().replace("lifetime_s = 86400", f"lifetime_s = 86400\nwarm_pool = {warm_pool}"))
    return load_config(path)


async def creates(config: Config, *, old: bool, warm: bool) -> list[float]:
    services = services_for(config, old=old)
    samples = []
    try:
        for _ in range(CREATES):
            if warm:
                services.sandboxes.refill_pool()
                await anyio.sleep(0.25)  # an agent does not create sandboxes back to back
            started = time.perf_counter()
            box = await services.sandboxes.create(owner="bench")
            samples.append(time.perf_counter() - started)
            await services.sandboxes.close(box.id)
    finally:
        services.close()
    return samples


async def runs(config: Config, *, old: bool) -> list[float]:
    services = services_for(config, old=old)
    server = build_server(services, caller="bench")
    samples = []
    try:
        box = await services.sandboxes.create(owner="bench")
        args = {"command": "true", "sandbox_id": box.id}
        for i in range(CALLS + 20):
            await anyio.sleep(0.001)  # calls come one after another, not back to back
            started = time.perf_counter()
            await server.call_tool("run_command", args)
            if i >= 20:
                samples.append(time.perf_counter() - started)
    finally:
        services.close()
    return samples


def alternate(measure: Callable[[bool], list[float]]) -> tuple[float, float]:
    """p50 of the old and the new mapping, measured in turns so drift hits both alike."""
    old: list[float] = []
    new: list[float] = []
    for turn in range(ROUNDS):
        # Each goes first in turn: the first of a pair runs on a cooler machine.
        for is_old in (True, False) if turn % 2 == 0 else (False, True):
            (old if is_old else new).extend(measure(is_old))
    return statistics.median(old) * 1000, statistics.median(new) * 1000


def main() -> int:
    if os.geteuid() != 0:
        print("skipped: the old mapping (sandbox = the server's root) only exists for a root server")
        return 0
    ok = True
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        pooled, cold = demo(Path(tmp) / "pooled", 1), demo(Path(tmp) / "cold", 0)
        rows = (
            ("create_sandbox p50, warm pool", lambda old: anyio.run(lambda: creates(pooled, old=old, warm=True))),
            ("create_sandbox p50, cold", lambda old: anyio.run(lambda: creates(cold, old=old, warm=False))),
            ("run_command('true') p50, warm sandbox", lambda old: anyio.run(lambda: runs(pooled, old=old))),
        )
        for name, measure in rows:
            old_ms, new_ms = alternate(measure)
            ratio = new_ms / old_ms
            ok &= ratio <= TARGET
            print(f"{name}: old mapping {old_ms:.2f} ms, own id {new_ms:.2f} ms, {ratio:.2f}x (target <= {TARGET}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
