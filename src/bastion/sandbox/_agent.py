"""The resident agent of a warm sandbox. DANGEROUS: it forks and execs.

This file runs INSIDE the bubblewrap sandbox, started by `bastion.sandbox._spawn`
as ``python3 -I -S -c <landlock.py + this source> <socket fd> <writable dir>...``. It is standard library only and
imports nothing from bastion: the sandbox sees no site-packages.

Why it exists: a fresh bwrap per command costs 4-6 ms; a resident agent that
forks per command costs about 1-2 ms, and the sandbox's namespaces are made once.

Protocol (one object per SOCK_SEQPACKET message: marshal from the host, JSON from the
agent; fds via SCM_RIGHTS):
  agent -> host   {"event": "ready"}, once
  agent -> host   {"event": "member", "pid": P} with one fd: a socket to a waiting member
  host -> member  {"exe": "/usr/bin/ls", "argv": [...], "cwd": "/workspace", "env": {...}}
                  with two or three fds: the write ends of the stdout and stderr pipes, and
                  for a background process the read end of its stdin pipe (else stdin is /dev/null)
  host -> agent   {"op": "used", "pid": P}   (so the agent spawns a replacement)
  host -> agent   {"op": "kill", "pid": P}
  host -> agent   {"op": "drop"}     (the sandbox is idle: kill the waiting members, spawn no more)
  agent -> host   {"event": "dropped"}   (members announced before this are dead)
  host -> agent   {"op": "want"}     (a command is coming: spawn members again)
  agent -> host   {"event": "exit", "pid": P, "status": S}   S: exit code, or 128 + signal number
The host talks to a member directly: starting a command costs one hop, not two.

Each command runs as PID 1 of a PID namespace of its own (made with a raw
clone(CLONE_NEWPID) ahead of time and kept in a small pool), with every capability
and the bounding set dropped and no_new_privs set. When that PID 1 exits or is
killed, the kernel kills every process left in its namespace, including
setsid'd and double-forked ones: no survivors, by construction.
"""

import ctypes
import marshal
import os
import selectors
import signal
import socket
import sys

# Every import here is paid at each sandbox start (json+re, contextlib and typing cost
# ~25 ms together on a slow machine): the agent uses builtins and string annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    # At run time `_spawn` prepends landlock.py's source to this file's, which defines it.
    from bastion.sandbox.landlock import restrict

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_LAST = 63
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MAX_MESSAGE_BYTES = 1 << 20

libc = ctypes.CDLL(None, use_errno=True)


class CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


def drop_privileges() -> None:
    """Leave the command with no capability it could ever regain."""
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for cap in range(CAP_LAST + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def prepare_member() -> None:
    """Everything a command's PID 1 can do before it knows the command: off the latency path."""
    # Die with the agent: then this namespace, and all in it, ends too.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    drop_privileges()


def exec_command(req: "dict[str, Any]", fds: "list[int]") -> None:
    """Runs in PID 1 of the command's namespace, already unprivileged; never returns.

    `fds`: stdout, stderr and optionally stdin (else stdin stays /dev/null). All are
    at 3 or above: 0-2 are open when they arrive.
    """
    try:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        if len(fds) > 2:
            os.dup2(fds[2], 0)
        os.closerange(3, 65536)
        os.chdir(req["cwd"])
        os.execve(req["exe"], req["argv"], req["env"])  # noqa: S606 - argv exec, never a shell
    except BaseException as exc:  # report and leave: nothing here may return into the agent
        try:
            os.write(2, f"bastion: cannot start {req['argv'][0]!r}: {exc}\n".encode(errors="replace"))
        finally:
            os._exit(127)


# clone(2) numbers; with every pointer argument zero, the argument order differences don't matter.
SYS_CLONE = {"x86_64": 56, "aarch64": 220, "riscv64": 220}


class Member:
    """A pre-spawned PID 1 of a fresh PID namespace, blocked on `sock` until it
    is told what to exec. Spawning ahead of time takes it off the latency path."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock


def clone_pid1() -> int:
    """fork(), except that the child is PID 1 of a new PID namespace.

    A raw clone(CLONE_NEWPID) costs one process instead of fork + unshare +
    fork (measured: 1.0 ms against 3.0 ms per command). The child skips
    CPython's after-fork hooks, which is safe here only because the agent never
    starts a thread.
    """
    number = SYS_CLONE[os.uname().machine]
    pid: int = libc.syscall(number, CLONE_NEWPID | signal.SIGCHLD, 0, 0, 0, 0)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone(CLONE_NEWPID) failed")
    return pid


def spawn_member() -> Member:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = clone_pid1()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            ours.close()
            await_command(theirs)
        finally:
            os._exit(127)
    theirs.close()
    return Member(pid, ours)


def await_command(sock: socket.socket) -> None:
    """PID 1 of the command's namespace: wait for the request, then exec it. Never returns."""
    try:
        prepare_member()
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 3)
    except BaseException:
        os._exit(127)
    if not data or len(fds) not in (2, 3):
        os._exit(0)
    exec_command(marshal.loads(data), fds)  # noqa: S302 - written by the host only


def to_json(value: object) -> str:
    """JSON for the agent's own small messages: the host parses them with json.loads.

    Host-to-agent messages are marshal (builtin, no import cost); the other way is
    JSON because the host must not unmarshal bytes from inside a sandbox.
    """
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + "".join(c if " " <= c < "\x7f" and c not in '"\\' else f"\\u{ord(c):04x}" for c in value) + '"'
    if isinstance(value, dict):
        return "{" + ",".join(to_json(str(k)) + ":" + to_json(v) for k, v in value.items()) + "}"
    return to_json(str(value))


def send(sock: socket.socket, message: "dict[str, Any]") -> None:
    try:
        sock.send(to_json(message).encode())
    except OSError:
        os._exit(0)


POOL_SIZE = 1  # members waiting per sandbox: each costs ~3 MiB, so an idle sandbox drops its own


class State:
    def __init__(self) -> None:
        self.handed: set[int] = set()  # members handed to the host, not yet reaped
        # Of those, the ones the host has not used yet. A set, not a count: a member can exit
        # (and be reaped) before the host's "used" arrives, and must leave the pool either way.
        self.unused: set[int] = set()
        self.want = True  # False after "drop": no member waits until the host says "want"
        self.sock: socket.socket | None = None


def hand_member(sock: socket.socket, state: State) -> None:
    """Spawn a member and give its socket to the host, which talks to it directly."""
    member = spawn_member()
    try:
        socket.send_fds(sock, [to_json({"event": "member", "pid": member.pid}).encode()], [member.sock.fileno()])
    except OSError:
        os._exit(0)  # the host went away: the sandbox ends with it
    finally:
        member.sock.close()
    state.handed.add(member.pid)
    state.unused.add(member.pid)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    # First, while single-threaded and before any member exists (members spawned
    # earlier could not be signalled): writes only beneath the sandbox's own trees.
    landlock = restrict(sys.argv[2:])
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    state = State()
    state.sock = sock
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    send(sock, {"event": "ready", "pid": os.getpid(), "landlock": landlock})
    while True:
        # Refill only when nothing is waiting, so a refill never delays a reply.
        idle = state.want and len(state.unused) < POOL_SIZE
        events = sel.select(timeout=0 if idle else None)
        if not events and idle:
            hand_member(sock, state)
            continue
        for key, _ in events:
            if key.fileobj is sock:
                try:
                    data = sock.recv(MAX_MESSAGE_BYTES)
                except InterruptedError:
                    continue
                if not data:
                    os._exit(0)  # the host went away: the sandbox ends with it
                handle(marshal.loads(data), state)  # noqa: S302 - written by the host only
            else:
                try:  # noqa: SIM105 - contextlib would cost import time at every start
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        reap(sock, state)


def handle(req: "dict[str, Any]", state: State) -> None:
    op = req.get("op")
    if op == "drop":
        # Members the host has not taken: a "used" for one taken before the drop came first.
        for pid in state.unused:
            try:  # noqa: SIM105 - contextlib would cost import time at every start
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        state.unused.clear()
        state.want = False
        # Member events sent before this one are of killed members: the host drops them until it sees this.
        if state.sock is not None:
            send(state.sock, {"event": "dropped"})
        return
    if op == "want":
        state.want = True
        return
    pid = int(req.get("pid", 0))
    if pid not in state.handed:
        return
    if op == "used":
        state.unused.discard(pid)
    elif op == "kill":
        try:  # noqa: SIM105 - contextlib would cost import time at every start
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(sock: socket.socket, state: State) -> None:
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in state.handed:
            continue
        state.handed.discard(pid)
        state.unused.discard(pid)
        code = os.waitstatus_to_exitcode(raw)
        send(sock, {"event": "exit", "pid": pid, "status": code if code >= 0 else 128 - code})


if __name__ == "__main__":
    main()
