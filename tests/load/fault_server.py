"""A real `bastion serve --http` under a few concurrent MCP clients, and what a fault may leave behind.

Shared by the tests/load/test_fault_*.py files. The server is the real command in a child process
(auth off, loopback only), with the demo config in the test's temp folder; the clients are the SDK's
real Streamable HTTP clients, each in a task of its own. What a crashed or stopped server may leave is
counted for that server only (other tests run in parallel): processes descending from it, mounts under
its folder, cgroups named after its pid, loop devices backed by its files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path
from typing import Any, Final

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.demo import init_demo
from bastion.safety.results import OperationResult
from tests.helpers import BASTION, Payload, client_tls, free_port, mounts_under

READY_S: Final = 30.0
STOP_S: Final = 30.0
CALL_TIMEOUT_S: Final = 60.0


AUDIT_RESERVE_BYTES = 65536


def fault_config(root: Path, *, state_dir: Path | None = None, with_sandboxes: bool = True) -> Path:
    """The demo config (`bastion init`), served over HTTP on a free loopback port with auth off and
    INFO logging; the state folder moved to `state_dir` if given."""
    path = init_demo(root)
    port = free_port()
    text = path.read_text()
    text = text.replace('listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"')
    text = text.replace('public_url = "http://127.0.0.1:8765"', f'public_url = "http://127.0.0.1:{port}"')
    text = text.replace("[http]\n", "[http]\nauth = false\n", 1)
    text = text.replace('log_level = "WARNING"', 'log_level = "INFO"')
    # The audit log's reserve (8 MiB by default) small enough for the load to use it up in a moment:
    # a full state filesystem then refuses calls within the tests' deadlines.
    text = text.replace("[audit]\n", f"[audit]\nreserve_bytes = {AUDIT_RESERVE_BYTES}\n", 1)
    if not with_sandboxes:
        text = text.replace("[sandboxes]\nenabled = true\n", "[sandboxes]\nenabled = false\n", 1)
    if state_dir is not None:
        text = text.replace('state_dir = "state"', f'state_dir = "{state_dir}"')
    path.write_text(text)
    return path


def _port(config_path: Path) -> int:
    found = re.search(r'(?m)^listen = "127\.0\.0\.1:(\d+)"', config_path.read_text())
    assert found is not None
    return int(found.group(1))


@dataclass
class Served:
    """One `bastion serve --http` process over `config_path`; `start` again after it ended restarts it."""

    config_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def port(self) -> int:
        return _port(self.config_path)

    @property
    def mcp_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.config_path.parent / f"server-{self.starts}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(BASTION), "serve", "--config", str(self.config_path), "--http"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until the server answers, or its start failed."""
        assert self.process is not None
        deadline = time.monotonic() + READY_S
        with httpx2.Client(timeout=5, verify=client_tls()) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited {self.process.returncode}: {self.log()}")
                try:
                    client.get(f"http://127.0.0.1:{self.port}/.well-known/oauth-protected-resource")
                    return
                except httpx2.TransportError:
                    time.sleep(0.05)
        raise RuntimeError(f"server did not start: {self.log()}")

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = STOP_S) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        """End the server if it still runs (teardown): SIGTERM, then SIGKILL if it does not go."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


# --- the clients ------------------------------------------------------------------------------


@dataclass
class Load:
    """What a few concurrent clients got: every answer (an OperationResult) and every broken session."""

    url: str
    answers: list[Payload] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    stop: anyio.Event = field(default_factory=anyio.Event)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Client]:
        async with (
            httpx2.AsyncClient(timeout=CALL_TIMEOUT_S, verify=client_tls()) as http,
            Client(streamable_http_client(self.url, http_client=http)) as client,
        ):
            yield client

    async def call(self, client: Client, tool: str, **args: object) -> Payload:
        """One tools/call; the answer must be an OperationResult (never a traceback), and is kept."""
        result = await client.call_tool(tool, args)
        payload = result.structured_content
        assert payload is not None, result
        assert result.is_error is (not payload["ok"]), payload
        OperationResult.model_validate(payload)
        assert "Traceback" not in json.dumps(payload), payload
        assert payload["code"] != "INTERNAL_ERROR", payload  # an unexpected exception in the server
        self.answers.append(payload)
        return payload

    def summary(self, fault: str) -> str:
        """One line for the fault report (docs/load-report.md): answers by code, slowest answer."""
        slowest = max((a["duration_ms"] for a in self.answers), default=0.0)
        codes = ", ".join(f"{code} {n}" for code, n in sorted(self.codes().items()))
        return (
            f"fault {fault}: {len(self.answers)} answers ({codes}), slowest {slowest:.0f} ms, broken {len(self.broken)}"
        )

    def codes(self, tool: str | None = None) -> Counter[str]:
        return Counter(a["code"] for a in self.answers if tool is None or a["action"] == tool)

    async def run(self, clients: int, work: Callable[[Load, Client, int], Awaitable[None]]) -> None:
        """Run `work` in `clients` sessions at once until each returns or its session breaks."""
        async with anyio.create_task_group() as tasks:
            for index in range(clients):
                tasks.start_soon(self._one, work, index)

    async def _one(self, work: Callable[[Load, Client, int], Awaitable[None]], index: int) -> None:
        try:
            async with self.session() as client:
                await work(self, client, index)
        except Exception as exc:  # the session broke (the server died): kept, and the client stops
            if _failed_check(exc):
                raise  # a client's own assertion is the test failing, never a broken session
            self.broken.append(f"client {index}: {type(exc).__name__}: {exc}")


def _failed_check(exc: BaseException) -> bool:
    """Whether `exc` is (or holds, in an exception group) an AssertionError."""
    if isinstance(exc, AssertionError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_failed_check(inner) for inner in exc.exceptions)
    return False


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds, failing after `timeout_s` (a bounded wait, never a fixed sleep)."""
    try:
        with anyio.fail_after(timeout_s):
            while not predicate():
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """`until` for synchronous code."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def internal_errors(log: str) -> list[str]:
    """The server log's lines about unexpected exceptions: a tool's internal error (its traceback is
    logged as one line), one the ASGI server caught, or a plain traceback."""
    markers = ("internal error in", "Exception in ASGI application", "Traceback (most recent call last)")
    return [line for line in log.splitlines() if any(marker in line for marker in markers)]


# --- what a server leaves behind --------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime: tells a reused pid apart


def descendants(pid: int) -> set[tuple[int, str]]:
    """The processes below `pid` now, as (pid, start time)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: set[tuple[int, str]] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        started = _start_time(child)
        if started is not None:
            found.add((child, started))
        todo.extend(children.get(child, []))
    return found


def still_alive(processes: set[tuple[int, str]]) -> list[int]:
    """Which of `processes` still exist (the same process, not a reused pid; zombies count as gone)."""
    alive = []
    for pid, started in processes:
        if _start_time(pid) != started:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return sorted(alive)


def cgroups_of(server_pid: int) -> list[str]:
    """The cgroups the server with this pid made, in any hierarchy (`sb-PID-N`, `bastion-vm-PID-N`)."""
    return sorted(
        glob(f"/sys/fs/cgroup/*/bastion/sb-{server_pid}-*") + glob(f"/sys/fs/cgroup/*/bastion/*-{server_pid}-*")
    )


def loops_under(folder: Path) -> list[str]:
    """Loop devices whose backing file is under `folder`."""
    found = []
    for backing in glob("/sys/block/loop*/loop/backing_file"):
        try:
            name = Path(backing).read_text().strip()
        except OSError:
            continue
        if name.startswith(f"{folder}/"):
            found.append(name)
    return sorted(found)


@dataclass(frozen=True)
class Leftovers:
    processes: list[int]
    mounts: list[str]
    cgroups: list[str]
    loops: list[str]

    @property
    def none(self) -> bool:
        return not (self.processes or self.mounts or self.cgroups or self.loops)


def leftovers(folder: Path, server_pid: int, processes: set[tuple[int, str]]) -> Leftovers:
    """What a server that is gone left: its processes, and mounts, cgroups and loops of its folder."""
    return Leftovers(still_alive(processes), mounts_under(folder), cgroups_of(server_pid), loops_under(folder))


def settled_leftovers(folder: Path, server_pid: int, processes: set[tuple[int, str]]) -> Leftovers:
    """`leftovers` once the kernel has finished ending the server's processes (a bounded wait: mounts
    and cgroups of a killed server stay until the next start, so only the processes are waited for)."""
    deadline = time.monotonic() + 10
    while still_alive(processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return leftovers(folder, server_pid, processes)


def open_starts(path: Path) -> list[dict[str, Any]]:
    """The start records with no end record: calls that were in flight when the server was killed."""
    records = audit_records(path)
    ended = {r["call"] for r in records if r["event"] == "end"}
    return [r for r in records if r["event"] == "start" and r["call"] not in ended]


def unmount_all(folder: Path) -> None:
    """Teardown after a failed test: lazily unmount whatever is still mounted under `folder`
    (deepest first), so pytest can remove it and no loop device stays attached."""
    for point in sorted(mounts_under(folder), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


# --- the audit log ----------------------------------------------------------------------------


def audit_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def verify_cli(config_path: Path) -> subprocess.CompletedProcess[str]:
    """`bastion audit verify --config CONFIG`, the operator's command."""
    return subprocess.run(
        [str(BASTION), "audit", "verify", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def answered_calls_are_logged(answers: list[Payload], path: Path, *, complete: bool = True) -> None:
    """Every answer a client got that names an audit record has that record in the log, exactly once;
    with `complete`, every call's start record (a mutating call's) also has its end record (a server
    killed mid-call leaves starts without ends: those calls were never answered)."""
    records = audit_records(path)
    ids = Counter(r["id"] for r in records)
    for answer in answers:
        if answer["audit_id"] is not None:
            assert ids[answer["audit_id"]] == 1, answer
    ends = Counter(r["call"] for r in records if r["event"] == "end")
    assert all(count == 1 for count in ends.values()), "a call has two end records"
    if not complete:
        return
    starts = [r["call"] for r in records if r["event"] == "start"]
    assert all(ends[call] == 1 for call in starts), [c for c in starts if ends[c] != 1]
