"""bastion vs the naive server over stdio, in the same run: run_command("true") and read_file(4 KiB).

Both servers are spawned the way Claude Desktop spawns them and driven by the SDK's `mcp.Client`.
Figures to reach (issue 19): run_command p50 in the host workspace <= 1.3x naive; read_file p50 <= 1.15x
naive (4 KiB of one character); reported, read_file of 4 KiB of this repository's source, which the
redactor's rules have to read. Each call of bastion's writes its audit record(s) with fdatasync before
answering (two for run_command, start and end): on a busy disk those syncs are most of the difference.
Run: .venv/bin/python bench/bench_stdio.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
PYTHON = REPO / ".venv" / "bin" / "python"
WARMUP_CALLS = 30
FIGURES: dict[str, tuple[str, dict[str, Any]]] = {
    "run_command": ("run_command", {"command": "true"}),
    "read_file": ("read_file", {"path": "data4k.txt"}),
    # Reported: 4 KiB of real source, where `key`, `token` and `password` make the redactor's rules run.
    "read_file source": ("read_file", {"path": "source4k.py"}),
}
TARGETS: dict[str, float | None] = {"run_command": 1.3, "read_file": 1.15, "read_file source": None}


async def timed(client: Client, name: str, args: dict[str, Any]) -> float:
    started = time.perf_counter()
    result = await client.call_tool(name, args)
    elapsed = (time.perf_counter() - started) * 1000
    if result.is_error:
        raise SystemExit(f"{name} failed: {result.content}")
    return elapsed


async def measure(naive: StdioServerParameters, ours: StdioServerParameters, calls: int) -> dict[str, list[float]]:
    """Both servers open at once; calls alternate, so both see the same machine noise."""
    samples: dict[str, list[float]] = {}
    async with Client(naive) as base, Client(ours) as bastion:
        for name, args in FIGURES.values():
            for _ in range(WARMUP_CALLS):
                await timed(base, name, args)
                await timed(bastion, name, args)
            for _ in range(calls):
                label = next(key for key, figure in FIGURES.items() if figure == (name, args))
                samples.setdefault(f"naive {label}", []).append(await timed(base, name, args))
                samples.setdefault(f"bastion {label}", []).append(await timed(bastion, name, args))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        demo = Path(tmp) / "demo"
        anyio.run(anyio.run_process, [str(BASTION), "init", str(demo)])
        (demo / "workspace" / "data4k.txt").write_text("x" * 4095 + "\n")
        source = (REPO / "src" / "bastion" / "safety" / "audit.py").read_bytes()[:4096]
        (demo / "workspace" / "source4k.py").write_bytes(source[: source.rfind(b"\n") + 1])
        naive = StdioServerParameters(
            command=str(PYTHON), args=[str(REPO / "bench" / "naive_server.py"), str(demo / "workspace")]
        )
        ours = StdioServerParameters(
            command=str(BASTION), args=["serve", "--config", str(demo / "bastion.toml"), "--stdio"]
        )
        samples = anyio.run(measure, naive, ours, args.calls)
    print(f"{args.calls} alternating calls per figure after {WARMUP_CALLS} warm-up calls")
    print(f"{'figure':<24}{'naive ms':>10}{'bastion ms':>12}{'ratio':>8}{'target':>8}")
    ok = True
    for name, target in TARGETS.items():
        naive_ms = statistics.median(samples[f"naive {name}"])
        ours_ms = statistics.median(samples[f"bastion {name}"])
        ratio = ours_ms / naive_ms
        ok &= target is None or ratio <= target
        shown = "reported" if target is None else f"{target:.2f}x"
        print(f"{name + ' p50':<24}{naive_ms:>10.3f}{ours_ms:>12.3f}{ratio:>7.2f}x{shown:>9}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
