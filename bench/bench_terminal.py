"""Terminal figure (issue 16): terminal_send + terminal_read round trip for a one-character echo.

Over MCP stdio, `cat` on a terminal of a warm sandbox: each round types one character
(terminal_send) and waits until the screen shows it echoed (terminal_read with wait_for).
The terminal's line discipline echoes it; nothing else runs. Target: p50 at most 5 ms.

Run: .venv/bin/python bench/bench_terminal.py [--rounds N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
BASTION = Path(sys.executable).parent / "bastion"
WARMUP = 20
LINE_CHARS = 60  # then the typed line is erased (Ctrl-U), unmeasured, before it would wrap
TARGET_MS = 5.0


def demo(tmp: Path) -> Path:
    subprocess.run([str(BASTION), "init", str(tmp / "demo")], check=True, capture_output=True)
    return tmp / "demo" / "bastion.toml"


async def tool(client: Client, name: str, **args: Any) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    payload = result.structured_content
    if result.is_error or payload is None:
        raise SystemExit(f"{name} failed: {result.content}")
    return dict(payload["detail"])


async def measure(config: Path, rounds: int) -> tuple[list[float], list[float]]:
    # The environment as is: PYTHONPATH, when set, picks the tree under test.
    params = StdioServerParameters(
        command=str(BASTION), args=["serve", "--config", str(config), "--stdio"], env=dict(os.environ)
    )
    times: list[float] = []
    sends: list[float] = []
    async with Client(params) as client:
        box = (await tool(client, "create_sandbox"))["sandbox_id"]
        terminal = (await tool(client, "open_terminal", sandbox_id=box, command="cat"))["terminal_id"]
        typed = ""
        for i in range(rounds + WARMUP):
            if len(typed) == LINE_CHARS:
                await tool(client, "terminal_send", terminal_id=terminal, keys=["Ctrl-U"])
                await tool(client, "terminal_read", terminal_id=terminal, wait_for="(?m)\\A$", timeout_s=10)
                typed = ""
            char = "abcdefghij"[i % 10]
            typed += char
            started = time.perf_counter()
            await tool(client, "terminal_send", terminal_id=terminal, text=char)
            sent = time.perf_counter()
            read = await tool(client, "terminal_read", terminal_id=terminal, wait_for=f"(?m)\\A{typed}$", timeout_s=10)
            ended = time.perf_counter()
            if not read["matched"]:
                raise SystemExit(f"the echo never came: {read['screen']!r}")
            if i >= WARMUP:
                times.append(ended - started)
                sends.append(sent - started)
        await tool(client, "close_sandbox", sandbox_id=box)
    return times, sends


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        times, sends = anyio.run(measure, demo(Path(tmp)), args.rounds)
    p50 = statistics.median(times) * 1000
    p90 = statistics.quantiles(times, n=10)[-1] * 1000
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{today}: terminal_send + terminal_read one-character echo over stdio, {len(times)} rounds:")
    print(f"  p50 {p50:.3f} ms, p90 {p90:.3f} ms (target p50 <= {TARGET_MS} ms)")
    print(f"  of which terminal_send (audited: start and end records) p50 {statistics.median(sends) * 1000:.3f} ms")
    sys.exit(0 if p50 <= TARGET_MS else 1)


if __name__ == "__main__":
    main()
