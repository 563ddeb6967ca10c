"""The resident agent of a warm sandbox. DANGEROUS: it starts every command.

This file runs INSIDE the bubblewrap sandbox, started by `bastion.sandbox._spawn`
as ``python3 -I -S /opt/bastion/agent.py <socket fd> pids=shared|per-command <writable dir>...``, that file holding
landlock.py's source and then this one, bound read-only (the source stays off every command
line). It is standard library only and imports nothing from bastion: the sandbox sees no
site-packages.

Why it exists: a fresh bwrap per command costs 4-6 ms; a resident agent that
starts each command with posix_spawn costs about 1 ms, and the sandbox's namespaces
are made once.

Protocol (one object per SOCK_SEQPACKET message: marshal from the host, JSON from the
agent; fds via SCM_RIGHTS):
  agent -> host   {"event": "ready", "pid": P, "landlock": {...}}, once
  host -> agent   {"op": "home"}, once after "ready" when the sandbox has cgroups, with one fd:
                  the sandbox group's cgroup.procs, opened O_WRONLY by the host
  host -> agent   {"op": "run", "id": N, "exe": "/usr/bin/ls", "argv": [...], "cwd": "/workspace", "env": {...},
                   "cgroup": true}
                  with two or three fds: the write ends of the stdout and stderr pipes, and
                  for a background process the read end of its stdin pipe (else stdin is /dev/null);
                  with "cgroup", one more last: the command group's cgroup.procs, opened O_WRONLY
  host -> agent   {"op": "pty", "id": N, "exe": ..., "argv": [...], "cwd": ..., "env": {...}, "rows": R, "cols": C,
                   "cgroup": true}
                  with no fd, or with "cgroup" the command group's cgroup.procs: the agent opens a pseudo-terminal
                  pair here (the sandbox's own devpts, bwrap --dev), sets its window size and starts the command
                  in a new session whose controlling tty is the pair's slave (its 0, 1 and 2)
  agent -> host   {"event": "pty", "id": N, "pid": P} with one fd: the pair's master; the agent keeps no copy
                  of either end. Or {"event": "pty", "id": N, "error": "..."} with no fd: it did not start
                  (no "exit" follows).
  host -> agent   {"op": "kill", "id": N}
  agent -> host   {"event": "killed", "id": N}, once it has sent the command SIGKILL (if it was running): the
                  host kills the command's group then, if it has not already (see below)
  agent -> host   {"event": "exit", "id": N, "status": S}   S: exit code, or 128 + signal number
  host -> agent   {"op": "connect", "id": N, "port": P}   (a preview URL's request)
  agent -> host   {"event": "connected", "id": N} with one fd: a TCP socket connected to 127.0.0.1:P
                  inside the sandbox's network namespace; or {"event": "connected", "id": N, "error": "..."}
                  The address is always 127.0.0.1: only the port comes from the host. The host accepts
                  an fd only with a "connected" event answering a connect of its own, and checks it is a
                  connected TCP socket.
  host -> agent   {"op": "netns"}, once per run, with the run's first connect
  agent -> host   {"event": "netns"} with one fd: /proc/self/ns/net. The host keeps it only as the answer
                  to its own ask and if it is a network namespace other than its own; it then makes later
                  connects' sockets in it itself (sandbox/netns.py).
A command that cannot start (no such program, a bad cwd) writes one line to its stderr
pipe and exits 127, as a shell would.

With cgroups (the usual case, ``pids=shared``), the agent is PID 1 of the sandbox's PID
namespace (bwrap --as-pid-1) and commands run in it, as in a container: `ps`, `kill` and
/proc agree on pids, and what a command leaves running (`x &`, nohup, setsid, a double
fork, a daemon) lives on, reparented to the agent (which reaps it), until the sandbox closes.
Each command starts in a child cgroup of its own, made by the host, which kills that
group's whole tree on a timeout or cancel: the agent writes "0" to the group's
cgroup.procs fd (it moves itself), spawns, and writes "0" to its home fd (moves back). So
the host kills a group at once only when it holds the command and not the agent, else once
the agent has answered its kill ("killed"): it handles messages in order, and is then
outside every group.
The kernel checks those moves against the opener's credentials and cgroup namespace
(Linux >= 5.16), so fds the host opened work from in here; the sandbox sees no cgroupfs,
and a command cannot reach the agent's fds (CLOEXEC, and the agent keeps capabilities
the commands lack, so ptrace and /proc/1/fd are refused to them).

Without cgroups (the fallback, ``pids=per-command``), the agent first makes a PID namespace
of its own (`enter_own_pid_namespace`), and each command runs as PID 1 of one of its own:
before each spawn the agent points its children's PID namespace back at its own (setns)
and unshares a new one. When that PID 1 exits or is killed, the kernel kills every
process left in its namespace, setsid'd and double-forked ones included: nothing a
command started outlives it.

posix_spawn (clone with CLONE_VM | CLONE_VFORK, then exec) shares the agent's memory
until the exec, so starting a command copies no page table and takes no copy-on-write
fault; a fork of this Python process cost three times the CPU. The child cannot run
code before the exec, so what it must not inherit is taken from the agent itself at
start-up: every capability it could pass on (bounding, inheritable and ambient sets
emptied, root's exec privileges off with SECBIT_NOROOT) and no_new_privs. A command
thus execs with no capability at all while the agent keeps CAP_SYS_ADMIN for the
namespaces.
"""

import _socket
import _struct
import marshal
import posix
import select
import sys

# Every import here is paid at each sandbox start (json+re, contextlib and typing cost
# ~25 ms together on a slow machine): the agent uses builtins and string annotations, and the
# C modules under signal, socket, selectors, struct, os and ctypes (whose Python, with enum,
# collections, abc and posixpath, cost 5 ms of CPU; ctypes, os and stat cost about 6 ms more of
# each start: a cold create_sandbox went from 27-31 to 22-24 ms without them).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import _ctypes
    import signal as _signal  # the same functions, typed (typeshed has no stub for _signal)
    from typing import Any

    # At run time `_spawn` prepends landlock.py's source to this file's, which defines them.
    from bastion.sandbox.inside.landlock import Libc, byref, c_int, c_uint32, get_errno, restrict
else:
    import _signal

CLONE_NEWPID = 0x20000000
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_LAST = 63
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# SECBIT_NOROOT and its lock, SECBIT_NO_CAP_AMBIENT_RAISE and its lock (capabilities(7)).
SECUREBITS = (1 << 0) | (1 << 1) | (1 << 6) | (1 << 7)
MAX_MESSAGE_BYTES = 1 << 20
# Loopback connects end at once (accepted or refused) unless the listener's backlog is full: then
# the agent waits this long, stalling only its own sandbox's requests.
CONNECT_TIMEOUT_S = 2.0
EXIT_CANNOT_START = 127
# Dispositions a command must not inherit: Python ignores SIGPIPE and SIGXFSZ (handled
# signals are reset by posix_spawn itself; these are named too, to say so).
DEFAULT_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGCHLD, _signal.SIGINT, _signal.SIGTERM)

libc = Libc()


class CapHeader(_ctypes.Structure):
    _fields_ = (("version", c_uint32), ("pid", c_int))


class CapData(_ctypes.Structure):
    _fields_ = (("effective", c_uint32), ("permitted", c_uint32), ("inheritable", c_uint32))


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(get_errno(), what)


def keep_nothing_for_commands() -> None:
    """Leave the agent's commands no capability they could ever hold.

    On exec, a process gets (inheritable & file's) | (file's permitted & bounding) |
    ambient, with root counting as having every file capability unless SECBIT_NOROOT:
    with all of these emptied, each command execs with none. The agent keeps its own
    effective CAP_SYS_ADMIN (PID namespaces) and CAP_SETPCAP (needed just here).
    """
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(CAP_LAST + 1):
        # EINVAL past the kernel's last capability: nothing left to drop.
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and get_errno() != 22:
            raise OSError(get_errno(), "drop a bounding capability")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    check(libc.capget(byref(header), data), "capget")
    for half in data:
        half.inheritable = 0
    check(libc.capset(byref(header), data), "capset")
    check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    # Commands share its PID namespace: its /proc entries (fd, environ, mem) become root's, not
    # theirs. A command's own exec makes it dumpable again: this stays the agent's.
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")


def enter_own_pid_namespace(sock: _socket.socket) -> None:
    """Continue as PID 1 of a PID namespace owned by the agent's own user namespace.

    bwrap maps the sandbox's unprivileged uid in a second user namespace, nested in the one
    that owns the sandbox's PID namespace, so the agent's CAP_SYS_ADMIN does not reach that
    PID namespace and `setns` back to it would fail. In a PID namespace of its own it does.
    The parent becomes `sleep infinity` (bwrap's child must stay); the host notices the
    agent's end by its socket closing, never by this parent.
    """
    check(libc.unshare(CLONE_NEWPID), "make the agent's PID namespace")
    if posix.fork() != 0:
        sock.close()
        try:  # noqa: SIM105 - contextlib would cost import time at every start
            posix.execv("/bin/sleep", ["sleep", "infinity"])
        except OSError:
            pass
        while True:  # no sleep binary: wait here instead
            _signal.pause()


class Agent:
    def __init__(self, sock: _socket.socket, per_command_pids: bool) -> None:
        self.sock = sock
        self.per_command_pids = per_command_pids
        self.own_pid_ns = posix.open("/proc/self/ns/pid", posix.O_RDONLY)
        self.net_ns = posix.open("/proc/self/ns/net", posix.O_RDONLY)
        self.devnull = posix.open("/dev/null", posix.O_RDONLY)
        self.running: dict[int, int] = {}  # command id -> pid, until reaped
        self.ids: dict[int, int] = {}  # pid -> command id
        self.home = -1  # the sandbox group's cgroup.procs (op "home"), when it has cgroups

    def send(self, message: "dict[str, Any]", fd: int = -1) -> None:
        try:
            if fd >= 0:
                send_fds(self.sock, to_json(message).encode(), fd)
            else:
                self.sock.send(to_json(message).encode())
        except OSError:
            posix._exit(0)  # the host went away: the sandbox ends with it

    def handle(self, req: "dict[str, Any]", fds: "list[int]") -> None:
        op = req.get("op")
        group = -1
        if op in ("run", "pty") and req.get("cgroup") is True and fds:
            group = fds.pop()
            if self.home < 0:  # no way back from the group: start it in a PID namespace instead
                posix.close(group)
                group = -1
        if op == "run" and len(fds) in (2, 3):
            self.start(req, fds, group)
            return
        if op == "pty" and not fds:
            self.start_pty(req, group)
            return
        if op == "home" and len(fds) == 1 and self.home < 0:
            self.home = fds.pop()
            posix.set_inheritable(self.home, False)
        for fd in (*fds, group):
            if fd >= 0:
                posix.close(fd)
        if op == "connect":
            self.connect(req)
        if op == "netns":  # the host then makes a preview's sockets in it itself (sandbox/netns.py)
            self.send({"event": "netns"}, self.net_ns)
        if op == "kill":
            command_id = int(req.get("id", 0))
            pid = self.running.get(command_id)
            if pid is not None:
                try:  # noqa: SIM105 - contextlib would cost import time at every start
                    posix.kill(pid, _signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # The host kills the command's group on this answer if it has not yet: the agent is out of every group.
            self.send({"event": "killed", "id": command_id})

    def connect(self, req: "dict[str, Any]") -> None:
        """Connect to 127.0.0.1:port in the sandbox's own network namespace; hand the socket to the host."""
        request_id = req.get("id")
        port = req.get("port")
        if type(request_id) is not int or type(port) is not int or not 0 < port < 65536:
            self.send({"event": "connected", "id": request_id if type(request_id) is int else 0, "error": "bad port"})
            return
        conn = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            conn.connect(("127.0.0.1", port))
        except OSError as exc:
            conn.close()
            reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or "cannot connect")
            self.send({"event": "connected", "id": request_id, "error": reason})
            return
        try:
            send_fds(self.sock, to_json({"event": "connected", "id": request_id}).encode(), conn.fileno())
        except OSError:
            posix._exit(0)  # the host went away: the sandbox ends with it
        finally:
            conn.close()

    def start(self, req: "dict[str, Any]", fds: "list[int]", group: int) -> None:
        """Start one command in its cgroup (`group` >= 0) or else as PID 1 of a new PID namespace;
        report it if it cannot start."""
        command_id = int(req["id"])
        try:
            for fd in fds:
                posix.set_inheritable(fd, False)  # the spawn's dup2 gives the command its own 0-2
            stdin = fds[2] if len(fds) > 2 else self.devnull
            actions = [
                (posix.POSIX_SPAWN_DUP2, stdin, 0),
                (posix.POSIX_SPAWN_DUP2, fds[0], 1),
                (posix.POSIX_SPAWN_DUP2, fds[1], 2),
            ]
            if group < 0 and self.per_command_pids:
                check(libc.setns(self.own_pid_ns, CLONE_NEWPID), "reset the PID namespace for children")
                check(libc.unshare(CLONE_NEWPID), "make a PID namespace")
            posix.chdir(req["cwd"])
            try:
                pid = self.spawn_in(group, req, actions)
            finally:
                posix.chdir("/")
        except (OSError, ValueError, TypeError, KeyError) as exc:
            argv0 = (req.get("argv") or ["?"])[0]
            try:  # noqa: SIM105 - contextlib would cost import time at every start
                posix.write(fds[1], f"bastion: cannot start {argv0!r}: {exc}\n".encode(errors="replace"))
            except OSError:
                pass
            self.send({"event": "exit", "id": command_id, "status": EXIT_CANNOT_START})
        else:
            self.running[command_id] = pid
            self.ids[pid] = command_id
        finally:
            for fd in (*fds, group):
                if fd >= 0:
                    posix.close(fd)

    def start_pty(self, req: "dict[str, Any]", group: int) -> None:
        """Start one command on a new pseudo-terminal; hand its master to the host, or say why not."""
        command_id = int(req["id"])
        master = slave = -1
        try:
            master, slave = posix.openpty()  # both close-on-exec (PEP 446): the command opens the slave itself
            set_window(slave, int(req["rows"]), int(req["cols"]))
            # After setsid, a session leader opening a tty without O_NOCTTY makes it its controlling tty.
            actions = [
                (posix.POSIX_SPAWN_OPEN, 0, posix.ttyname(slave), posix.O_RDWR, 0),
                (posix.POSIX_SPAWN_DUP2, 0, 1),
                (posix.POSIX_SPAWN_DUP2, 0, 2),
            ]
            if group < 0 and self.per_command_pids:
                check(libc.setns(self.own_pid_ns, CLONE_NEWPID), "reset the PID namespace for children")
                check(libc.unshare(CLONE_NEWPID), "make a PID namespace")
            posix.chdir(req["cwd"])
            try:
                pid = self.spawn_in(group, req, actions, session=True)
            finally:
                posix.chdir("/")
        except (OSError, ValueError, TypeError, KeyError) as exc:
            self.send({"event": "pty", "id": command_id, "error": str(exc)[:500]})
        else:
            self.running[command_id] = pid
            self.ids[pid] = command_id
            self.send({"event": "pty", "id": command_id, "pid": pid}, master)
        finally:
            for fd in (master, slave, group):
                if fd >= 0:
                    posix.close(fd)

    def spawn_in(self, group: int, req: "dict[str, Any]", actions: "list[Any]", session: bool = False) -> int:
        """posix_spawn the command; with a group, from inside it (the child starts there), then back home.
        `session`: in a session of its own (setsid, before the file actions), else a process group of its own."""
        if group >= 0:
            posix.write(group, b"0")  # a refusal raises: the command does not start outside its group
        # A process group (or session) of its own: `kill 0` in a command ends that command, not the others.
        group_or_session: dict[str, Any] = {"setsid": True} if session else {"setpgroup": 0}
        try:
            return posix.posix_spawn(
                req["exe"],
                req["argv"],
                req["env"],
                file_actions=actions,
                setsigdef=DEFAULT_SIGNALS,
                # In a microVM guest the relay starts the agent with the workspace owner's real ids and
                # root's effective ones: each command runs as that owner (its exec makes the saved ids so).
                resetids=posix.getuid() != posix.geteuid(),
                setsigmask=(),
                **group_or_session,
            )
        finally:
            if group >= 0:
                go_home(self.home)

    def reap(self) -> None:
        while True:
            try:
                pid, raw = posix.waitpid(-1, posix.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            command_id = self.ids.pop(pid, None)
            if command_id is None:
                continue
            del self.running[command_id]
            code = posix.waitstatus_to_exitcode(raw)
            self.send({"event": "exit", "id": command_id, "status": code if code >= 0 else 128 - code})


def set_window(tty: int, rows: int, cols: int) -> None:
    """TIOCSWINSZ: the size a program reads with TIOCGWINSZ (`stty size`). Imported here: only terminals pay."""
    import fcntl
    import termios

    fcntl.ioctl(tty, termios.TIOCSWINSZ, _struct.pack("HHHH", rows, cols, 0, 0))


def send_fds(sock: _socket.socket, data: bytes, fd: int) -> None:
    """One message with one fd (SCM_RIGHTS), as socket.send_fds sends it."""
    sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _struct.pack("i", fd))])


def recv_fds(sock: _socket.socket, size: int, max_fds: int) -> "tuple[bytes, list[int]]":
    """One message and the fds it carries, as socket.recv_fds receives them."""
    fds: list[int] = []
    data, ancillary, _flags, _addr = sock.recvmsg(size, _socket.CMSG_LEN(max_fds * 4))
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % 4
            fds += _struct.unpack(f"{whole // 4}i", payload[:whole])
    return data, fds


def go_home(home: int) -> None:
    """Move the agent back to the sandbox's group; if it cannot, end the sandbox rather than live
    on in a command's group, whose kill would end the agent with the command."""
    try:
        posix.write(home, b"0")
    except OSError:
        posix._exit(1)


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


def main() -> None:
    fd = int(sys.argv[1])
    posix.set_inheritable(fd, False)  # bwrap passed it down; no command may inherit it
    sock = _socket.socket(fileno=fd)
    sock.setblocking(True)
    # First, while single-threaded and before any command exists: writes only beneath
    # the sandbox's own trees; then nothing a command could inherit.
    per_command_pids = sys.argv[2] != "pids=shared"
    landlock = restrict(sys.argv[3:])
    keep_nothing_for_commands()
    if per_command_pids:
        enter_own_pid_namespace(sock)
    posix.chdir("/")  # hold no folder of the workspace; each command gets its own cwd
    wake_r, wake_w = posix.pipe2(posix.O_NONBLOCK | posix.O_CLOEXEC)
    _signal.set_wakeup_fd(wake_w)
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    # Commands share the agent's PID namespace: one sending SIGINT to PID 1 must not stop it.
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    agent = Agent(sock, per_command_pids)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    agent.send({"event": "ready", "pid": posix.getpid(), "landlock": landlock})
    while True:
        for ready, _ in poller.poll():
            if ready == fd:
                try:
                    data, fds = recv_fds(sock, MAX_MESSAGE_BYTES, 4)
                except InterruptedError:
                    continue
                if not data:
                    posix._exit(0)  # the host went away: the sandbox ends with it
                for received in fds:
                    # recv_fds gives them inheritable: a command must not get its group's cgroup.procs
                    # (it could pull PID 1 into its group, whose kill on a timeout ends the agent).
                    posix.set_inheritable(received, False)
                agent.handle(marshal.loads(data), fds)  # noqa: S302 - written by the host only
            else:
                try:  # noqa: SIM105 - contextlib would cost import time at every start
                    posix.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        agent.reap()


if __name__ == "__main__":
    main()
