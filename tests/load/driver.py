"""The load and soak driver (issue 19): a real `bastion serve --http`, N real MCP clients, one mix.

The server is the real command with sandboxes on, in a temporary folder, on loopback. Each client is
the SDK's Streamable HTTP client with a bearer token of its own from `bastion admin token`, half on
the 2026-07-28 protocol and half on the 2025-11-25 handshake. They share a population of sandboxes
and issue a mix of work, lifecycle and hostile calls; each keeps its own tally per tool (ok, expected
refusal, unexpected) with latencies, and checks what it reads back. At the end the caller compares
the tallies with the audit log's `end` records, one for one, by the `audit_id` every answer carries,
and what the server holds with what it held before (tests/load/measure.py).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import random
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.config import load_config
from bastion.demo import init_demo
from bastion.transports.http.admin_cli import issue_token
from bastion.transports.http.password import write_hash
from bastion.transports.http.store import AuthStore
from tests.transports.http.live import PASSWORD, LiveServer, free_port, serve_config

from .measure import (
    CLIENT_PREFIX,
    AuditCount,
    Holdings,
    Sampler,
    ServerProbe,
    Tally,
    audit_mismatches,
    count_audit,
    cpu_seconds,
    merged,
    verify_audit,
)

OK = "OK"
CALL_TIMEOUT_S = 120.0
AUDIT_ROTATE_BYTES = 1024 * 1024
MODES = ("2026-07-28", "legacy")
# Relative weights of the mix; "churn" is create, use, close, then a status call that must find nothing.
MIX: dict[str, int] = {
    "run_command": 25,
    "write_file": 12,
    "read_file": 12,
    "edit_file": 10,
    "execute_code": 12,
    "list_sandboxes": 5,
    "get_sandbox_status": 10,
    "churn": 5,
    "close_race": 2,
    "path_escape": 4,
    "missing_file": 4,
}


def env_int(name: str, default: int) -> int:
    """An integer from the environment (the make targets' overrides), else `default`."""
    value = os.environ.get(name)
    return int(value) if value else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass(frozen=True)
class Plan:
    """A run's sizes: `rate` calls/s in all (None: as fast as the clients go), `seed` for the mix."""

    sandboxes: int
    clients: int
    duration_s: float
    rate: float | None = None
    seed: int = 19

    def __post_init__(self) -> None:
        if self.sandboxes < self.clients:
            raise ValueError("each client needs a sandbox of its own: sandboxes >= clients")


# --- the server ------------------------------------------------------------------------------------


def write_load_config(root: Path, port: int, plan: Plan) -> Path:
    """The demo config with sandboxes on (disk quota, cgroups, warm pool) and room for the population
    plus one churned sandbox per client."""
    path = init_demo(root)
    text = path.read_text()
    # Small files: the run rotates the log many times, under concurrent group commits.
    text = text.replace("rotate_bytes = 67108864", f"rotate_bytes = {AUDIT_ROTATE_BYTES}", 1)
    text = text.replace("max_sandboxes = 16", f"max_sandboxes = {plan.sandboxes + plan.clients}", 1)
    text = text.replace("http://127.0.0.1:8765", f"http://127.0.0.1:{port}")
    text = text.replace('listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"')
    path.write_text(text)
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    return path


@contextlib.contextmanager
def load_server(root: Path, plan: Plan) -> Iterator[LiveServer]:
    port = free_port()
    with serve_config(root, write_load_config(root, port, plan), port) as server:
        yield server


def issue_tokens(server: LiveServer, count: int) -> list[str]:
    """One access token per client, issued by `bastion admin token`'s own function (`issue_token`) in
    this process: the command costs ~1.4 s of CPU to start (it imports the HTTP app), 45 s for 32
    clients on a loaded 2-core machine; tests/transports/http/test_admin_token.py runs the command."""
    config = load_config(server.config_path)
    store = AuthStore(config.db_path)
    tokens = []
    try:
        for index in range(count):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                issue_token(config, store, client=f"{CLIENT_PREFIX}{index}", scopes=["workbench"], ttl_s=86_400)
            tokens.append(printed.getvalue().strip())
    finally:
        store.close()
    return tokens


# --- a client --------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One MCP client's state in the mix: its files per sandbox (generation of the edit marker)."""

    index: int
    client: Client
    tally: Tally
    rng: random.Random
    population: list[str]
    own: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    @property
    def path(self) -> str:
        return f"c{self.index}/notes.txt"

    async def call(self, tool: str, args: dict[str, Any], expect: str | frozenset[str] = OK) -> dict[str, Any] | None:
        """One tools/call; a result whose code is not `expect` (or one of them) counts as unexpected.
        Returns the answer, or None if it was unexpected."""
        self.calls += 1
        started = time.perf_counter()
        try:
            with anyio.fail_after(CALL_TIMEOUT_S):
                result = await self.client.call_tool(tool, args)
        except Exception as exc:  # anything the transport raises is a finding, in words
            self.tally.unexpected(tool, f"{type(exc).__name__}: {exc}"[:300])
            return None
        counts = self.tally.tool(tool)
        counts.latencies_s.append(time.perf_counter() - started)
        payload = result.structured_content
        if payload is None or "code" not in payload:
            self.tally.unexpected(tool, f"no OperationResult: {result.content!r}"[:300])
            return None
        if payload.get("audit_id"):
            counts.audit_ids.append(payload["audit_id"])
        allowed = {expect} if isinstance(expect, str) else expect
        if payload["code"] not in allowed:
            self.tally.unexpected(tool, f"{payload['code']} (expected {expect}): {payload.get('reason')}"[:300])
            return None
        if payload["code"] == OK:
            counts.ok += 1
        else:
            counts.refused += 1
        return payload

    def wrong(self, tool: str, what: str) -> None:
        """A call that succeeded with the wrong answer: moved from ok to unexpected."""
        self.tally.tool(tool).ok -= 1
        self.tally.unexpected(tool, what)

    def pick(self) -> str:
        return self.rng.choice(self.population)

    def content(self, sandbox_id: str) -> str:
        generation = self.files[sandbox_id]
        return f"client {self.index} in {sandbox_id}\ngen={generation}\n" + "x" * (100 + 64 * (self.index % 16))


async def op_run_command(w: Worker) -> None:
    box = w.pick()
    token = f"{w.index}-{w.calls}"
    done = await w.call("run_command", {"command": f"echo {token} && ls -a | wc -l", "sandbox_id": box})
    if done is not None and not done["detail"]["stdout"].startswith(token + "\n"):
        w.wrong("run_command", f"stdout {done['detail']['stdout']!r} lacks {token!r}")


async def op_write_file(w: Worker) -> None:
    box = w.pick()
    w.files[box] = w.files.get(box, 0) + 1
    done = await w.call("write_file", {"path": w.path, "content": w.content(box), "sandbox_id": box})
    if done is None:
        w.files.pop(box)  # unknown state: read it no more


async def op_read_file(w: Worker) -> None:
    if not w.files:
        await op_write_file(w)
        return
    box = w.rng.choice(sorted(w.files))
    done = await w.call("read_file", {"path": w.path, "sandbox_id": box})
    if done is not None and done["detail"]["content"] != w.content(box):
        w.wrong("read_file", f"{box}: read back something else than was written")


async def op_edit_file(w: Worker) -> None:
    if not w.files:
        await op_write_file(w)
        return
    box = w.rng.choice(sorted(w.files))
    generation = w.files[box]
    args = {"path": w.path, "old": f"gen={generation}\n", "new": f"gen={generation + 1}\n", "sandbox_id": box}
    w.files.pop(box)  # unknown state until the answer says
    if await w.call("edit_file", args) is not None:
        w.files[box] = generation + 1


async def op_execute_code(w: Worker) -> None:
    # A code context runs one cell at a time (another's is CONFLICT): each client codes in its own sandboxes.
    box = w.rng.choice(w.own)
    a, b = w.rng.randrange(1000), w.index
    done = await w.call("execute_code", {"code": f"n = {a} * {b} + 1\nn", "sandbox_id": box})
    if done is not None and done["detail"].get("value") != str(a * b + 1):
        w.wrong("execute_code", f"value {done['detail'].get('value')!r}, expected {a * b + 1}")


async def op_list_sandboxes(w: Worker) -> None:
    done = await w.call("list_sandboxes", {})
    if done is not None:
        listed = {box["sandbox_id"] for box in done["detail"]["sandboxes"]}
        if not set(w.population) <= listed:
            w.wrong("list_sandboxes", f"{len(set(w.population) - listed)} population sandboxes missing")


async def op_get_sandbox_status(w: Worker) -> None:
    box = w.pick()
    done = await w.call("get_sandbox_status", {"sandbox_id": box})
    if done is not None and done["detail"]["state"] != "running":
        w.wrong("get_sandbox_status", f"{box} is {done['detail']['state']}")


async def op_churn(w: Worker) -> None:
    """Create, use and close a sandbox of this client's; the closed one must then be gone for everyone."""
    made = await w.call("create_sandbox", {"labels": {"load": f"churn-{w.index}"}})
    if made is None:
        return
    box = made["detail"]["sandbox_id"]
    await w.call("run_command", {"command": "echo churn > f && cat f", "sandbox_id": box})
    if await w.call("close_sandbox", {"sandbox_id": box}) is not None:
        await w.call("get_sandbox_status", {"sandbox_id": box}, expect="SANDBOX_NOT_FOUND")


RACING_CLOSE = frozenset({OK, "SANDBOX_NOT_FOUND", "UNAVAILABLE", "NOT_FOUND"})
"""What a call on a sandbox another call is closing may answer: done, or a typed refusal."""


async def op_close_race(w: Worker) -> None:
    """Close a sandbox while other calls use it (one agent ends a sandbox another still works in)."""
    made = await w.call("create_sandbox", {"labels": {"load": f"race-{w.index}"}})
    if made is None:
        return
    box = made["detail"]["sandbox_id"]
    await w.call("write_file", {"path": "a.txt", "content": "needle\n" * 5000, "sandbox_id": box})
    racing: list[tuple[str, dict[str, Any]]] = [
        ("read_file", {"path": "a.txt"}),
        ("list_directory", {}),
        ("search_files", {"pattern": "needle"}),
        ("run_command", {"command": "wc -l a.txt"}),
    ]
    close_at = w.rng.randrange(len(racing) + 1)
    async with anyio.create_task_group() as group:
        for tool, args in [*racing[:close_at], ("close_sandbox", {}), *racing[close_at:]]:
            expect = OK if tool == "close_sandbox" else RACING_CLOSE
            group.start_soon(functools.partial(w.call, tool, {**args, "sandbox_id": box}, expect))


async def op_path_escape(w: Worker) -> None:
    """A hostile agent's read outside its /workspace, under load: refused, every time."""
    path = w.rng.choice(["../../../../etc/shadow", "/etc/passwd", "../" * 12 + "proc/1/environ"])
    await w.call("read_file", {"path": path, "sandbox_id": w.pick()}, expect="PATH_ESCAPE")


async def op_missing_file(w: Worker) -> None:
    await w.call("read_file", {"path": f"c{w.index}/absent.txt", "sandbox_id": w.pick()}, expect="NOT_FOUND")


OPS: dict[str, Callable[[Worker], Awaitable[None]]] = {
    "run_command": op_run_command,
    "write_file": op_write_file,
    "read_file": op_read_file,
    "edit_file": op_edit_file,
    "execute_code": op_execute_code,
    "list_sandboxes": op_list_sandboxes,
    "get_sandbox_status": op_get_sandbox_status,
    "churn": op_churn,
    "close_race": op_close_race,
    "path_escape": op_path_escape,
    "missing_file": op_missing_file,
}

# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Phase:
    """What the clients do next, shared by all: set up, run the mix until `until`, or tear down."""

    population: list[str] = field(default_factory=list)
    until: float = 0.0
    mix_started: float = 0.0
    mix_ended: float = 0.0
    calls_in_mix: int = 0
    load_average: tuple[float, float] = (0.0, 0.0)
    """The host's 1-minute load average as the mix started and as it ended (other work shares the host)."""
    server_cpu_s: float = 0.0
    clients_cpu_s: float = 0.0
    """CPU time over the mix of the server process, and of this process (every client's)."""


@contextlib.asynccontextmanager
async def connected(url: str, token: str, mode: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=CALL_TIMEOUT_S) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


async def run_load(server: LiveServer, plan: Plan) -> tuple[list[Tally], Phase]:
    """Set up the population, run the mix for `plan.duration_s`, close the population; every client's tally.

    Set-up: the clients create the population between them and run one code cell in each sandbox (its
    Python context then lives for the run, so the mix starts no process that outlives a call).
    """
    tokens = await anyio.to_thread.run_sync(issue_tokens, server, plan.clients)
    tallies = [Tally() for _ in range(plan.clients)]
    workers: list[Worker] = []
    phase = Phase()
    ready = [anyio.Event() for _ in range(plan.clients)]
    mixed = [anyio.Event() for _ in range(plan.clients)]
    go = anyio.Event()

    async def client_task(index: int) -> None:
        async with connected(server.mcp_url, tokens[index], MODES[index % 2]) as client:
            worker = Worker(index, client, tallies[index], random.Random(plan.seed * 1000 + index), phase.population)
            workers.append(worker)
            for _ in range(index, plan.sandboxes, plan.clients):
                made = await worker.call("create_sandbox", {"labels": {"load": "population"}})
                if made is not None:
                    worker.own.append(made["detail"]["sandbox_id"])
                    await worker.call("execute_code", {"code": "0", "sandbox_id": worker.own[-1]})
            ready[index].set()
            await go.wait()
            if worker.own:
                await mix(worker, plan, phase)
            # Tear down once every client is out of the mix: another may still be using these sandboxes.
            mixed[index].set()
            for event in mixed:
                await event.wait()
            for box in worker.own:
                await worker.call("close_sandbox", {"sandbox_id": box})

    async with anyio.create_task_group() as group:
        for index in range(plan.clients):
            group.start_soon(client_task, index)
        for event in ready:
            await event.wait()
        phase.population.extend(box for worker in workers for box in worker.own)
        if len(workers) < plan.clients or not all(worker.own for worker in workers):
            raise RuntimeError(f"a client could not create its sandboxes: {merged(tallies).failures[:3]}")
        phase.mix_started = time.monotonic()
        phase.until = phase.mix_started + plan.duration_s
        cpu = cpu_seconds(server.process.pid), time.process_time()
        load_start = os.getloadavg()[0]
        go.set()
        for event in mixed:
            await event.wait()
        phase.load_average = (load_start, os.getloadavg()[0])
        phase.server_cpu_s = cpu_seconds(server.process.pid) - cpu[0]
        phase.clients_cpu_s = time.process_time() - cpu[1]
    return tallies, phase


async def mix(worker: Worker, plan: Plan, phase: Phase) -> None:
    names = list(MIX)
    weights = [MIX[name] for name in names]
    interval = plan.clients / plan.rate if plan.rate else 0.0
    # Spread the clients' first calls over one interval, so a steady rate is steady from the start.
    next_at = time.monotonic() + interval * worker.rng.random()
    while True:
        await anyio.sleep(max(0.0, next_at - time.monotonic()))
        if time.monotonic() >= phase.until:
            break
        before = worker.calls
        await OPS[worker.rng.choices(names, weights)[0]](worker)
        made = worker.calls - before
        phase.calls_in_mix += made
        phase.mix_ended = max(phase.mix_ended, time.monotonic())
        # An op may make several calls (churn makes four). A client that fell behind does not burst to
        # catch up: the rate is a ceiling.
        next_at = max(next_at + interval * made, time.monotonic())


# --- a whole run ----------------------------------------------------------------------------------


@dataclass
class Run:
    """A run's tallies and what the server shows afterwards."""

    plan: Plan
    tally: Tally
    phase: Phase
    audit: AuditCount
    verified: subprocess.CompletedProcess[str]
    log: str
    before: Holdings
    after: Holdings
    sampler: Sampler

    @property
    def seconds(self) -> float:
        return self.phase.mix_ended - self.phase.mix_started

    @property
    def throughput(self) -> float:
        return self.phase.calls_in_mix / self.seconds

    def problems(self) -> list[str]:
        """What a run must never show, whatever its size: each problem in one line."""
        found = list(self.tally.failures)
        found += audit_mismatches(self.tally, self.audit)
        if self.verified.returncode != 0:
            found.append(f"audit verify: {self.verified.stdout.strip()} {self.verified.stderr.strip()}")
        if "Traceback" in self.log:
            found.append(f"the server logged a traceback: {self.log[self.log.index('Traceback') :][:2000]}")
        if self.after != self.before:
            found.append(f"left behind: before {self.before.line()}, after {self.after.line()}")
        return found

    def summary(self) -> str:
        unexpected = sum(t.unexpected for t in self.tally.tools.values())
        mismatches = audit_mismatches(self.tally, self.audit)
        verified = "intact" if self.verified.returncode == 0 else self.verified.stdout.strip()
        cpu = self.phase.server_cpu_s
        return (
            f"Host load average (1 min) {self.phase.load_average[0]:.1f} as the mix started, "
            f"{self.phase.load_average[1]:.1f} as it ended. Server CPU over the mix: {cpu:.0f} s "
            f"({cpu / self.seconds:.0%} of one core, "
            f"{cpu / self.phase.calls_in_mix * 1000:.1f} ms per call); the clients' process: "
            f"{self.phase.clients_cpu_s / self.phase.calls_in_mix * 1000:.1f} ms per call. "
            f"Unexpected errors: {unexpected}. Audit: {self.audit.records} records in {self.audit.files} files "
            f"(rotated at {AUDIT_ROTATE_BYTES // 1024} KiB); every answer's end record present exactly once: "
            f"{'yes' if not mismatches else '; '.join(mismatches)}; "
            f"`bastion audit verify`: {verified}. The server held before the run and after closing every "
            f"sandbox: {self.before.line()} / {self.after.line()}."
        )


async def run_checked(root: Path, plan: Plan, *, sample_every_s: float = 5.0) -> Run:
    """Serve, set up, run the mix while sampling the server, close everything, and read what is left."""
    with load_server(root, plan) as server:
        probe = ServerProbe(server.process.pid, root, disks=load_config(server.config_path).sandboxes.disk_quota)
        before = await probe.settled()
        sampler = Sampler(probe, sample_every_s)
        async with anyio.create_task_group() as group:
            group.start_soon(sampler.run)
            tallies, phase = await run_load(server, plan)
            group.cancel_scope.cancel()
        after = await probe.settled(expected=before)
        audit = await anyio.to_thread.run_sync(count_audit, server.root / "state" / "audit.jsonl")
        verified = await anyio.to_thread.run_sync(verify_audit, server)
        log = server.log()
    return Run(plan, merged(tallies), phase, audit, verified, log, before, after, sampler)
