"""The isolation backend: what the workbench needs from whatever runs an agent's commands.

A `Backend` makes `Sandbox` handles from a `SandboxSpec`; a `Sandbox` runs commands to
completion (`run`) or in the background (`spawn`, a `Process` handle), and can be paused,
resumed, measured, limited, put to sleep and closed. The bubblewrap sandbox
(`bastion.sandbox.warm`) is the first backend; a microVM is meant to be the next (issue 17).

Nothing here assumes that a command is a local process: a command is named by the id
the backend gave it (`Process.command_id`, never a pid), its output reaches the host as
bytes in rings (`OutputRing`), its input is written through `Process.write`, and no file
descriptor crosses into the sandbox. The one host-side descriptor is `spawn(stdout=...)`:
the read end of a stream on the server's own host that the backend feeds with the
command's stdout (bubblewrap hands the command the write end; a VM backend would copy
its channel into a pipe).

Files and snapshots do not go through the backend. The workspace is a folder on the
host (`SandboxSpec.workspace`) that the sandbox sees at /workspace: the file tools act on
it through a host-side jail (`bastion.safety.jail`), and a snapshot archives it while the
sandbox is paused. A backend whose /workspace is not such a folder (a VM's disk image, a
sandbox on another machine) must therefore either keep one in sync at every pause and
after every command, or the protocol gains file and archive methods (read, write, list,
stat, archive, restore) that the jail's rules are then enforced behind.

Errors are `bastion.safety.errors` types: `Unavailable` (the sandbox cannot start, was
closed for good, or ended under a command), `Conflict` (the request does not fit the
sandbox's state: paused, asleep, not running), `ResourceLimit` (the sandbox's memory ran
out and ended a command). A command's own failure is never an error: it is its status.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from bastion.sandbox._spawn import SandboxSpec
from bastion.sandbox.cgroups import Limits, Usage
from bastion.sandbox.command_groups import Leftover
from bastion.sandbox.processes import OutputSink, PtyProcess, RingCapture


@dataclass(frozen=True)
class RunOutcome:
    """What one command did. `status` is the exit code, or 128 + signal."""

    status: int | None
    stdout: bytes
    stderr: bytes
    stdout_total: int
    stderr_total: int
    timed_out: bool
    cancelled: bool = False
    oom_killed: bool = False
    memory_note: str = ""

    @property
    def truncated(self) -> bool:
        return self.stdout_total > len(self.stdout) or self.stderr_total > len(self.stderr)


class OutputRing(Protocol):
    """One output stream of a background command, as the host keeps it: its newest bytes.

    Offsets count every byte the stream ever gave: `start` is the oldest kept, `total`
    the one just past the newest. `closed`: the stream ended (or was cut off by `close`).
    """

    @property
    def start(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def read(self, offset: int, limit: int) -> tuple[int, bytes]:
        """At most `limit` bytes from `offset` (or from `start`, if later), and where they begin."""
        ...

    def limit(self, cap: int) -> None:
        """Keep at most the newest `cap` bytes from now on; the oldest beyond them go at once."""
        ...


class Process(Protocol):
    """A command running in the background of a sandbox, as the host sees it."""

    @property
    def command_id(self) -> int:
        """The backend's name for the command, unique in its sandbox (not a pid)."""
        ...

    @property
    def argv(self) -> tuple[str, ...]: ...

    @property
    def started(self) -> float:
        """`time.monotonic()` when it was started."""
        ...

    @property
    def status(self) -> int | None:
        """Exit code or 128 + signal once it exited; None while it runs, or if the sandbox ended first."""
        ...

    @property
    def exited(self) -> bool: ...

    @property
    def stdin_open(self) -> bool: ...

    @property
    def stdout(self) -> OutputRing: ...

    @property
    def stderr(self) -> OutputRing: ...

    async def wait_exit(self) -> None:
        """Return once the command has exited (or its sandbox ended)."""
        ...

    async def wait_output(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, until both output streams have ended."""
        ...

    async def write(self, data: bytes, *, timeout_s: float) -> int:
        """Write `data` to its stdin; return how many bytes went in before `timeout_s`.

        Raises:
            Conflict: its input is closed (by `close_stdin`, its exit, or the command itself).
        """
        ...

    def close_stdin(self) -> None:
        """Close its stdin: the command reads EOF. Idempotent."""
        ...

    def close(self) -> None:
        """Let go of it: it counts as exited (status None if it had not), its input closes and
        its output is no longer read; what was read stays readable. It does not kill it (`Sandbox.kill`)."""
        ...


class Sandbox(Protocol):
    """One sandbox: a private machine for one workspace, kept warm between commands.

    Commands run concurrently and each is isolated from the others' processes. It starts
    on `start` or on the first command, and starts again after `close` or `sleep`
    (its workspace files stay), until `aclose(final=True)`.
    """

    @property
    def paused(self) -> bool: ...

    @property
    def asleep(self) -> bool:
        """Stopped by `sleep` and not started since."""
        ...

    async def start(self) -> None:
        """Start it if it is not running (a no-op if it is).

        Raises:
            Unavailable: it cannot start (the reason in one line), or it was closed for good.
        """
        ...

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
        """Run one command to completion with exactly `env`, starting the sandbox if needed.

        Each stream keeps its first `max_output_bytes` and counts the rest; `on_output` (stdout's
        sink, stderr's) sees every chunk as it is read. After
        `timeout_s` the command and everything it started are killed and the outcome
        says `timed_out` (a timeout is an outcome, not an error); a cancelled call kills
        them too. A program or cwd that does not exist is the command's failure: status
        127 and one line on its stderr. What a command that exits leaves running (`x &`,
        nohup, setsid, a daemon) lives on until it exits, `kill_leftover` ends it, or the
        sandbox closes (`leftovers` lists it), as on a machine; a backend that cannot keep
        them apart from the command (bubblewrap without cgroups) ends them with it instead.

        Raises:
            Conflict: the sandbox is paused.
            Unavailable: it cannot start, was closed for good, or ended while the command ran.
            ResourceLimit: its memory ran out and the whole sandbox ended under the command.
        """
        ...

    async def spawn(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        ring_bytes: int,
        stdout: Callable[[int], RingCapture] | None = None,
    ) -> Process:
        """Start a command in the background and return at once; it has no time limit.

        It ends when it exits, when `kill` ends it, or when the sandbox closes (then
        `exited` with status None; what was read stays readable). Its stdout and stderr
        are kept in rings of `ring_bytes` each; `stdout`, when given, makes the stdout
        reader instead from a host-side descriptor the backend feeds (a protocol reader).

        Raises:
            Conflict: the sandbox is paused.
            Unavailable: it cannot start, or was closed for good.
        """
        ...

    async def open_pty(
        self, executable: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str], rows: int, cols: int
    ) -> PtyProcess:
        """Start a command on a new pseudo-terminal of `rows` x `cols`; it has no time limit.

        The terminal is opened inside the sandbox, and the command runs in a session of its own
        whose controlling tty it is. The host gets a descriptor that reads the terminal's output
        and writes its input (`PtyProcess.fd`, the master end for bubblewrap; a VM backend would
        copy its channel into a socket pair); its reader owns and closes it. The command ends when
        it exits, when `kill` ends it, or when the sandbox closes (then `exited` with status None).

        Raises:
            Conflict: the sandbox is paused.
            Unavailable: it cannot start, or the program did not start (the reason says why).
        """
        ...

    async def kill(self, process: Process | PtyProcess) -> bool:
        """Kill a background command and everything it started; return once it has exited.

        Its first process having exited, what it left running (`leftovers`) is killed still;
        a no-op if it left nothing. Returns whether anything of it was running. If the backend
        cannot confirm the kill in time, it ends the whole sandbox, which ends every command in it.

        Raises:
            Conflict: the sandbox is paused.
        """
        ...

    def leftovers(self) -> list[Leftover]:
        """The processes exited commands left running, by their pid in the sandbox (what `ps`
        inside shows); [] when it is not running. Their command lines are the sandbox's to
        write: untrusted, bounded, not cleaned."""
        ...

    async def connect(self, port: int) -> socket.socket:
        """A TCP socket connected to 127.0.0.1:`port` inside the sandbox's own network; the caller owns it.

        Raises:
            InvalidRequest: `port` is not 1..65535.
            Unavailable: the sandbox is not running, or nothing accepts connections on that port.
        """
        ...

    async def kill_leftover(self, pid: int) -> None:
        """SIGKILL one process `leftovers` lists, by its pid in the sandbox; return once it is gone.

        Raises:
            NotFound: no process a command left running in this sandbox has that pid (a pid of
                the host, of another sandbox, of a running command or background process).
            Conflict: the sandbox is paused.
        """
        ...

    def pause(self) -> None:
        """Freeze every command of the sandbox: it uses no CPU until `resume`; `usage().frozen`.

        Raises:
            Conflict: it is not running (never started, closed, or asleep), or has no limits.
        """
        ...

    def resume(self) -> None:
        """Thaw what `pause` froze.

        Raises:
            Conflict: it is not running.
        """
        ...

    def usage(self) -> Usage | None:
        """Live memory, task count and CPU time of the whole sandbox; None when it is not
        running or has no limits (nothing measures it then)."""
        ...

    def set_limits(self, limits: Limits) -> None:
        """Change its memory, task and CPU limits; live if it runs, else from its next start.

        Raises:
            Unavailable: this backend cannot enforce limits here (no cgroups).
            OperationFailed: the limit cannot be applied now (memory below current use).
        """
        ...

    def oom_kills(self) -> int:
        """How many of its processes the memory limit has ended so far (since its last start)."""
        ...

    def memory_note(self) -> str:
        """One line on what held its memory, for the message of an out-of-memory kill."""
        ...

    def sleep(self) -> bool:
        """Stop it if it is idle and holds nothing that would be lost (no command running,
        no scratch files); the next command starts it again. Returns whether it stopped."""
        ...

    def close(self) -> None:
        """End it now: every command and process in it is gone when this returns, and so is
        what the backend held for it (its cgroup). Blocking: for shutdown and error paths.
        It may be started again (a new command does)."""
        ...

    async def aclose(self, *, final: bool = False) -> None:
        """`close` without blocking the event loop; `final`: it never starts again (then
        `start`, `run` and `spawn` raise `Unavailable`)."""
        ...


class Backend(Protocol):
    """An isolation backend: makes the sandboxes of one server."""

    @property
    def name(self) -> str:
        """What an administrator would call it in a template (``bubblewrap``)."""
        ...

    def sandbox(self, spec: SandboxSpec, *, limits: Limits | None) -> Sandbox:
        """A sandbox for `spec`, not started yet (`start` or its first command starts it).

        Raises:
            Unavailable: `limits` were given and this backend cannot enforce them here.
        """
        ...
