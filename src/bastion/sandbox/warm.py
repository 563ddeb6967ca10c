"""A warm sandbox: one bubblewrap sandbox kept alive, running one command per request.

The host side of the protocol described in `bastion.sandbox.inside.agent`. Output is
read by the host directly from pipes whose write ends were handed to the agent,
so nothing the command prints passes through the agent.

A command runs either to completion (`run`, with a time limit) or in the background
(`spawn`): then it outlives the call, its stdin is a pipe from the host, and its output
goes to bounded rings (`bastion.sandbox.processes`) until it exits, is killed (`kill`),
or the sandbox closes. Or on a pseudo-terminal (`open_pty`): the agent opens the pair inside
the sandbox and hands the host its master end, the one file descriptor the host ever accepts
from inside, and only in answer to its own request (`_on_pty`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import marshal
import math
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Final

from bastion.safety.errors import (
    BastionError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.rates import ByteRate
from bastion.safety.redact import sanitize_terminal
from bastion.sandbox._spawn import SandboxProcess, SandboxSpec, hold_sandbox, release, start_sandbox
from bastion.sandbox.backend import Backend, Process, Sandbox
from bastion.sandbox.backend import RunOutcome as RunOutcome
from bastion.sandbox.cgroups import (
    CgroupLayout,
    CommandCgroup,
    Limits,
    SandboxCgroup,
    Usage,
    fd_migration_supported,
)
from bastion.sandbox.command_groups import CommandGroups, Leftover, kill_pidfd
from bastion.sandbox.netns import NamespaceUnusable, NetworkNamespace, is_foreign_netns
from bastion.sandbox.processes import (
    OUTPUT_BURST_BYTES,
    OUTPUT_BYTES_PER_S,
    BackgroundProcess,
    OutputSink,
    PipeCapture,
    PtyProcess,
    RingCapture,
    readable,
)

logger = logging.getLogger("bastion.sandbox")

START_TIMEOUT_S: Final = 10.0
_STDERR_TAIL_BYTES: Final = 64 * 1024  # what a failed start's reason is looked for in
_GROUP_PREFIX: Final = "sb"
_group_ids = itertools.count(1)
KILL_GRACE_S: Final = 5.0
# How often a killed command's group is looked at until it is empty (`_emptied`): from the first, doubling to the last.
EMPTY_CHECK_FIRST_S: Final = 0.001
EMPTY_CHECK_LAST_S: Final = 0.02
OUTPUT_GRACE_S: Final = 0.2  # after a command's exit, for output still on its way (see `_output_after_exit`)
MAX_MESSAGE_BYTES: Final = 65_536
_NOTHING_ACCEPTS: Final = "nothing accepts connections on that port in the sandbox"
CONNECT_TIMEOUT_S: Final = 5.0  # the agent gives up after 2 s (`CONNECT_TIMEOUT_S` in inside/agent.py)
# The pseudo-terminal multiplexer, /dev/ptmx (Documentation/admin-guide/devices.txt): what a master fd stats as.
PTMX_DEVICE: Final = (5, 2)
MAX_AGENT_ERROR_CHARS: Final = 200
# Pipes of commands that have returned, still read (and dropped) for what they left running: per sandbox (`_hold`).
MAX_HELD_PIPES: Final = 64

# Sandbox cgroups whose removal failed (EMFILE writing cgroup.kill at a close): each later `_reap` and the
# manager's reaper try again (`destroy_left_groups`). Shared by every sandbox of the process: a closed one
# has no next close of its own.
_undestroyed: list[SandboxCgroup] = []
_undestroyed_lock = threading.Lock()


def _descendants(pid: int) -> list[int]:
    """`pid`'s descendants, depth first (each followed by its own), without recursion: a chain of processes
    as deep as the pids limit allows must not reach Python's recursion limit."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        if parent != pid:
            found.append(parent)
        children: list[int] = []
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as handle:
                    children += [int(child) for child in handle.read().split()]
        except OSError:
            pass
        todo += children[::-1]
    return found


def _children(pid: int) -> list[int]:
    try:
        return [child for task in os.listdir(f"/proc/{pid}/task") for child in _task_children(pid, task)]
    except OSError:
        return []


def _task_children(pid: int, task: str) -> list[int]:
    with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
        return [int(child) for child in handle.read().split()]


def _pidfds(pids: list[int]) -> list[int]:
    fds = []
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            fds.append(os.pidfd_open(pid))
    return fds


def _wait_exited(pidfds: list[int], timeout_s: float) -> None:
    """Wait, at most `timeout_s`, until each process exits (its pidfd turns readable); close the fds."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    try:
        remaining = set(pidfds)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(1, round((deadline - time.monotonic()) * 1000))):
                poller.unregister(fd)
                remaining.discard(fd)
    finally:
        for fd in pidfds:
            os.close(fd)


async def exited(pidfd: int, timeout_s: float) -> bool:
    """Wait on the event loop, at most `timeout_s`, until the process exits (its pidfd turns readable); whether
    it did. No worker thread: see `WarmSandbox.settled`."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, _set_done, exited)
    try:
        async with asyncio.timeout(timeout_s):
            await exited
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
    return True


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _emptied(group: CommandCgroup, timeout_s: float) -> bool:
    """Wait, at most `timeout_s`, until a killed group holds no process; whether it does not. Looked at on the
    event loop (a read of cgroup.events) between pauses that grow from EMPTY_CHECK_FIRST_S to EMPTY_CHECK_LAST_S:
    no worker thread (see `WarmSandbox.settled`), and cgroup.events polls readable always under epoll (kernfs
    flags a change with POLLPRI only), so the loop's selector cannot wait on it.

    Raises:
        OperationFailed: the group's files cannot be read.
    """
    return await polled(lambda: not group.populated(), timeout_s, EMPTY_CHECK_FIRST_S, EMPTY_CHECK_LAST_S)


async def polled(done: Callable[[], bool], timeout_s: float, first_s: float, last_s: float) -> bool:
    """Look at `done()` on the event loop, at most `timeout_s`, between pauses growing from `first_s` to `last_s`,
    until it is true; whether it was. For what the loop's selector cannot wait on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = first_s
    while not done():
        left = deadline - loop.time()
        if left <= 0:
            return False
        await asyncio.sleep(min(pause, left))
        pause = min(2 * pause, last_s)
    return True


class _Reaping:
    """A `_reap` in a thread of its own; `done` is set once it is over, even if it failed (as a thread's join
    returns), so a loop awaits it without a worker thread (`asyncio.wrap_future`)."""

    def __init__(self, proc: SandboxProcess | None, group: SandboxCgroup | None, workspace: str) -> None:
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.done.set_running_or_notify_cancel()  # an awaiting call cancelled cannot cancel the reap
        thread = threading.Thread(target=self._run, args=(proc, group, workspace), name="bastion-reap", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            # No thread to be had (found by attack: the server's cgroup at its pids limit): a close answered
            # INTERNAL_ERROR, its sandbox already forgotten, and its disk, loop device and cgroups outlived the
            # server. Reaped here, the caller's thread waiting: the host is at its limit, and this is rare.
            logger.warning("no thread for a sandbox's reap (the host is out of threads): reaped in the caller's")
            self._run(proc, group, workspace)

    def _run(self, proc: SandboxProcess | None, group: SandboxCgroup | None, workspace: str) -> None:
        try:
            _reap(proc, group, workspace)
        finally:
            self.done.set_result(None)


def _scratch_is_empty(proc: SandboxProcess | None) -> bool:
    """Whether bwrap's own /tmp and /dev/shm (tmpfs in the sandbox's mount namespace) hold nothing."""
    if proc is None:
        return True
    inner = _descendants(proc.pid)
    if not inner:
        return False
    # The deepest process is inside the sandbox's mount namespace; /proc/PID/root is its root.
    for folder in ("tmp", "dev/shm"):
        try:
            with os.scandir(f"/proc/{inner[-1]}/root/{folder}") as entries:
                if next(entries, None) is not None:
                    return False
        except OSError:
            return False
    return True


def _mib(count: int) -> str:
    return f"{count / 2**20:.0f} MiB"


class WarmSandbox:
    """One long-lived sandbox; commands in it run concurrently.

    The bubblewrap implementation of `bastion.sandbox.backend.Sandbox`. With cgroups, commands
    share the sandbox's PID namespace, each in a cgroup of its own (`command_groups`): what
    a command leaves running lives on until the sandbox closes. Without (``cgroups=None``),
    each runs as PID 1 of a PID namespace of its own, and nothing it starts outlives it.
    """

    def __init__(self, spec: SandboxSpec, *, cgroups: CgroupLayout | None = None, limits: Limits | None = None) -> None:
        if limits is not None and cgroups is None:
            raise Unavailable("resource limits need cgroups, and none are available")
        self.spec = spec
        self._cgroups = cgroups
        self._limits = limits
        self._group: SandboxCgroup | None = None
        self._commands: CommandGroups | None = None  # while it runs with a cgroup
        self._paused = False
        self._proc: SandboxProcess | None = None
        self._sock: socket.socket | None = None
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # where `_on_message` reads the agent
        self._waiters: dict[int, asyncio.Future[int]] = {}  # by command id, until it exits
        self._background: dict[int, BackgroundProcess] = {}  # by command id, until it exits
        self._connects: dict[int, asyncio.Future[socket.socket]] = {}  # by request id, until answered
        self._writables: set[asyncio.Future[None]] = set()  # sends waiting for room in the agent's socket
        # By command id: kills the agent has not answered yet, and when to end the sandbox if it never does.
        self._kill_deadlines: dict[int, asyncio.TimerHandle] = {}
        self._agent_pid: int | None = None  # the agent's pid on the host, with command groups (`_agent_of`)
        self._resumed_at = -math.inf  # monotonic time of the last resume (a frozen agent answers nothing)
        # This run's network namespace, from the agent (netns.py): None until asked for and answered.
        self._netns: NetworkNamespace | None = None
        self._netns_asked = False
        self._netns_awaited = False  # asked and not answered yet: only the first answer counts
        self._ptys: dict[int, PtyProcess] = {}  # commands on a terminal, by command id, until they exit
        # Terminals asked for and not yet answered: by command id, the future the answer settles and the argv.
        self._pty_openings: dict[int, tuple[asyncio.Future[PtyProcess], tuple[str, ...]]] = {}
        self._start_lock = asyncio.Lock()
        # A start under way (not `start`'s check of a sandbox already running, which takes the lock too): read from
        # worker threads (a pause), which would see the lock taken by every command's check (found by review).
        self._starting = False
        self._command_ids = itertools.count(1)
        self._asleep = False  # stopped while idle; the next command starts it again
        self._reaping: list[_Reaping] = []  # ending earlier runs' processes and cgroups
        self._closed = False  # closed for good (aclose(final=True)): it never starts again
        self._reaping_tasks: set[asyncio.Task[None]] = set()
        # Pipes of returned commands still open (a process they left holds them), oldest first: an ordered set.
        self._held: dict[PipeCapture, None] = {}
        self._output_rate = ByteRate(OUTPUT_BYTES_PER_S, OUTPUT_BURST_BYTES)  # what its commands' pipes give
        self._holding: _Holding | None = None  # a start begun by `hold`, waiting for `start`
        self._greeting: asyncio.Task[bytes] | None = None  # a start's wait for the agent's hello

    def set_limits(self, limits: Limits) -> None:
        """Change the limits, live if the sandbox runs (lowering memory below current use fails)."""
        if self._cgroups is None:
            raise Unavailable("resource limits need cgroups, and none are available")
        self._limits = limits
        if self._group is not None:
            self._group.set_limits(limits)

    @property
    def paused(self) -> bool:
        return self._paused

    def _require_group(self) -> SandboxCgroup:
        if self._asleep:
            raise Conflict("the sandbox is asleep (idle, nothing running): there is nothing to pause")
        if self._group is None or not self.alive:
            raise Conflict("the sandbox is not running or has no cgroup: run a command in it first")
        if self._starting:
            # Found by review: a freeze before the agent's hello (alive already) stopped the start, which gave up
            # 10 s later on a sandbox whose PID 1 stayed frozen, and whose pipe it then read on the event loop.
            raise Conflict("the sandbox is starting: try again once it runs")
        return self._group

    def pause(self) -> None:
        """Freeze every process of the sandbox (cgroup freezer): it uses no CPU until resumed. Thread-safe against
        the loop's end of the run (`_on_agent_gone`, which drops the group, then clears `_paused`).

        Raises:
            Conflict: asleep, not running, or its run ended while it was being frozen.
        """
        group = self._frozen(True)
        # Set, then check that the run is the one frozen: found by review, a run that ended during the freeze (in a
        # worker thread) had its `_paused` cleared before this set it, and the sandbox stayed "paused" for good.
        self._paused = True
        if self._group is not group:
            self._paused = False
            raise Conflict("the sandbox ended while it was being paused: nothing of it runs")

    def resume(self) -> None:
        self._frozen(False)
        self._paused = False
        self._resumed_at = time.monotonic()

    def _frozen(self, frozen: bool) -> SandboxCgroup:
        """Freeze or thaw the running sandbox's group; the group."""
        group = self._require_group()
        try:
            if frozen:
                group.freeze()
            else:
                group.thaw()
        except NotFound as exc:
            # Found by attack: a pause racing a sleep or a close answered with the host's path of the group's file.
            if self._group is not group:
                verb = "paused" if frozen else "resumed"
                raise Conflict(f"the sandbox ended while it was being {verb}: nothing of it runs") from None
            raise OperationFailed("the sandbox's cgroup freezer is not available", detail=exc.reason) from None
        return group

    def usage(self) -> Usage | None:
        """Live memory, pids and CPU of the whole sandbox; None before it has started."""
        if self._group is None or not self.alive:
            return None
        return self._group.usage()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._sock is not None

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise Unavailable("the sandbox was closed")
            if self.alive:
                return
            if self._proc is not None:
                self._on_agent_gone()
            self._starting = True
            try:
                await self._start()
            finally:
                self._starting = False

    def hold(self) -> None:
        """Begin the first start ahead of `start`: the cgroup made and bwrap's first step spawned in it, waiting
        (`_spawn.hold_sandbox`), while the caller makes what the spec names (the workspace, the device folder).
        `start` lets it go on; `close` ends it. Blocking: a cgroup's mkdir and a spawn, about a millisecond.

        Raises:
            Unavailable, OperationFailed: the cgroup or the process could not be made (nothing is left).
        """
        if self._closed or self._proc is not None or self._holding is not None:
            return  # started, held or closed already: `start` decides
        try:
            spec = self._make_group()
            proc, sock, go = hold_sandbox(spec)
        except BaseException:
            self._drop_group()
            raise
        self._holding = _Holding(spec, proc, sock, go)

    def _make_group(self) -> SandboxSpec:
        if self._cgroups is None or self._limits is None:
            return self.spec
        name = self._cgroups.new_name(_GROUP_PREFIX, next(_group_ids))
        self._group = self._cgroups.create(name, self._limits)
        procs = tuple(os.path.join(path, "cgroup.procs") for path in self._group.paths)
        # Before 5.16 the kernel would check the agent's moves against its own credentials: each
        # command then keeps a PID namespace of its own.
        return dataclasses.replace(self.spec, cgroup_procs=procs, command_groups=fd_migration_supported())

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        _reap(None, group, self.spec.workspace)

    def oom_kills(self) -> int:
        """How many processes of the sandbox the kernel has killed for memory so far."""
        return self._group.oom_kills() if self._group is not None else 0

    async def _start(self) -> None:
        self._asleep = False
        holding, self._holding = self._holding, None
        if holding is not None:
            spec, proc, sock = holding.spec, holding.proc, holding.sock
            release(holding.go)
        else:
            try:
                spec = self._make_group()
                proc, sock = start_sandbox(spec)
            except BaseException:
                self._drop_group()
                raise
        # Held at once, so close() can end a sandbox that is still starting.
        self._proc, self._sock = proc, sock
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            hello = await self._greeted(sock)
        except BaseException:
            # Cancelled before the hello: undone, or it would count as alive with nobody reading the agent
            # (every command then waiting out its time limit).
            self._on_agent_gone()
            raise
        if self._sock is not sock:
            # Ended meanwhile (a close): whoever ended it reaps its process. Found by attack: the wait went on for
            # START_TIMEOUT_S on the closed socket, then read the reaped process's closed pipe (INTERNAL_ERROR).
            raise Unavailable("the sandbox was stopped while it was starting")
        if not hello:
            reason = self._stderr_tail(proc)
            self._on_agent_gone()
            raise Unavailable("sandbox failed to start: " + (reason or "no reason given"))
        landlock = json.loads(hello).get("landlock", {})
        if landlock.get("warning"):
            logger.warning("sandbox for %s: %s", self.spec.workspace, landlock["warning"])
        if self._group is not None and spec.command_groups:
            self._agent_pid = _agent_of(proc)
            problem = self._give_home(sock, self._group)
            if problem is not None:
                # Its commands would share its PID namespace with no group of their own: a kill would reach a
                # command's first process only, and what it started would live on. Refused instead.
                self._on_agent_gone()
                logger.warning("sandbox for %s: no command groups: %s", self.spec.workspace, problem)
                raise Unavailable("sandbox failed to start: its command groups cannot be set up", detail=problem)
        loop.add_reader(sock.fileno(), self._on_message)
        self._reader_loop = loop

    async def _greeted(self, sock: socket.socket) -> bytes:
        """The agent's hello; b"" if none came within START_TIMEOUT_S, the socket failed, or the sandbox was ended
        meanwhile (`_on_agent_gone` cancels the wait)."""
        loop = asyncio.get_running_loop()
        greeting = self._greeting = loop.create_task(loop.sock_recv(sock, MAX_MESSAGE_BYTES))
        try:
            await asyncio.wait((greeting,), timeout=START_TIMEOUT_S)
        finally:
            self._greeting = None
            if not greeting.done():
                _stop_greeting(greeting, sock)
        if not greeting.done() or greeting.cancelled() or greeting.exception() is not None:
            return b""
        return greeting.result()

    def _give_home(self, sock: socket.socket, group: SandboxCgroup) -> str | None:
        """Hand the agent its way back from a command's group; from now on commands get groups. Returns
        why that failed, or None."""
        try:
            fd = os.open(group.home_procs(), os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"{group.home_procs()}: {exc.strerror}"
        try:
            socket.send_fds(sock, [marshal.dumps({"op": "home"})], [fd])
        except OSError as exc:
            return f"the agent did not take its way home: {exc.strerror}"
        finally:
            os.close(fd)
        self._commands = CommandGroups(group)
        return None

    @staticmethod
    def _stderr_tail(proc: SandboxProcess) -> str:
        """The last line bwrap wrote to stderr, of what is there now: never waited for on the event loop (found by
        review: a frozen PID 1 of the sandbox held the pipe open, and `communicate` blocked the server for good)."""
        proc.kill()
        if proc.stderr is None:
            return ""
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)
        chunks: list[bytes] = []
        with contextlib.suppress(BlockingIOError, OSError):
            while (chunk := os.read(fd, 65536)) and sum(map(len, chunks)) < _STDERR_TAIL_BYTES:
                chunks.append(chunk)
        lines = b"".join(chunks).decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def _on_message(self) -> None:
        assert self._sock is not None
        try:
            data, fds, cut = _receive(self._sock)
        except BlockingIOError:
            return
        except OSError:
            data, fds, cut = b"", [], False
        try:
            message = _agent_message(data) if data and not cut else None
            exited = _exit_of(message) if message is not None else None
            connected = _connected_of(message) if message is not None else None
        except ValueError:
            message = exited = connected = None
        if message is None:
            _close_all(fds)
            if data:
                # Not the agent's JSON (a deep nesting, fds it was not asked for): the agent is not what it was.
                logger.error("sandbox for %s: its agent sent a malformed message; ending it", self.spec.workspace)
            self._on_agent_gone()
            return
        if message.get("event") == "pty":
            self._on_pty(message, fds)
            return
        if connected is not None:
            self._answer_connect(connected, fds)
            return
        if message.get("event") == "netns":
            self._on_netns(fds)
            return
        if message.get("event") == "killed":
            self._on_killed(_int(message.get("id")))
        _close_all(fds)  # fds come only with the answer to a terminal or connect request
        if exited is None:
            return
        command_id, status = exited
        if self._commands is not None:
            self._release(self._commands, command_id)
        pty = self._ptys.pop(command_id, None)
        if pty is not None:
            pty.finish(status)
            return
        process = self._background.pop(command_id, None)
        if process is not None:
            process.finish(status)
            return
        waiter = self._waiters.pop(command_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(status)

    def _answer_connect(self, answer: tuple[int, str | None], fds: list[int]) -> None:
        """Hand a "connected" answer's socket to the connect waiting for it; close any other fd."""
        waiter = self._connects.pop(answer[0], None)
        if waiter is None or waiter.done():
            _close_all(fds)
            return
        error = answer[1]
        if error is not None or len(fds) != 1:
            _close_all(fds)
            waiter.set_exception(Unavailable(f"{_NOTHING_ACCEPTS} ({error})"))
            return
        try:
            waiter.set_result(_connected_socket(fds[0]))
        except Unavailable as exc:
            waiter.set_exception(exc)

    def _on_netns(self, fds: list[int]) -> None:
        """Keep the agent's network namespace if this run asked for it and it is one (not the server's)."""
        awaited, self._netns_awaited = self._netns_awaited, False
        if awaited and len(fds) == 1 and is_foreign_netns(fds[0]):
            self._netns = NetworkNamespace(fds.pop())
        _close_all(fds)

    def _drop_netns(self) -> None:
        if self._netns is not None:
            self._netns.close()
        self._netns = None

    async def connect(self, port: int) -> socket.socket:
        """A TCP socket connected to 127.0.0.1:`port` inside the sandbox (its network namespace); the
        caller owns it. The first of a run is made by the agent, which is also asked for its network
        namespace; later ones are made by the host in that namespace (`netns.py`), and by the agent
        again if the host cannot enter it. Does not start a sandbox that is asleep (nothing listens in it).

        Raises:
            InvalidRequest: `port` is not 1..65535.
            Unavailable: the sandbox is not running, nothing listens on the port, or no answer in time.
        """
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidRequest(f"port {port!r} is not a TCP port: give 1 to 65535")
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        sock = self._sock
        if sock is None or not self.alive:
            raise Unavailable("the sandbox is not running")
        if self._netns is not None:
            with contextlib.suppress(NamespaceUnusable):
                return await self._connect_in_netns(self._netns, port)
            self._drop_netns()  # e.g. a server without CAP_SYS_ADMIN: the agent connects from now on
        self._follow_loop(sock)
        request_id = next(self._command_ids)
        waiter: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()
        self._connects[request_id] = waiter
        try:
            if not self._netns_asked:
                self._netns_asked = self._netns_awaited = True
                await self._send_fds(sock, marshal.dumps({"op": "netns"}), [])
            await self._send_fds(sock, marshal.dumps({"op": "connect", "id": request_id, "port": port}), [])
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                return await asyncio.shield(waiter)
        except TimeoutError:  # before OSError, its base class
            raise Unavailable("the sandbox did not answer the connect in time") from None
        except OSError as exc:
            raise Unavailable(f"sandbox agent unreachable: {exc.strerror or exc}") from None
        finally:
            answered_late = self._connects.pop(request_id, None) is not None and waiter.done()
            if answered_late and not waiter.cancelled() and waiter.exception() is None:
                waiter.result().close()  # answered after we stopped waiting (cancelled): the socket is nobody's

    @staticmethod
    async def _connect_in_netns(netns: NetworkNamespace, port: int) -> socket.socket:
        try:
            return await netns.connect(port, CONNECT_TIMEOUT_S)
        except TimeoutError:  # before OSError, its base class
            raise Unavailable(f"{_NOTHING_ACCEPTS} (timed out)") from None
        except OSError as exc:
            raise Unavailable(f"{_NOTHING_ACCEPTS} ({exc.strerror or exc})") from None

    def _on_pty(self, message: Mapping[str, object], fds: list[int]) -> None:
        """The agent's answer to a terminal request: keep its master fd only if this sandbox asked for
        that command's terminal, is still waiting, and the fd is a pseudo-terminal master; else close it."""
        command_id = _int(message.get("id"))
        opening, argv = self._pty_openings.pop(command_id, (None, ()))
        fd = fds.pop() if len(fds) == 1 else -1
        _close_all(fds)
        error = message.get("error")
        if opening is None or opening.done() or error is not None or fd < 0 or not _is_pty_master(fd):
            if fd >= 0:
                os.close(fd)
            if opening is None:
                # Not this sandbox's request, or given up on and killed then: one that did not start has no
                # exit to come, and its group is released here (else it stayed taken until the close).
                if error is not None and self._commands is not None:
                    self._release(self._commands, command_id)
                return
            if error is None:
                self._all_gone_later(self._kill_tree(command_id))  # it may run: its terminal was refused
            elif self._commands is not None:
                self._release(self._commands, command_id)  # it did not start: no exit follows
            if not opening.done():
                raw = str(error or "the agent sent no terminal")[: 4 * MAX_AGENT_ERROR_CHARS]  # cut, then cleaned
                why = sanitize_terminal(raw)[:MAX_AGENT_ERROR_CHARS]
                opening.set_exception(Unavailable(f"the terminal's program did not start: {why}"))
            return
        os.set_blocking(fd, False)
        pty = PtyProcess(command_id, argv, fd)
        self._ptys[command_id] = pty  # before any await: its exit message may be next
        opening.set_result(pty)

    def _release(self, commands: CommandGroups, command_id: int) -> None:
        try:
            commands.exited(command_id)
        except BastionError as exc:  # its group is kept out of reuse; the close removes it
            logger.warning("sandbox for %s: command group not released: %s", self.spec.workspace, exc.reason)

    def _on_agent_gone(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            # Never let go: its shell reads the end of its stdin and exits before bwrap; reaped as a run.
            os.close(holding.go)
            self._proc, self._sock = holding.proc, holding.sock
        self._commands = None  # every command group goes with the sandbox's (`_reap`)
        if self._greeting is not None and self._sock is not None:
            _stop_greeting(self._greeting, self._sock)  # a start waiting for the hello: it ends at once
        if self._sock is not None:
            if self._reader_loop is not None:
                self._reader_loop.remove_reader(self._sock.fileno())  # a closed loop's: a no-op
            self._fail_sends(self._sock)
            self._sock.close()
            self._sock = None
        self._reader_loop = None
        for deadline in self._kill_deadlines.values():
            deadline.cancel()  # its command ended with the sandbox
        self._kill_deadlines.clear()
        self._agent_pid = None
        ended = self._ending()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(ended())
        self._waiters.clear()
        for connect in self._connects.values():
            if not connect.done():
                connect.set_exception(Unavailable("the sandbox ended"))
        self._connects.clear()
        self._drop_netns()
        self._netns_asked = self._netns_awaited = False  # the next run has a namespace of its own
        for opening, _ in self._pty_openings.values():
            if not opening.done():
                opening.set_exception(ended())
        self._pty_openings.clear()
        while self._ptys:
            # Its program dies with the sandbox; the reader of its master sees the end of its output.
            self._ptys.popitem()[1].finish(None)
        while self._background:
            # Its processes die with the sandbox; their pipes are closed here, their output stays readable.
            self._background.popitem()[1].close()
        while self._held:
            self._held.popitem()[0].close()  # so are what returned commands left running
        self._reap_soon(self._proc, self._group)
        self._proc = None
        self._group = None
        self._paused = False

    def _reap_soon(self, proc: SandboxProcess | None, group: SandboxCgroup | None) -> None:
        """End bwrap and remove the cgroup, in a worker thread when the event loop runs: the waits
        (bwrap's exit, the group emptying, a tmpfs of many files freed) take up to seconds, and no
        other sandbox's call may wait for them. Without a loop (server shutdown) it waits here."""
        if proc is None and group is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            _reap(proc, group, self.spec.workspace)
            return
        self._reaping = [*(r for r in self._reaping if not r.done.done()), _Reaping(proc, group, self.spec.workspace)]

    async def settled(self) -> None:
        """Wait, without blocking the event loop or holding a worker thread, until the processes and cgroups of
        earlier runs are gone. Found by attack: a wait in asyncio's default executor (6 threads on 2 cores, shared
        by the whole server) queued behind one agent's image redactions, for seconds."""
        while self._reaping:
            reaping = self._reaping[-1]
            await asyncio.wrap_future(reaping.done)
            with contextlib.suppress(ValueError):  # a concurrent `settled` took it out first
                self._reaping.remove(reaping)

    def _ending(self) -> Callable[[], BastionError]:
        """The error for commands cut off by the agent's end: an OOM kill names what held the memory."""
        note = self.memory_note() if self._oom_killed_any() else ""
        if not note:
            return lambda: Unavailable("the sandbox ended while a command was running")
        kept = "/workspace, /tmp and /dev/shm keep" if self.spec.devices is not None else "/workspace keeps"
        reason = (
            f"the sandbox ran out of memory and the kernel ended it ({note}): its processes are gone, "
            f"{kept} their files, and the next command starts it again"
        )
        return lambda: ResourceLimit(reason)

    def _oom_killed_any(self) -> bool:
        try:
            return self.oom_kills() > 0
        except (OSError, BastionError):
            return False

    def memory_note(self) -> str:
        """How much of the sandbox's memory files in /tmp and /dev/shm hold, for an OOM kill's message."""
        if self._group is None:
            return ""
        try:
            shmem = self._group.shmem_bytes()
        except (OSError, BastionError):
            return "memory limit reached"
        limit = self._limits.memory_bytes if self._limits is not None else None
        of = f" of its {_mib(limit)} limit" if limit else ""
        return f"files in /tmp and /dev/shm and shared memory held {_mib(shmem)}{of}"

    @property
    def asleep(self) -> bool:
        return self._asleep and not self.alive

    def sleep(self) -> bool:
        """Stop an idle sandbox that holds nothing but files: no command or background process
        running, and /tmp and /dev/shm empty unless they are the server's tmpfs (bwrap's own
        would be lost). Its processes, cgroup and memory go; the next command starts it again
        (tens of ms). Returns whether it went to sleep."""
        if not self.alive or self._paused or self._waiters or self._background or self._ptys or self._left_running():
            return False
        if self._starting:
            # Found by attack: a start waits for the agent's hello with the sandbox already alive, and a sleep then
            # ended it under the start (the command waited 10 s, then answered INTERNAL_ERROR).
            return False
        if self.spec.devices is None and not _scratch_is_empty(self._proc):
            return False
        self._on_agent_gone()  # its processes and cgroup are reaped in a worker thread
        self._asleep = True
        return True

    def _left_running(self) -> bool:
        """Whether a command left processes running (they would die with a sleep)."""
        try:
            return self._commands is not None and bool(self._commands.left_pids())
        except BastionError:
            return True

    def _kill_tree(self, command_id: int) -> CommandCgroup | None:
        """Kill a command and everything it started: its cgroup (returned, to wait until it is
        empty), or else its PID namespace's PID 1.

        The agent SIGKILLs the command and answers ("killed"). The agent starts a command from inside
        the command's group and then moves back, so a group killed right after a start could end the
        agent with it, and the whole sandbox: the group is killed at once only when the agent is out of
        it for good (`_agent_left`), else on the agent's answer (it handles messages in order, so it
        answers from outside every group). No answer within KILL_GRACE_S, the sandbox not paused: the
        sandbox is ended, and every process in it."""
        commands, sock = self._commands, self._sock
        group = commands.doom(command_id) if commands is not None else None
        if commands is not None and group is not None and self._agent_left(group):
            self._kill_doomed(commands, command_id)
        if sock is None:
            return group
        self._send_kill(sock, command_id)
        if command_id not in self._kill_deadlines:
            self._arm_kill_deadline(command_id)
        return group

    def _agent_left(self, group: CommandCgroup) -> bool:
        """Whether the agent is out of a command's group for good: the group holds a process and not the
        agent, so the command has started (the agent enters a group only to start its command) and the
        agent has gone home since."""
        try:
            pids = group.pids()
        except (OSError, BastionError):
            return False
        return self._agent_pid is not None and bool(pids) and self._agent_pid not in pids

    def _send_kill(self, sock: socket.socket, command_id: int) -> None:
        """Send the agent a kill now, or as soon as its socket has room (if this event loop ends first, the
        next loop that drives the sandbox sends it again: `_follow_loop`). A send that fails otherwise leaves
        the kill unanswered, and its deadline ends the sandbox."""
        data = marshal.dumps({"op": "kill", "id": command_id})
        try:
            sock.send(data)
        except BlockingIOError:
            self._track(self._send_later(sock, data))
        except OSError:
            pass

    async def _send_later(self, sock: socket.socket, data: bytes) -> None:
        with contextlib.suppress(OSError):
            await self._send_fds(sock, data, [])

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task of the loop running now, kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._reaping_tasks.add(task)
        task.add_done_callback(self._reaping_tasks.discard)

    def _arm_kill_deadline(self, command_id: int) -> None:
        loop = asyncio.get_running_loop()
        self._kill_deadlines[command_id] = loop.call_later(KILL_GRACE_S, self._kill_unanswered, command_id)

    def _kill_unanswered(self, command_id: int) -> None:
        """A kill's deadline: unless answered meanwhile, end the sandbox. A paused sandbox's agent (frozen)
        answers once resumed: its deadline starts again, and again after a resume."""
        self._read_waiting()  # an answer may be in the socket, not read yet (the loop was behind)
        if self._kill_deadlines.pop(command_id, None) is None:
            return
        if self._paused or time.monotonic() - self._resumed_at < KILL_GRACE_S:
            self._arm_kill_deadline(command_id)
            return
        logger.warning(
            "sandbox for %s: the agent did not answer a kill within %s s: the sandbox is ended instead",
            self.spec.workspace,
            KILL_GRACE_S,
        )
        self._on_agent_gone()  # now, not a loop pass later (a restart meanwhile would be the one ended)

    def _read_waiting(self, most: int = 256) -> None:
        """Handle the agent's messages already in its socket, up to `most`."""
        for _ in range(most):
            sock = self._sock
            if sock is None or not readable(sock.fileno()):
                return
            self._on_message()

    def _on_killed(self, command_id: int) -> None:
        """The agent's answer to a kill: it has signalled the command and is out of every group."""
        deadline = self._kill_deadlines.pop(command_id, None)
        if deadline is not None:
            deadline.cancel()
        if self._commands is not None:  # it kills only a group marked by a kill of this sandbox's
            self._kill_doomed(self._commands, command_id)

    def _kill_doomed(self, commands: CommandGroups, command_id: int) -> None:
        try:
            commands.kill_doomed(command_id)
        except BastionError as exc:
            # The agent's SIGKILL still ends the command; what it started may live on, so say so.
            logger.error("sandbox for %s: command group not killed: %s", self.spec.workspace, exc.reason)

    @staticmethod
    async def _all_gone(group: CommandCgroup | None) -> None:
        """Wait, without blocking the event loop, until a killed command's every process has exited."""
        if group is not None and not await _emptied(group, KILL_GRACE_S):
            logger.error("command group %s still has processes %s s after SIGKILL", group.path, KILL_GRACE_S)

    def leftovers(self) -> list[Leftover]:
        """The processes commands left running (not those of running commands, nor background ones)."""
        return self._commands.leftovers() if self._commands is not None and self.alive else []

    async def kill_leftover(self, pid: int) -> None:
        """SIGKILL one process a command left running, named by its pid in the sandbox; wait for its end.

        Raises:
            NotFound: no such process of this sandbox (a pid elsewhere, of the host or another sandbox).
        """
        if self._commands is None or not self.alive:
            raise NotFound(f"no process {pid} left running by a command in this sandbox: it is not running")
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        fd = self._commands.open_leftover(pid)
        try:
            kill_pidfd(fd)
            await exited(fd, KILL_GRACE_S)
        finally:
            os.close(fd)

    async def run(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        timeout_s: float,
        max_output_bytes: int,
        on_output: tuple[OutputSink, OutputSink] | None = None,
    ) -> RunOutcome:
        """Run one command to completion; on timeout or cancellation its whole tree is killed."""
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        await self.start()
        ooms_before = self.oom_kills()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[int] = loop.create_future()
        (out_r, out_w), (err_r, err_w) = _pipes(2)
        request = {"exe": executable, "argv": list(argv), "cwd": cwd, "env": dict(env)}
        try:
            command_id = await self._hand_off(request, [out_w, err_w], waiter)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        sinks = on_output or (None, None)
        out = PipeCapture(out_r, max_output_bytes, sinks[0], self._output_rate)
        err = PipeCapture(err_r, max_output_bytes, sinks[1], self._output_rate)
        timed_out = cancelled = False
        status: int | None = None
        try:
            async with asyncio.timeout(timeout_s):
                status = await asyncio.shield(waiter)
            await self._output_after_exit(out, err)
        except TimeoutError:
            # Found by attack: after a stall of the server (a loaded host, a paused VM) the deadline had passed
            # with the command's exit already in the agent's socket, and the timeout came first: a command that
            # exited 0 in 1 s of its 5 was answered TIMEOUT, "killed". An exit waiting there counts.
            self._read_waiting()
            if waiter.done() and not waiter.cancelled():
                status = waiter.result()
                await self._output_after_exit(out, err)
            else:
                timed_out = True
        except asyncio.CancelledError:
            cancelled = True
            self._kill_tree(command_id)
            self._waiters.pop(command_id, None)
            waiter.cancel()
            out.close()
            err.close()
            raise
        finally:
            if timed_out:
                killed = self._kill_tree(command_id)
                status = await self._await_exit(command_id, waiter)
                await self._all_gone(killed)
                out.close()
                err.close()
        kept = (bytes(out.data), bytes(err.data), out.total, err.total)
        self._hold(out, err)  # first: the OOM check below may fail (EMFILE), and the pipes must not go uncounted
        oom_killed = self._group is not None and self.oom_kills() > ooms_before
        note = self.memory_note() if oom_killed else ""
        return RunOutcome(status, *kept, timed_out, cancelled, oom_killed, note)

    def _hold(self, *captures: PipeCapture) -> None:
        """Keep reading and dropping a returned command's pipes that are still open, at most MAX_HELD_PIPES of
        the sandbox's: past that its oldest held pipe is closed, and whatever still writes to that pipe gets
        EPIPE (or dies of SIGPIPE) at its next write, as a command's output does on any machine once nobody
        reads it. Found by attack: each command passed its stdout and stderr to one process (SCM_RIGHTS) and
        exited, and the server held 2 pipes per run_command until the sandbox closed, past its fd limit.
        Background processes' pipes are not counted here: their table (workbench/background.py) bounds them."""
        for capture in captures:
            capture.drop_rest()
        self._held = {capture: None for capture in (*self._held, *captures) if not capture.closed}
        while len(self._held) > MAX_HELD_PIPES:
            oldest = next(iter(self._held))
            del self._held[oldest]
            oldest.close()

    @staticmethod
    async def _output_after_exit(out: PipeCapture, err: PipeCapture) -> None:
        """Wait for the end of both streams. A process the command left running (`server &`) may hold
        them open: then what came within OUTPUT_GRACE_S of the exit is the output, and the rest is read
        and dropped until they close (`_hold`: closing them now would kill it with SIGPIPE at its next write)."""
        pending = [capture.done for capture in (out, err) if not capture.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=OUTPUT_GRACE_S)

    async def _hand_off(
        self,
        request: Mapping[str, object],
        fds: list[int],
        waiter: asyncio.Future[int] | None,
        opening: asyncio.Future[PtyProcess] | None = None,
    ) -> int:
        """Ask the agent to start a command with these fds; return the command's id.

        The agent reports the command's exit (or its failure to start) under that id. With `opening`,
        the command goes on a terminal the agent opens (op "pty"), and its answer settles `opening`.
        """
        sock = self._sock
        if sock is None or not self.alive:
            raise Unavailable("the sandbox is not running")
        if self._paused:
            # Found by review: a pause that came while the call awaited the sandbox's start queued the command,
            # which then ran at the resume with its time limit spent; from here to the send nothing awaits.
            raise Conflict("the sandbox is paused: resume it first")
        self._follow_loop(sock)
        command_id = next(self._command_ids)
        commands = self._commands
        group_fd = -1
        if commands is not None:
            try:
                group_fd = commands.take(command_id).open_procs()
            except BastionError:
                commands.forget(command_id)
                raise
            request = {**request, "cgroup": True}
        data = marshal.dumps({**request, "op": "run" if opening is None else "pty", "id": command_id})
        if waiter is not None:
            self._waiters[command_id] = waiter
        if opening is not None:
            argv = request.get("argv")
            self._pty_openings[command_id] = (opening, tuple(argv) if isinstance(argv, list) else ())
        try:
            await self._send_fds(sock, data, fds if group_fd < 0 else [*fds, group_fd])
        except BaseException as exc:
            self._waiters.pop(command_id, None)  # never sent (or cancelled while waiting to send)
            self._pty_openings.pop(command_id, None)
            if commands is not None:
                commands.forget(command_id)
            if isinstance(exc, OSError):
                raise Unavailable(f"sandbox agent unreachable: {exc.strerror or exc}") from None
            raise
        finally:
            if group_fd >= 0:
                os.close(group_fd)
        return command_id

    def _follow_loop(self, sock: socket.socket) -> None:
        """Read the agent on the event loop running now. A program embedding bastion may drive a
        sandbox from two loops one after the other (`asyncio.run` twice): the reader left on the
        first would never run, and a command's exit would be seen only at its time limit."""
        loop = asyncio.get_running_loop()
        if self._reader_loop is None or self._reader_loop is loop:
            return  # None: a start is under way, reading the agent's hello itself; it adds the reader after
        self._reader_loop.remove_reader(sock.fileno())
        loop.add_reader(sock.fileno(), self._on_message)
        self._reader_loop = loop
        # Kills still unanswered: their deadlines (and a send waiting for room) were the old loop's, which
        # may have ended with them. Sent again (the agent answers each) and timed on this loop.
        for command_id in list(self._kill_deadlines):
            self._kill_deadlines.pop(command_id).cancel()
            self._send_kill(sock, command_id)
            self._arm_kill_deadline(command_id)

    async def _send_fds(self, sock: socket.socket, data: bytes, fds: list[int]) -> None:
        """send_fds on the non-blocking socket, waiting while its buffer is full.

        Raises:
            OSError: the agent went away meanwhile (ConnectionResetError when it did during a wait).
        """
        loop = asyncio.get_running_loop()
        while True:
            try:
                socket.send_fds(sock, [data], fds)
                return
            except BlockingIOError:
                await self._room(sock, loop)

    async def _room(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the agent's socket may have room. One writer callback per loop wakes every send waiting
        on it: a second add_writer would replace the first's, and that send would wait for ever. Sends left
        by a loop that has closed (a program embedding bastion ran one and ended it) are forgotten."""
        self._writables = {w for w in self._writables if not w.get_loop().is_closed()}
        writable: asyncio.Future[None] = loop.create_future()
        if not any(w.get_loop() is loop for w in self._writables):
            loop.add_writer(sock.fileno(), self._wake_sends)
        self._writables.add(writable)
        try:
            await writable
        finally:
            self._writables.discard(writable)
            # Closed meanwhile: `_fail_sends` unregistered it first.
            if sock.fileno() != -1 and not any(w.get_loop() is loop for w in self._writables):
                loop.remove_writer(sock.fileno())

    def _wake_sends(self) -> None:
        """The agent's socket has room: every send waiting on this loop tries again (those that find none
        wait again)."""
        loop = asyncio.get_running_loop()
        for writable in self._writables:
            if writable.get_loop() is loop and not writable.done():
                writable.set_result(None)

    def _fail_sends(self, sock: socket.socket) -> None:
        """The agent is gone: the sends waiting for room in its socket fail now. Before the socket closes:
        its number must leave the selector while it is still this socket's (a later socket may reuse it)."""
        for writable in self._writables:
            loop = writable.get_loop()
            if loop.is_closed():
                continue  # its task is gone with its loop
            loop.remove_writer(sock.fileno())
            if not writable.done():
                writable.set_exception(ConnectionResetError(errno.ECONNRESET, "the sandbox agent went away"))
        self._writables.clear()

    async def _await_exit(self, command_id: int, waiter: asyncio.Future[int]) -> int | None:
        """The exit status of a command just killed; None if the agent does not report it."""
        if not self._paused:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILL_GRACE_S):
                    return await asyncio.shield(waiter)
        self._waiters.pop(command_id, None)
        waiter.cancel()
        if self._paused:
            # A frozen agent reports nothing until resumed: the answer goes without the exit status, and the
            # sandbox lives on (the kill's own deadline waits for the resume too).
            return None
        # The agent did not confirm the kill: end the whole sandbox, which ends every process in it.
        await self.aclose()
        return None

    async def spawn(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        ring_bytes: int,
        stdout: Callable[[int], RingCapture] | None = None,
    ) -> BackgroundProcess:
        """Start a command in the background and return at once.

        It runs like any command (in its own cgroup, or PID namespace without cgroups), with
        no time limit: it ends when it exits, when `kill` ends it, or when the sandbox closes. Its stdin is
        a pipe from the host; its stdout and stderr are read into rings of `ring_bytes` each,
        or its stdout by `stdout(fd)` when given (a reader of a protocol, such as a code context's).
        """
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        await self.start()
        (out_r, out_w), (err_r, err_w), (in_r, in_w) = _pipes(3)
        request = {"exe": executable, "argv": list(argv), "cwd": cwd, "env": dict(env)}
        try:
            command_id = await self._hand_off(request, [out_w, err_w, in_r], None)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                os.close(fd)
        # No await since the send: its exit message cannot have been handled yet.
        # Read at the sandbox's output rate, as its commands' pipes are (a code context's kernel: its own pacing).
        out = stdout(out_r) if stdout is not None else RingCapture(out_r, ring_bytes, self._output_rate)
        process = BackgroundProcess(command_id, argv, in_w, out, RingCapture(err_r, ring_bytes, self._output_rate))
        self._background[command_id] = process
        return process

    async def open_pty(
        self, executable: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str], rows: int, cols: int
    ) -> PtyProcess:
        """Start a command on a new pseudo-terminal of `rows` x `cols`, opened inside the sandbox.

        It runs like a background command (its own cgroup, no time limit), in a session of its
        own whose controlling tty is the terminal. The host gets the master end only
        (`PtyProcess.fd`); `kill` ends the command and everything it started.

        Raises:
            Unavailable: the sandbox ended, or the program did not start (the agent's reason).
        """
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        await self.start()
        opening: asyncio.Future[PtyProcess] = asyncio.get_running_loop().create_future()
        request = {"exe": executable, "argv": list(argv), "cwd": cwd, "env": dict(env), "rows": rows, "cols": cols}
        command_id = await self._hand_off(request, [], None, opening)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                return await asyncio.shield(opening)
        except BaseException as exc:
            self._pty_openings.pop(command_id, None)
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                pty = opening.result()
                os.close(pty.fd)
                await self.kill(pty)
            elif not opening.done():
                opening.cancel()
                self._all_gone_later(self._kill_tree(command_id))
            if isinstance(exc, TimeoutError):
                raise Unavailable("the sandbox did not open the terminal in time") from None
            raise

    def _all_gone_later(self, killed: CommandCgroup | None) -> None:
        if killed is not None:
            self._track(self._all_gone(killed))

    async def kill(self, process: Process | PtyProcess) -> bool:
        """SIGKILL a background process and everything it started (its cgroup, or its PID namespace), its
        first process exited or not; return whether anything of it was running."""
        if process.exited:
            return await self._kill_left(process.command_id)
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        if self._sock is not None:
            self._follow_loop(self._sock)  # the exit it waits for comes from the agent
        killed = self._kill_tree(process.command_id)
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                await process.wait_exit()
                await self._all_gone(killed)
        except TimeoutError:
            # The agent did not confirm the kill: end the whole sandbox, which ends every process in it.
            waited = "its processes to be gone" if process.exited else "the agent to report its exit"
            logger.warning(
                "sandbox for %s: a killed command was still not over after %s s (waiting for %s): the sandbox is "
                "ended instead",
                self.spec.workspace,
                KILL_GRACE_S,
                waited,
            )
            await self.aclose()
        return True

    async def _kill_left(self, command_id: int) -> bool:
        """SIGKILL what an exited command left running (its group: `x &`, setsid, a daemon) and wait until
        it is gone; whether it left anything. Found by attack: such a child went on writing to a background
        process's pipes, and a kill of the process, whose first process had exited, killed nothing. Without
        command groups nothing is left: each command's PID namespace ends with its first process."""
        commands = self._commands
        if commands is None or not self.alive or not commands.left_by(command_id):
            return False
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        killed = commands.kill_left(command_id)
        await self._all_gone(killed)
        return killed is not None

    def close(self) -> None:
        """Kill the sandbox: its PID namespace dies, and with it every process inside. Blocks until
        they and the cgroup are gone: for shutdown and error paths; the server's calls use `aclose`."""
        self._on_agent_gone()
        while self._reaping:
            self._reaping.pop().done.result()

    async def aclose(self, *, final: bool = False) -> None:
        """`close` without blocking the event loop (the waits run in a thread of their own: `settled`).
        `final`: the sandbox is closed for good; a call still in flight cannot start it again."""
        self._closed = self._closed or final
        self._on_agent_gone()
        await self.settled()


@dataclasses.dataclass(frozen=True)
class _Holding:
    """A start begun by `WarmSandbox.hold`: its spec (with its cgroup), the waiting process, the host's socket
    end, and the fd that lets it go on (`_spawn.release`)."""

    spec: SandboxSpec
    proc: SandboxProcess
    sock: socket.socket
    go: int


class BubblewrapBackend:
    """The bubblewrap backend: sandboxes share the host's kernel, in namespaces of their own."""

    name = "bubblewrap"

    def __init__(self, cgroups: CgroupLayout | None) -> None:
        self._cgroups = cgroups

    def sandbox(self, spec: SandboxSpec, *, limits: Limits | None) -> WarmSandbox:
        return WarmSandbox(spec, cgroups=self._cgroups, limits=limits)


def _conforms(backend: BubblewrapBackend, sandbox: WarmSandbox) -> tuple[Backend, Sandbox]:
    """Never called: mypy checks here that bubblewrap implements the backend protocol."""
    return backend, sandbox


def _receive(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """One message of the agent, the fds that came with it (close-on-exec), and whether some were cut
    (MSG_CTRUNC: the kernel closed those that found no room). Room is kept for one fd, a terminal's master."""
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % 4
            fds += [int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True) for i in range(0, whole, 4)]
    return data, fds, bool(flags & socket.MSG_CTRUNC)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _pipes(count: int) -> list[tuple[int, int]]:
    """`count` close-on-exec pipes (read end, write end), or none: a failure closes those made already.

    Raises:
        Unavailable: a pipe could not be made (EMFILE, ENFILE: the server or the machine is out of fds).
    """
    made: list[tuple[int, int]] = []
    try:
        while len(made) < count:
            made.append(os.pipe2(os.O_CLOEXEC))
    except OSError as exc:
        _close_all([fd for pair in made for fd in pair])
        raise Unavailable(f"cannot make the command's pipes: {exc.strerror}: try again later") from None
    return made


def _is_pty_master(fd: int) -> bool:
    """Whether `fd` is a pseudo-terminal master (it stats as /dev/ptmx), not a file, socket or slave."""
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISCHR(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) == PTMX_DEVICE


def _agent_of(proc: SandboxProcess) -> int | None:
    """The agent's pid on the host: bwrap's one child (`--as-pid-1`), checked to be PID 1 of its namespace;
    None if that cannot be told (then a killed command's group waits for the agent's answer)."""
    children = _children(proc.pid)
    if len(children) != 1:
        return None
    try:
        with open(f"/proc/{children[0]}/status", encoding="ascii", errors="replace") as status:
            nspid = next((line.split()[1:] for line in status if line.startswith("NSpid:")), [])
    except OSError:
        return None
    return children[0] if nspid[-1:] == ["1"] else None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _agent_message(data: bytes) -> dict[str, object]:
    """A message of the agent: a JSON object.

    Raises:
        ValueError: `data` is not a message of the agent's.
    """
    try:
        msg = json.loads(data)
    except (RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    return msg


def _exit_of(msg: Mapping[str, object]) -> tuple[int, int] | None:
    """(command id, status) of an exit message; None for another event.

    Raises:
        ValueError: an exit message without a status.
    """
    if msg.get("event") != "exit":
        return None
    status = msg.get("status")
    if not isinstance(status, int):
        raise ValueError("an exit without a status")
    return _int(msg.get("id", 0)), status


def _connected_of(msg: Mapping[str, object]) -> tuple[int, str | None] | None:
    """(request id, error or None) of a "connected" answer of the agent's; None for another event.

    Raises:
        ValueError: a malformed connected event.
    """
    if msg.get("event") != "connected":
        return None
    request_id, error = msg.get("id"), msg.get("error")
    if type(request_id) is not int or not (error is None or isinstance(error, str)):
        raise ValueError("a malformed connected event")
    return request_id, None if error is None else error[:200]


def _connected_socket(fd: int) -> socket.socket:
    """The fd the agent sent, if it is a connected TCP socket over IPv4 (else Unavailable; the fd is closed)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise Unavailable("the sandbox's agent sent something other than a connected TCP socket") from None
    try:
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
            raise OSError("not a TCP socket")
        sock.getpeername()  # ENOTCONN if it is not connected
    except OSError:
        sock.close()
        raise Unavailable("the sandbox's agent sent something other than a connected TCP socket") from None
    sock.setblocking(False)
    return sock


def _stop_greeting(greeting: asyncio.Task[bytes], sock: socket.socket) -> None:
    """Cancel a start's wait for the hello, its reader removed first: a cancelled `sock_recv` removes it a loop
    turn later, and a socket that took the fd meanwhile (this one closed) had its reader replaced, never called
    (found by review)."""
    with contextlib.suppress(OSError, ValueError):  # a closed socket's fileno is -1
        greeting.get_loop().remove_reader(sock.fileno())
    greeting.cancel()


def _reap(proc: SandboxProcess | None, group: SandboxCgroup | None, workspace: str) -> None:
    """Kill and wait for bwrap (its PID namespace dies with it), then remove the cgroup. Blocking."""
    if proc is not None:
        # bwrap's child is PID 1 of the sandbox's namespace: the kernel reports its exit only once
        # every process of the namespace is gone, which bwrap's own exit does not wait for.
        inits = _pidfds(_children(proc.pid))
        proc.kill()
        proc.wait()
        for fd in inits:
            # --die-with-parent holds only once bwrap's child has set it: a bwrap killed while it was still
            # setting up (a start cancelled before the agent's hello) would leave its child waiting for ever.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        _wait_exited(inits, KILL_GRACE_S)
        if proc.stderr is not None:
            proc.stderr.close()
    destroy_left_groups()
    if group is not None:
        destroy_or_retry(group, workspace)


def destroy_or_retry(group: SandboxCgroup, owner: str) -> None:
    """Remove a closed sandbox's group (`owner` names it in the log), or keep it for `destroy_left_groups`."""
    try:
        group.destroy()
    except BastionError as exc:
        logger.error("cgroup %s of %s not removed (tried again later): %s", group.name, owner, exc.reason)
        with _undestroyed_lock:
            _undestroyed.append(group)


def destroy_left_groups() -> None:
    """Try again to remove the cgroups of closed sandboxes whose removal failed; blocking. Found by attack:
    a sandbox closed while the server was out of fds (EMFILE writing cgroup.kill) left its groups for ever."""
    with _undestroyed_lock:
        groups = _undestroyed[:]
        _undestroyed.clear()
    for group in groups:
        try:
            group.destroy()
        except BastionError:
            with _undestroyed_lock:
                _undestroyed.append(group)
        else:
            logger.info("cgroup %s removed after all", group.name)
