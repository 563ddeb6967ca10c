"""Event-loop figure (issue #13, finding 1): a hostile sandbox cannot stall the others.

In one server (in-process, so sandbox A's work and sandbox B's calls share the event loop),
sandbox B's run_command("true") is timed while sandbox A:
  1. floods its Python context's protocol fd (five 30 MB lines of the old JSON protocol, then
     valid headers carrying 1 MiB payloads past the output cap), again and again;
  2. is closed holding 700,000 files in its /tmp;
  3. floods output (print past the cap in a context, and `head -c` of 300 MB in a command).
Targets, per phase, against B's quiet figure of the same run: p99 < 50 ms, p50 < 1.5x quiet.

Run: .venv/bin/python bench/bench_loop.py [--calls N] [--files N]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
P99_TARGET_MS = 50.0
P50_TARGET_RATIO = 1.5
MIN_LOADED = 100
SETTLE_S = 3.0  # B's calls per phase at least, however quick A's part is

# Five lines of the old protocol, 30 MB each, written to the context's protocol fd.
OLD_FLOOD = """
import os, sys
kernel = sys.modules["__main__"]
line = b'{"event":"stream","id":' + str(kernel._current["id"]).encode() + b',"name":"stdout","text":"'
for _ in range(5):
    os.write(kernel._channel["fd"], line + b"x" * (30 << 20) + b'"}\\n')
"""
# Valid headers whose payloads go past the output cap: counted, never cleaned.
VALID_FLOOD = """
import os, sys
kernel = sys.modules["__main__"]
header = b'{"event":"stream","id":' + str(kernel._current["id"]).encode() + b',"name":"stdout","bytes":1048576}\\n'
chunk = header + b"y" * 1048576
for _ in range(200):
    os.write(kernel._channel["fd"], chunk)
"""
PRINT_FLOOD = "import sys\nblock = 'z' * (1 << 20)\nfor _ in range(200):\n    sys.stdout.write(block)\n"
MAKE_FILES = (
    "import os\nos.makedirs('/tmp/many', exist_ok=True)\nfor i in range({count}):\n"
    "    os.close(os.open(f'/tmp/many/{{i}}', os.O_CREAT | os.O_WRONLY, 0o600))\nprint(len(os.listdir('/tmp/many')))"
)


def demo(tmp: Path, files: int) -> Path:
    subprocess.run([str(BASTION), "init", str(tmp / "demo")], check=True, capture_output=True)
    config = tmp / "demo" / "bastion.toml"
    text = config.read_text().replace("scratch_inodes = 16384", f"scratch_inodes = {files + 10_000}")
    # tmpfs inodes are kernel memory charged to the sandbox: 700,000 of them need about 1 GiB.
    text = text.replace("memory_bytes = 1073741824   # 1 GiB\npids", "memory_bytes = 4294967296\npids")
    text = text.replace("timeout_s = 60              # per command", "timeout_s = 600")
    config.write_text(text)
    return config


class Server:
    """The real MCP client, connected in-process (so A's work and B's calls share one event loop)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def call(self, tool: str, **args: object) -> dict[str, Any]:
        result = await self.client.call_tool(tool, args)
        payload = result.structured_content
        assert isinstance(payload, dict), result
        return payload

    async def create(self) -> str:
        made = await self.call("create_sandbox")
        if not made["ok"]:
            raise SystemExit(f"create_sandbox failed: {made['reason']}")
        return str(made["detail"]["sandbox_id"])


async def sample(server: Server, box: str, *, until: Callable[[], bool], least: int) -> list[float]:
    """B's run_command("true") latencies, one after another with 1 ms between, until `until()` and `least` taken."""
    samples: list[float] = []
    while len(samples) < least or not until():
        await anyio.sleep(0.001)  # an agent's calls come one after another, not back to back
        started = time.perf_counter()
        result = await server.call("run_command", command="true", sandbox_id=box)
        samples.append(time.perf_counter() - started)
        if not result["ok"]:
            raise SystemExit(f"sandbox B's run_command failed: {result['reason']}")
    return samples


async def loaded(server: Server, box: str, load: Callable[[], Awaitable[str]]) -> tuple[list[float], str]:
    """B's latencies while `load` runs (and at least MIN_LOADED of them); what `load` reported."""
    done: list[str] = []

    async def run_load() -> None:
        done.append(await load())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run_load)
        samples = await sample(server, box, until=lambda: bool(done), least=MIN_LOADED)
    return samples, done[0]


def percentiles(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return statistics.median(samples) * 1000, cuts[98] * 1000


async def measure(config: Path, calls: int, files: int) -> bool:
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller="bench")) as client:
            return await phases(Server(client), calls, files)
    finally:
        services.close()


async def phases(server: Server, calls: int, files: int) -> bool:
    b, a, many, loud = [await server.create() for _ in range(4)]
    made = await server.call("execute_code", code=MAKE_FILES.format(count=files), sandbox_id=many, timeout_s=600)
    if not made["ok"] or made["detail"]["stdout"].strip() != str(files):
        raise SystemExit(f"could not make {files} files in A's /tmp: {made['reason']} {made['detail']}")
    await anyio.sleep(SETTLE_S)  # the warm pool refills in the background (mkfs, mount): not A's doing
    await sample(server, b, until=lambda: True, least=30)  # warm-up
    quiet = await sample(server, b, until=lambda: True, least=calls)
    q50, q99 = percentiles(quiet)
    print(f"sandbox B run_command('true'), quiet: p50 {q50:.2f} ms, p99 {q99:.2f} ms ({len(quiet)} calls)")
    ok = True

    async def protocol_flood() -> str:
        ended: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(ended) < 6:
            for code in (OLD_FLOOD, VALID_FLOOD):
                started = time.perf_counter()
                result = await server.call("execute_code", code=code, sandbox_id=a, restart=True, timeout_s=60)
                ended.append(f"{result['code']} in {time.perf_counter() - started:.2f} s")
        return "execute_code: " + ", ".join(ended[:2]) + f" ... ({len(ended)} calls)"

    ok &= report("1. A floods its protocol fd", await loaded(server, b, protocol_flood), q50)

    async def close_a() -> str:
        started = time.perf_counter()
        result = await server.call("close_sandbox", sandbox_id=many)
        took = time.perf_counter() - started
        return f"close_sandbox of A with {files} files in /tmp: {result['code']} in {took:.2f} s"

    ok &= report("2. A is closed holding many files", await loaded(server, b, close_a), q50)
    a = loud

    async def output_flood() -> str:
        said = []
        for _ in range(3):
            started = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(functools.partial(server.call, "execute_code", code=PRINT_FLOOD, sandbox_id=a))
                command = "head -c 300000000 /dev/zero"
                tasks.start_soon(functools.partial(server.call, "run_command", command=command, sandbox_id=a))
            said.append(f"{time.perf_counter() - started:.2f} s")
        return "200 MB printed in a context and 300 MB by a command, side by side: " + ", ".join(said)

    ok &= report("3. A floods output", await loaded(server, b, output_flood), q50)
    after = await server.call("run_command", command="echo alive", sandbox_id=a)
    ok &= bool(after["ok"])
    return ok


def report(title: str, measured: tuple[list[float], str], quiet_p50: float) -> bool:
    samples, what = measured
    p50, p99 = percentiles(samples)
    ratio = p50 / quiet_p50
    met = p99 < P99_TARGET_MS and ratio < P50_TARGET_RATIO
    print(f"{title}: {what}")
    print(f"  B loaded: p50 {p50:.2f} ms ({ratio:.2f}x quiet), p99 {p99:.2f} ms, max {max(samples) * 1000:.1f} ms")
    print(f"  ({len(samples)} calls); targets p99 < {P99_TARGET_MS:.0f} ms, p50 < {P50_TARGET_RATIO}x: ", end="")
    print("met" if met else "MISSED")
    return met


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--files", type=int, default=700_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        ok = anyio.run(measure, demo(Path(tmp), args.files), args.calls, args.files)
    print("every target met" if ok else "a target was missed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
