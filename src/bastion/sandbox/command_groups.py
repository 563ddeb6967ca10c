"""One child cgroup per command of a running sandbox: container semantics for its processes.

Commands share the sandbox's PID namespace, so what one leaves running (`x &`, nohup, setsid,
a double fork, a daemon) lives on until the sandbox closes. What still ends a command's
whole tree on a timeout or cancel is its own child group of the sandbox's group
(`cgroups.CommandCgroup`): the agent starts the command inside it, and killing the group
kills everything the command started, and nothing else.

Groups are reused rather than made and removed per command: a command that exits leaves an
empty group (free again at once) or one still holding processes (left running, listed by
`leftovers` until they end or a kill of the command ends them, `kill_left`; then free again). A
killed group is free once empty. A kill of a running command comes in two steps: `doom` marks the
group (given to no other command from then on) when the host asks the agent to kill the command, and
`kill_doomed` kills it once the agent is out of it (the agent starts each command from inside the
command's group): at once if the command has started and the agent has gone home, else when the agent
has answered. Closing the sandbox removes them all (`SandboxCgroup.destroy`).

What the host reads of a left process (/proc/PID/cmdline) is the sandbox's to write: it is
read bounded, and returned raw for the layer above to clean.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from dataclasses import dataclass
from typing import Final

from bastion.safety.errors import NotFound
from bastion.sandbox.cgroups import CommandCgroup, SandboxCgroup

MAX_CMDLINE_BYTES: Final = 4096  # of a left process's /proc/PID/cmdline, read host-side
_STATUS_BYTES: Final = 8192


@dataclass(frozen=True)
class Leftover:
    """A process a command left running. `pid` is the sandbox's own number for it (what `ps`
    inside shows); `argv` is what the process says its command line is (untrusted, bounded)."""

    pid: int
    argv: tuple[bytes, ...]


class CommandGroups:
    """The command groups of one running sandbox, by command id while the command runs."""

    def __init__(self, sandbox: SandboxCgroup) -> None:
        self._sandbox = sandbox
        self._names = itertools.count(1)
        self._free: list[CommandCgroup] = []
        self._running: dict[int, CommandCgroup] = {}
        self._killed: set[int] = set()  # command ids whose group was killed
        self._left: dict[int, CommandCgroup] = {}  # by command id: exited commands' groups still holding processes
        self._draining: list[CommandCgroup] = []  # killed groups, until their processes have gone
        self._doomed: dict[int, CommandCgroup] = {}  # by command id: groups marked killed, not yet killed

    def take(self, command_id: int) -> CommandCgroup:
        """A group for a command about to start: a free one, else a new one.

        Raises:
            OperationFailed: the kernel refused to make one.
        """
        if not self._free:
            self._sweep()
        group = self._free.pop() if self._free else self._sandbox.command_group(f"c{next(self._names)}")
        self._running[command_id] = group
        return group

    def forget(self, command_id: int) -> None:
        """The command never reached the agent: its group is free again."""
        group = self._running.pop(command_id, None)
        if group is not None:
            self._free.append(group)

    def doom(self, command_id: int) -> CommandCgroup | None:
        """Mark a running command's group as killed without killing it yet: `kill_doomed` does, once the
        agent cannot be in it (it starts a command from inside the command's group). Until then the group
        is not given to another command. Returns the group, None if the command has no group."""
        group = self._running.get(command_id)
        if group is not None:
            self._killed.add(command_id)
            self._doomed[command_id] = group
        return group

    def kill_doomed(self, command_id: int) -> CommandCgroup | None:
        """SIGKILL a group `doom` marked, once (None if it was not marked, or was killed already).

        Raises:
            OperationFailed: the kernel refused.
        """
        group = self._doomed.pop(command_id, None)
        if group is not None:
            try:
                group.kill()
            except BaseException:
                self._doomed[command_id] = group  # tried again at the agent's answer, still given to no one
                raise
        return group

    def exited(self, command_id: int) -> None:
        """The command's first process exited: its group is free, killed, or holds what it left running."""
        group = self._running.pop(command_id, None)
        if group is None:
            return
        if command_id in self._killed:
            self._killed.discard(command_id)
            self._draining.append(group)
        elif group.populated():
            self._left[command_id] = group
        else:
            self._free.append(group)

    def left_by(self, command_id: int) -> bool:
        """Whether the exited command `command_id` left processes running."""
        group = self._left.get(command_id)
        return group is not None and group.populated()

    def kill_left(self, command_id: int) -> CommandCgroup | None:
        """SIGKILL what an exited command left running (its group); None if it left nothing running.

        The agent is never in an exited command's group: it moves back before it reports any exit.

        Raises:
            OperationFailed: the kernel refused (the group stays listed by `leftovers`).
        """
        if not self.left_by(command_id):
            return None
        group = self._left[command_id]
        group.kill()
        del self._left[command_id]
        self._draining.append(group)
        return group

    def _sweep(self) -> None:
        """Free the left and killed groups that have emptied since."""
        doomed = [id(group) for group in self._doomed.values()]
        for command_id, group in list(self._left.items()):
            if not group.populated():
                del self._left[command_id]
                self._free.append(group)
        for group in [g for g in self._draining if id(g) not in doomed and not g.populated()]:
            self._draining.remove(group)
            self._free.append(group)

    def left_pids(self) -> list[int]:
        """The server's pids of the processes commands left running."""
        self._sweep()
        return sorted(pid for group in self._left.values() for pid in group.pids())

    def leftovers(self) -> list[Leftover]:
        """What exited commands left running, oldest pid first."""
        found = []
        for host_pid in self.left_pids():
            inner = _inner_pid(host_pid)
            if inner is not None:
                found.append(Leftover(inner, _argv(host_pid)))
        return sorted(found, key=lambda left: left.pid)

    def open_leftover(self, pid: int) -> int:
        """A pidfd of the left process the sandbox numbers `pid`; checked after it is opened,
        so a pid reused meanwhile by a process elsewhere is refused, never signalled.

        Raises:
            NotFound: no process a command left running has that pid in this sandbox.
        """
        for host_pid in self.left_pids():
            if _inner_pid(host_pid) != pid:
                continue
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(host_pid)
                if host_pid in self.left_pids() and _inner_pid(host_pid) == pid:
                    return fd
                os.close(fd)
        raise NotFound(f"no process {pid} left running by a command in this sandbox: see list_processes")


def kill_pidfd(fd: int) -> None:
    """SIGKILL the process behind a pidfd (it may have exited already)."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(fd, signal.SIGKILL)


def _read_bounded(path: str, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _inner_pid(host_pid: int) -> int | None:
    """The process's pid in its innermost PID namespace (the sandbox's), from the kernel's NSpid line."""
    for line in _read_bounded(f"/proc/{host_pid}/status", _STATUS_BYTES).split(b"\n"):
        if line.startswith(b"NSpid:"):
            fields = line.split()
            with contextlib.suppress(ValueError):
                return int(fields[-1])
    return None


def _argv(host_pid: int) -> tuple[bytes, ...]:
    """The process's command line; if the kernel gives none, its name in brackets, as ps(1) shows it.

    /proc/PID/cmdline is empty while an execve is between its new memory and its arguments, while the
    process exits, and for a process whose main thread has ended while others run (listed as it still
    runs). Kernel threads have none either, but never sit in a sandbox's group.
    """
    raw = _read_bounded(f"/proc/{host_pid}/cmdline", MAX_CMDLINE_BYTES)
    if raw:
        return tuple(raw.rstrip(b"\0").split(b"\0"))
    for line in _read_bounded(f"/proc/{host_pid}/status", _STATUS_BYTES).split(b"\n"):
        if line.startswith(b"Name:"):
            return (b"[" + line.partition(b":")[2].strip() + b"]",)
    return ()
