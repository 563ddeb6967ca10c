"""Code execution figure (issue #4), against a baseline measured in the same run.

execute_code("1+1") in a warm Python context over MCP stdio, against run_command("true")
in the same sandbox of the same server, calls alternating. Target: p50 at most 1.5x.

Run: .venv/bin/python bench/bench_code.py [--calls N]
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
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
WARMUP = 30


def demo(tmp: Path) -> Path:
    subprocess.run([str(BASTION), "init", str(tmp / "demo")], check=True, capture_output=True)
    return tmp / "demo" / "bastion.toml"


async def measure(config: Path, calls: int) -> tuple[float, float]:
    params = StdioServerParameters(command=str(BASTION), args=["serve", "--config", str(config), "--stdio"])
    command_s: list[float] = []
    code_s: list[float] = []
    async with Client(params) as client:
        created = await client.call_tool("create_sandbox", {})
        assert created.structured_content is not None
        box = created.structured_content["detail"]["sandbox_id"]
        for i in range(calls + WARMUP):
            started = time.perf_counter()
            command = await client.call_tool("run_command", {"command": "true", "sandbox_id": box})
            middle = time.perf_counter()
            code = await client.call_tool("execute_code", {"code": "1+1", "sandbox_id": box})
            ended = time.perf_counter()
            if command.is_error or code.is_error:
                raise SystemExit(f"a call failed: {command.content} {code.content}")
            if i >= WARMUP:
                command_s.append(middle - started)
                code_s.append(ended - middle)
    return statistics.median(command_s) * 1000, statistics.median(code_s) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        command_ms, code_ms = anyio.run(measure, demo(Path(tmp)), args.calls)
    ratio = code_ms / command_ms
    print(f"execute_code('1+1') p50 over stdio: {code_ms:.3f} ms; run_command('true') in the same sandbox:")
    print(f"  {command_ms:.3f} ms; ratio {ratio:.2f}x (target <= 1.5x)")
    sys.exit(0 if ratio <= 1.5 else 1)


if __name__ == "__main__":
    main()
