"""bastion vs the naive server over stdio, in the same run: run_command("true") and read_file(4 KiB).

Both servers are spawned the way Claude Desktop spawns them and driven by the SDK's `mcp.Client`.
Figures to reach (issue #2): run_command p50 <= 2.5x naive; read_file p50 <= 1.3x naive.
Run: .venv/bin/python bench/bench_stdio.py [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
BASTION = REPO / ".venv" / "bin" / "bastion"
PYTHON = REPO / ".venv" / "bin" / "python"


async def measure(params: StdioServerParameters, calls: int, warmup: int = 20) -> dict[str, float]:
    out: dict[str, float] = {}
    async with Client(params) as client:
        for name, args in (("run_command", {"command": "true"}), ("read_file", {"path": "data4k.txt"})):
            samples = []
            for i in range(warmup + calls):
                started = time.perf_counter()
                result = await client.call_tool(name, args)
                elapsed = (time.perf_counter() - started) * 1000
                if result.is_error:
                    raise SystemExit(f"{name} failed: {result.content}")
                if i >= warmup:
                    samples.append(elapsed)
            out[name] = statistics.median(samples)
            out[name + "_p90"] = statistics.quantiles(samples, n=10)[-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        demo = Path(tmp) / "demo"
        anyio.run(anyio.run_process, [str(BASTION), "init", str(demo)])
        (demo / "workspace" / "data4k.txt").write_text("x" * 4095 + "\n")
        naive = StdioServerParameters(
            command=str(PYTHON), args=[str(REPO / "bench" / "naive_server.py"), str(demo / "workspace")]
        )
        ours = StdioServerParameters(
            command=str(BASTION), args=["serve", "--config", str(demo / "bastion.toml"), "--stdio"]
        )
        # Interleave the two servers to spread machine noise over both.
        runs: dict[str, list[dict[str, float]]] = {"naive": [], "bastion": []}
        for _ in range(2):
            runs["naive"].append(anyio.run(measure, naive, args.calls // 2))
            runs["bastion"].append(anyio.run(measure, ours, args.calls // 2))
    print(f"{'figure':<24}{'naive ms':>10}{'bastion ms':>12}{'ratio':>8}{'target':>8}")
    ok = True
    for name, target in (("run_command", 2.5), ("read_file", 1.3)):
        naive_ms = statistics.median(r[name] for r in runs["naive"])
        ours_ms = statistics.median(r[name] for r in runs["bastion"])
        ratio = ours_ms / naive_ms
        ok &= ratio <= target
        print(f"{name + ' p50':<24}{naive_ms:>10.3f}{ours_ms:>12.3f}{ratio:>7.2f}x{target:>7.1f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
