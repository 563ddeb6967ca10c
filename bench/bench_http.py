"""bastion over Streamable HTTP: the cost of OAuth on tools/call, throughput, and the token endpoint.

Two `bastion serve --http` processes from the same demo config, one with `[http] auth = false`,
driven by the SDK's `mcp.Client` over loopback. Figures (issue #5):
- tools/call of a no-op-cost tool (`explain_command`: a policy check, runs nothing) with a bearer token,
  p50, against the same server with auth off, calls alternating: target <= 1.3x, on both protocol eras;
- tools/call throughput with 32 concurrent clients, bearer check on, against a bare SDK server serving the
  same tool on the same transport (bench/bare_http_server.py: no auth, no audit, no bastion), rounds
  alternating between the two, on both protocol eras: target >= 0.9x (issue #20);
- /token refresh with rotation: requests/s (8 concurrent refresh chains).
The token is minted through the server's own store (a grant as the consent page would make it), so the
bench needs no browser. Run: .venv/bin/python bench/bench_http.py [--calls N] [--rounds N]
[--throughput-only] [--profile FILE] (FILE: cProfile stats of the bastion server over the throughput runs).
"""

from __future__ import annotations

import argparse
import os
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

from servers import free_port, http_config, wait_serving

REPO = Path(__file__).resolve().parent.parent
# A worktree has no .venv of its own: then the bastion next to this interpreter (with PYTHONPATH naming the tree).
BASTION = next(
    (p for p in (REPO / ".venv" / "bin" / "bastion", Path(sys.executable).parent / "bastion") if p.exists()),
    REPO / ".venv" / "bin" / "bastion",
)
WARMUP_CALLS = 30
CONCURRENT_CLIENTS = 32
CALLS_PER_CLIENT = 40
THROUGHPUT_ROUNDS = 7  # with 3, one tree's ratio ranged 0.58x to 0.94x within 30 minutes; with 7, 0.69x to 0.81x
THROUGHPUT_TARGET = 0.9
REFRESH_CHAINS = 8
REFRESHES_PER_CHAIN = 40
TARGET = 1.3
SERVER_PIDS: dict[str, int] = {}
"""MCP URL -> the pid of the server process answering it."""


def write_config(root: Path, *, auth: bool) -> tuple[Path, int]:
    # One grant per concurrent client, all registered from this address.
    extra = "registrations_per_ip_per_hour = 10000\nmax_clients = 10000\n" + ("" if auth else "auth = false\n")
    return http_config(BASTION, root, http_extra=extra, password="bench password 123" if auth else None)


@contextmanager
def serve(root: Path, *, auth: bool, profile: str | None = None) -> Iterator[str]:
    path, port = write_config(root, auth=auth)
    argv = [str(BASTION), "serve", "--config", str(path), "--http"]
    if profile:
        argv = [sys.executable, "-m", "cProfile", "-o", profile, *argv]
    with running(argv, root, port) as base:
        yield base


@contextmanager
def serve_bare(root: Path) -> Iterator[str]:
    """bench/bare_http_server.py on the demo config in `root` (written by `serve` first)."""
    port = free_port()
    argv = [sys.executable, str(REPO / "bench" / "bare_http_server.py"), str(root / "bastion.toml"), str(port)]
    with running(argv, root, port, log_name="bare.log") as base:
        yield base


@contextmanager
def running(argv: list[str], root: Path, port: int, log_name: str = "server.log") -> Iterator[str]:
    log = open(root / log_name, "wb")  # noqa: SIM115
    process = subprocess.Popen(argv, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    SERVER_PIDS[f"{base}/mcp"] = process.pid
    try:
        wait_serving(process, f"{base}/mcp", root / log_name)
        yield base
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used: robust on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mint_tokens(root: Path, base: str, count: int) -> list[tuple[str, str, str]]:
    """(client_id, access token, refresh token) for `count` grants, made through the real store."""
    sys.path.insert(0, str(REPO / "src"))
    from bastion.config import load_config
    from bastion.tools.server import SCOPES
    from bastion.transports.http.store import AuthStore

    config = load_config(root / "bastion.toml")
    store = AuthStore(config.db_path)
    minted = []
    for _ in range(count):
        client = httpx2.post(
            f"{base}/register", json={"redirect_uris": ["http://127.0.0.1/cb"], "token_endpoint_auth_method": "none"}
        )
        client_id = client.json()["client_id"]
        code = store.create_grant_with_code(
            client_id=client_id,
            scopes=SCOPES,
            resource=f"{base}/mcp",
            redirect_uri="http://127.0.0.1/cb",
            code_challenge="x" * 43,
            code_lifetime_s=60,
            grant_lifetime_s=86400,
        )
        issued = store.consume_code_and_issue(code, access_lifetime_s=3600, refresh_lifetime_s=86400)
        assert issued is not None
        minted.append((client_id, issued.access_token, issued.refresh_token))
    store.close()
    return minted


def client_for(url: str, token: str | None, mode: str) -> tuple[httpx2.AsyncClient, Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    http = httpx2.AsyncClient(headers=headers, timeout=60)
    return http, Client(streamable_http_client(url, http_client=http), mode=mode)


async def timed(client: Client) -> float:
    started = time.perf_counter()
    result = await client.call_tool("explain_command", {"command": "true"})
    elapsed = (time.perf_counter() - started) * 1000
    if result.is_error:
        raise SystemExit(f"explain_command failed: {result.content}")
    return elapsed


async def latency(open_url: str, auth_url: str, token: str, mode: str, calls: int) -> tuple[list[float], list[float]]:
    plain_http, plain = client_for(open_url, None, mode)
    auth_http, authed = client_for(auth_url, token, mode)
    off, on = [], []
    async with plain_http, auth_http, plain, authed:
        for _ in range(WARMUP_CALLS):
            await timed(plain)
            await timed(authed)
        for _ in range(calls):
            off.append(await timed(plain))
            on.append(await timed(authed))
    return off, on


async def throughput(url: str, tokens: list[str] | None, mode: str) -> tuple[float, float]:
    """tools/call per second from CONCURRENT_CLIENTS clients, each with its session already open.

    Each client has a grant of its own (32 agents, not one agent's 32 sessions: a grant's sessions are capped).
    Returns (calls/s, server CPU ms per call)."""
    opened = anyio.Event()
    ready = 0
    started = 0.0

    async def one(token: str | None) -> None:
        nonlocal ready
        http, client = client_for(url, token, mode)
        async with http, client:
            await timed(client)
            ready += 1
            if ready == CONCURRENT_CLIENTS:
                opened.set()
            await opened.wait()
            for _ in range(CALLS_PER_CLIENT):
                await timed(client)

    async with anyio.create_task_group() as tasks:
        for index in range(CONCURRENT_CLIENTS):
            tasks.start_soon(one, tokens[index % len(tokens)] if tokens else None)
        await opened.wait()
        started, cpu_started = time.perf_counter(), cpu_s(SERVER_PIDS[url])
    calls = CONCURRENT_CLIENTS * CALLS_PER_CLIENT
    return calls / (time.perf_counter() - started), (cpu_s(SERVER_PIDS[url]) - cpu_started) * 1000 / calls


def compare_throughput(
    bare_url: str, auth_url: str, tokens: list[str], mode: str, rounds: int
) -> tuple[tuple[float, float], tuple[float, float], float]:
    """Median (calls/s, server CPU ms per call) of the bare SDK server and of bastion (bearer on), rounds
    alternating which goes first; and the median of each round's own ratio (bastion's calls/s over the
    bare server's in the same round), which the machine's drift between rounds moves less."""
    anyio.run(throughput, bare_url, None, mode)  # warm both servers up (imports, first sessions)
    anyio.run(throughput, auth_url, tokens, mode)
    bare: list[tuple[float, float]] = []
    ours: list[tuple[float, float]] = []
    for round_number in range(rounds):
        order = [(bare, bare_url, None), (ours, auth_url, tokens)]
        for figures, url, bearer in order if round_number % 2 == 0 else reversed(order):
            figures.append(anyio.run(throughput, url, bearer, mode))
    paired = statistics.median(o[0] / b[0] for o, b in zip(ours, bare, strict=True))
    return _medians(bare), _medians(ours), paired


def _medians(figures: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(f[0] for f in figures), statistics.median(f[1] for f in figures)


async def refresh_rate(base: str, grants: list[tuple[str, str, str]]) -> float:
    async def chain(client_id: str, refresh: str) -> None:
        async with httpx2.AsyncClient(base_url=base, timeout=30) as http:
            for _ in range(REFRESHES_PER_CHAIN):
                response = await http.post(
                    "/token", data={"grant_type": "refresh_token", "refresh_token": refresh, "client_id": client_id}
                )
                if response.status_code != 200:
                    raise SystemExit(f"refresh failed: {response.text}")
                refresh = response.json()["refresh_token"]

    started = time.perf_counter()
    async with anyio.create_task_group() as tasks:
        for client_id, _, refresh in grants:
            tasks.start_soon(chain, client_id, refresh)
    return len(grants) * REFRESHES_PER_CHAIN / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=THROUGHPUT_ROUNDS)
    parser.add_argument("--throughput-only", action="store_true")
    parser.add_argument("--profile", help="write the bastion server's cProfile stats here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / "bench", prefix=".tmp-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        open_root, auth_root = Path(tmp) / "open", Path(tmp) / "auth"
        profile = os.path.abspath(args.profile) if args.profile else None
        with serve(auth_root, auth=True, profile=profile) as auth_base, serve_bare(auth_root) as bare_base:
            grants = mint_tokens(auth_root, auth_base, CONCURRENT_CLIENTS + REFRESH_CHAINS)
            tokens = [access for _, access, _ in grants[:CONCURRENT_CLIENTS]]
            ok = report_throughput(f"{bare_base}/mcp", f"{auth_base}/mcp", tokens, args.rounds)
            if not args.throughput_only:
                with serve(open_root, auth=False) as open_base:
                    ok &= report_latency(f"{open_base}/mcp", f"{auth_base}/mcp", grants[0][1], args.calls)
                refreshes = anyio.run(refresh_rate, auth_base, grants[CONCURRENT_CLIENTS:])
                print(f"/token refresh with rotation ({REFRESH_CHAINS} chains): {refreshes:,.0f} requests/s")
    sys.exit(0 if ok else 1)


def report_throughput(bare_url: str, auth_url: str, tokens: list[str], rounds: int) -> bool:
    print(
        f"tools/call throughput, {CONCURRENT_CLIENTS} clients x {CALLS_PER_CLIENT} calls, "
        f"median of {rounds} alternating rounds; bastion with the bearer check on"
    )
    print(
        f"{'era':<22}{'bare SDK/s':>12}{'bastion/s':>11}{'ratio':>8}{'paired':>8}{'target':>8}"
        f"{'bare cpu ms/call':>18}{'bastion cpu ms/call':>21}"
    )
    ok = True
    for mode, label in (("2026-07-28", "2026-07-28"), ("legacy", "2025-11-25 (SSE)")):
        (bare, bare_cpu), (ours, our_cpu), paired = compare_throughput(bare_url, auth_url, tokens, mode, rounds)
        ratio = ours / bare
        ok &= ratio >= THROUGHPUT_TARGET
        print(
            f"{label:<22}{bare:>12,.0f}{ours:>11,.0f}{ratio:>7.2f}x{paired:>7.2f}x{THROUGHPUT_TARGET:>7.1f}x"
            f"{bare_cpu:>18.2f}{our_cpu:>21.2f}"
        )
    print("ratio: of the medians (the target's figure); paired: the median of each round's own ratio")
    return ok


def report_latency(open_url: str, auth_url: str, token: str, calls: int) -> bool:
    print(f"{calls} alternating calls per era after {WARMUP_CALLS} warm-up calls; tool: explain_command")
    print(f"{'figure':<34}{'auth off ms':>12}{'bearer ms':>11}{'ratio':>8}{'target':>8}")
    ok = True
    for mode, label in (("2026-07-28", "2026-07-28"), ("legacy", "2025-11-25 (SSE)")):
        off, on = anyio.run(latency, open_url, auth_url, token, mode, calls)
        ratio = statistics.median(on) / statistics.median(off)
        ok &= ratio <= TARGET
        name = f"tools/call p50, {label}"
        print(f"{name:<34}{statistics.median(off):>12.3f}{statistics.median(on):>11.3f}{ratio:>7.2f}x{TARGET:>7.1f}x")
    return ok


if __name__ == "__main__":
    main()
