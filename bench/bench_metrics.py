"""The cost of Prometheus metrics on tools/call: the same server with `[metrics] enabled` on and off.

Two `bastion serve --http` processes from the same demo config (auth off, loopback; sandboxes off),
one with metrics on (the default) and one with `[metrics] enabled = false`, driven by the SDK's
`mcp.Client` over Streamable HTTP, calls alternating so both see the same machine noise. The tool is
`explain_command` (a policy check and one audit record: the fixed cost of a call, where the metrics'
share is largest). Every SCRAPE_EVERY calls the metrics server is scraped, as Prometheus would be.
Figure (issue #18): tools/call p50 with metrics on against off, target <= 1.05x.
Run: .venv/bin/python bench/bench_metrics.py [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from servers import http_config, wait_serving

REPO = Path(__file__).resolve().parent.parent
_VENV_BASTION = REPO / ".venv" / "bin" / "bastion"
BASTION = _VENV_BASTION if _VENV_BASTION.exists() else Path(sys.executable).with_name("bastion")
WARMUP_CALLS = 50
SCRAPE_EVERY = 100
TARGET = 1.05
ARGS = {"command": "git status"}


def write_config(root: Path, *, metrics: bool) -> tuple[Path, int]:
    tail = f"\n[metrics]\nenabled = {'true' if metrics else 'false'}\n"
    return http_config(BASTION, root, http_extra="auth = false\n", tail=tail)


@contextmanager
def serve(root: Path, *, metrics: bool) -> Iterator[str]:
    path, port = write_config(root, metrics=metrics)
    log = open(root / "server.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([str(BASTION), "serve", "--config", str(path), "--http"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(process, f"{base}/healthz", root / "server.log")
        yield base
    finally:
        process.terminate()
        process.wait(30)
        log.close()


async def timed(client: Client) -> float:
    started = time.perf_counter()
    result = await client.call_tool("explain_command", ARGS)
    elapsed = (time.perf_counter() - started) * 1000
    if result.is_error:
        raise SystemExit(f"explain_command failed: {result.content}")
    return elapsed


async def measure(on: str, off: str, calls: int) -> tuple[list[float], list[float], int]:
    on_ms: list[float] = []
    off_ms: list[float] = []
    scraped = 0
    async with (
        httpx2.AsyncClient(timeout=30) as http_on,
        httpx2.AsyncClient(timeout=30) as http_off,
        Client(streamable_http_client(f"{on}/mcp", http_client=http_on)) as client_on,
        Client(streamable_http_client(f"{off}/mcp", http_client=http_off)) as client_off,
        httpx2.AsyncClient(timeout=30) as scraper,
    ):
        for _ in range(WARMUP_CALLS):
            await timed(client_on)
            await timed(client_off)
        for i in range(calls):
            on_ms.append(await timed(client_on))
            off_ms.append(await timed(client_off))
            if i % SCRAPE_EVERY == 0:
                response = await scraper.get(f"{on}/metrics")
                response.raise_for_status()
                scraped = len(response.content)
        if (await scraper.get(f"{off}/metrics")).status_code != 404:
            raise SystemExit("the server with metrics off serves /metrics")
    return on_ms, off_ms, scraped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bastion-bench-metrics-") as tmp:
        Path(tmp).chmod(0o711)  # passable by the workspace's own id, as a state folder's parents must be
        with serve(Path(tmp) / "on", metrics=True) as on, serve(Path(tmp) / "off", metrics=False) as off:
            on_ms, off_ms, scraped = anyio.run(measure, on, off, args.calls)
    on_p50, off_p50 = statistics.median(on_ms), statistics.median(off_ms)
    ratio = on_p50 / off_p50
    print(f"{args.calls} alternating explain_command calls after {WARMUP_CALLS} warm-up calls")
    print(f"/metrics scraped every {SCRAPE_EVERY} calls ({scraped} bytes)")
    print(f"{'figure':<28}{'off ms':>10}{'on ms':>10}{'ratio':>8}{'target':>8}")
    print(f"{'tools/call p50':<28}{off_p50:>10.3f}{on_p50:>10.3f}{ratio:>7.3f}x{TARGET:>7.2f}x")
    sys.exit(0 if ratio <= TARGET else 1)


if __name__ == "__main__":
    main()
