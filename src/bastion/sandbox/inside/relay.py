"""The microVM guest's relay between the host's serial port and the resident agent. DANGEROUS.

This file runs INSIDE a microVM, as root of the guest: the guest's /init reads it from the
agent's virtio-serial port (`bastion.sandbox.vmimage`) and runs it with `PORT`, that port's
fd, and `FILES`, the files the host sends with it (the agent's source, /etc/passwd...). It is
standard library only.

Why it exists: the agent (inside/agent.py, unchanged) takes each command's stdout, stderr and
stdin as file descriptors over a SOCK_SEQPACKET socket, and a serial port carries bytes, not
descriptors. So the relay makes the pipes here, hands their ends to the agent over a local
socket pair, and copies their bytes to and from the port as frames. The agent's other messages
pass through unchanged (marshal from the host, JSON to it). A terminal's pty master, which the
agent hands over with its "pty" event, goes to the stream port's program (inside/egress_port.py)
with the id of the stream the host chose for it (the request's "stream"); every other descriptor
from the agent is closed. Previews do not pass here: the host opens them on the stream port.

Frame: 4-byte big-endian length of the rest, one kind byte, 4-byte command id, payload.
  host -> guest  M (an agent message, marshal), I (stdin bytes), E (close stdin)
  guest -> host  M (an agent event, JSON), O / R (stdout / stderr bytes), o / r (that stream ended),
                 S (before each exit event: `state()`, the guest's scratch, OOM kills and shared memory)
  host -> guest  P (id: the commands' task limit), L (payload: their memory limit in bytes)
"""

import ctypes
import marshal
import os
import selectors
import socket
import struct
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    PORT: int = 0  # given by /init
    FILES: "dict[str, str]" = {}  # given by the host, in front of this source
    PIDS: "int | None" = None  # the guest's task limit, likewise
    MEMORY: "int | None" = None  # the commands' memory limit in bytes, likewise
    MOUNTS: "list[tuple[str, str]]" = []  # (9p tag, where): a template's read-only folders, likewise

HEADER = struct.Struct(">IcI")
READ_BYTES = 65536
AGENT = "/opt/bastion/agent.py"
EGRESS = "/opt/bastion/egress_port.py"
EGRESS_PORT = "/dev/vport0p2"  # the second port of the virtio-serial device (nr=2 in the VMM's argv)
EGRESS_SOCKET = "/run/bastion/egress.sock"  # where the forwarder connects, as in a namespace sandbox
GROUP = "/sys/fs/cgroup/sandbox"  # the guest's own cgroup v2 group: the agent, its commands and the relay
PR_SET_DUMPABLE = 4
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
P9_OPTIONS = b"trans=virtio,version=9p2000.L,msize=262144,cache=loose"


class Relay:
    def __init__(self, port: int, agent: socket.socket, control: socket.socket) -> None:
        self.port = port
        self.agent = agent
        self.control = control  # to the stream port's program: terminals' pty masters
        self.pty_streams: dict[int, int] = {}  # command id -> the stream the host chose for its terminal
        self.sel = selectors.DefaultSelector()
        self.inbox = b""
        self.stdin: dict[int, int] = {}  # command id -> write end of its stdin pipe
        self.pending: dict[int, bytes] = {}  # command id -> stdin bytes not yet taken by the pipe
        self.closing: set[int] = set()  # stdin to close once pending is written

    def send(self, kind: bytes, command_id: int, payload: bytes = b"") -> None:
        frame = HEADER.pack(len(payload) + 5, kind, command_id) + payload
        view = memoryview(frame)
        while view:
            view = view[os.write(self.port, view) :]

    def on_port(self) -> None:
        data = os.read(self.port, READ_BYTES)
        if not data:
            sys.exit(0)
        self.inbox += data
        while len(self.inbox) >= 4:
            size = int.from_bytes(self.inbox[:4], "big")
            if len(self.inbox) < 4 + size:
                return
            _, kind, command_id = HEADER.unpack_from(self.inbox)
            payload = self.inbox[HEADER.size : 4 + size]
            self.inbox = self.inbox[4 + size :]
            self.on_frame(kind, command_id, payload)

    def on_frame(self, kind: bytes, command_id: int, payload: bytes) -> None:
        if kind == b"M":
            self.to_agent(payload)
        elif kind == b"I" and command_id in self.stdin:
            self.pending[command_id] = self.pending.get(command_id, b"") + payload
            self.flush_stdin(command_id)
        elif kind == b"P":
            change_limit("pids.max", command_id)
        elif kind == b"L" and payload.isdigit():
            change_limit("memory.max", int(payload))
        elif kind == b"E" and command_id in self.stdin:
            self.closing.add(command_id)
            self.flush_stdin(command_id)

    def to_agent(self, payload: bytes) -> None:
        req: dict[str, Any] = marshal.loads(payload)  # noqa: S302 - written by the host only
        if req.get("op") == "pty":
            self.pty_streams[int(req["id"])] = int(req["stream"])
        if req.get("op") != "run":
            self.agent.send(payload)
            return
        command_id = int(req["id"])
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ends = [out_w, err_w]
        if req.get("stdin"):
            in_r, in_w = os.pipe()
            os.set_blocking(in_w, False)
            ends.append(in_r)
            self.stdin[command_id] = in_w
        try:
            socket.send_fds(self.agent, [payload], ends)
        finally:
            for fd in ends:
                os.close(fd)
        self.sel.register(out_r, selectors.EVENT_READ, (b"O", command_id))
        self.sel.register(err_r, selectors.EVENT_READ, (b"R", command_id))

    def flush_stdin(self, command_id: int) -> None:
        fd = self.stdin[command_id]
        data = self.pending.pop(command_id, b"")
        try:
            while data:
                data = data[os.write(fd, data) :]
        except BlockingIOError:
            self.pending[command_id] = data
            self.watch_stdin(command_id, fd)
            return
        except OSError:  # the command closed its stdin: what is left goes nowhere
            data = b""
        self.unwatch_stdin(fd)
        if command_id in self.closing:
            self.closing.discard(command_id)
            del self.stdin[command_id]
            os.close(fd)

    def watch_stdin(self, command_id: int, fd: int) -> None:
        try:  # noqa: SIM105 - contextlib would cost import time at every start
            self.sel.register(fd, selectors.EVENT_WRITE, (b"W", command_id))
        except KeyError:
            pass

    def unwatch_stdin(self, fd: int) -> None:
        try:  # noqa: SIM105 - contextlib would cost import time at every start
            self.sel.unregister(fd)
        except KeyError:
            pass

    def on_agent(self) -> None:
        data, fds, _flags, _addr = socket.recv_fds(self.agent, 1 << 20, 4)
        if data.startswith(b'{"event":"pty"'):
            self.hand_over_pty(data, fds)
        for fd in fds:  # the relay keeps no descriptor the agent gives
            os.close(fd)
        if not data:
            sys.exit(0)
        if data.startswith(b'{"event":"exit"'):
            self.send(b"S", 0, state())  # before the exit: the host sleeps and reports OOM kills on it
        self.send(b"M", 0, data)

    def hand_over_pty(self, data: bytes, fds: "list[int]") -> None:
        """Give a terminal's master to the stream port's program, named by its stream's id."""
        import json

        command_id = json.loads(data).get("id")
        stream_id = self.pty_streams.pop(command_id, None) if type(command_id) is int else None
        if stream_id is not None and len(fds) == 1:
            try:  # noqa: SIM105 - contextlib would cost import time at every start
                socket.send_fds(self.control, [stream_id.to_bytes(4, "big")], fds)
            except OSError:  # the stream port's program is gone: the host gives the terminal up in time
                pass

    def on_output(self, fd: int, kind: bytes, command_id: int) -> None:
        data = os.read(fd, READ_BYTES)
        if data:
            self.send(kind, command_id, data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        self.send(kind.lower(), command_id)

    def loop(self) -> None:
        self.sel.register(self.port, selectors.EVENT_READ, None)
        self.sel.register(self.agent, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.sel.select():
                if key.fileobj == self.port:
                    self.on_port()
                elif key.fileobj is self.agent:
                    self.on_agent()
                elif key.data[0] == b"W":
                    self.flush_stdin(key.data[1])
                else:
                    self.on_output(key.fd, key.data[0], key.data[1])


def scratch_empty() -> bool:
    """Whether the guest's /tmp and /dev/shm hold nothing (a sleeping guest loses them)."""
    for folder in ("/tmp", "/dev/shm"):  # noqa: S108 - the guest's own tmpfs
        with os.scandir(folder) as entries:
            for _ in entries:
                return False
    return True


def state() -> bytes:
    """b"<1 if /tmp and /dev/shm are empty> <OOM kills in the commands' group> <its shared memory bytes>"."""
    return b"%d %d %d" % (
        scratch_empty(),
        group_count("memory.events", "oom_kill"),
        group_count("memory.stat", "shmem"),
    )


def group_count(name: str, key: str) -> int:
    try:
        with open(GROUP + "/" + name) as found:
            for line in found:
                field, _, value = line.partition(" ")
                if field == key:
                    return int(value)
    except OSError:  # no limits: no group
        pass
    return 0


def set_limit(name: str, value: int) -> None:
    with open(GROUP + "/" + name, "w") as out:
        out.write(str(value))


def change_limit(name: str, value: int) -> None:
    """A limit changed live; a guest booted without limits has no group to change (the host's cgroup
    around the VMM still holds)."""
    try:  # noqa: SIM105 - contextlib would cost import time at every start
        set_limit(name, value)
    except OSError:
        pass


def enter_group(pids: "int | None", memory: "int | None") -> None:
    """Move the relay (and so the agent and every command it starts) into a group with the limits:
    the guest's own kernel kills a command past its memory, as the host's would in a namespace sandbox."""
    if pids is None and memory is None:
        return
    os.mkdir(GROUP)
    with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as out:
        out.write("+pids +memory")
    if pids is not None:
        set_limit("pids.max", pids)
    if memory is not None:
        set_limit("memory.max", memory)
    with open(GROUP + "/cgroup.procs", "w") as out:
        out.write("0")


def mount_binds(mounts: "list[tuple[str, str]]") -> None:
    """Mount a template's read-only folders (9p exports QEMU opened read-only too) where the template
    shows them; one that fails ends the relay, so the guest never runs without what its template shows."""
    libc = ctypes.CDLL(None, use_errno=True)
    for tag, dest in mounts:
        os.makedirs(dest, exist_ok=True)
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV
        if libc.mount(tag.encode(), dest.encode(), b"9p", flags, P9_OPTIONS) != 0:
            sys.exit(f"bastion-relay: cannot mount {dest}: {os.strerror(ctypes.get_errno())}")


def write_files(files: "dict[str, str]") -> None:
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)


def start_egress(uid: int, gid: int) -> socket.socket:
    """Start the guest's stream port (inside/egress_port.py), as root, outside the commands' group:
    the socket listens before the agent starts, so no command finds it missing. Returns the socket
    on which the relay hands it terminals' pty masters."""
    os.makedirs(os.path.dirname(EGRESS_SOCKET), mode=0o755, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(EGRESS_SOCKET)
    os.chown(EGRESS_SOCKET, uid, gid)  # the commands' uid connects (its mode is 0777 less the umask)
    listener.listen(64)
    port = os.open(EGRESS_PORT, os.O_RDWR)
    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = (port, listener.fileno(), theirs.fileno())
    for fd in fds:
        os.set_inheritable(fd, True)
    try:
        os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", EGRESS, *map(str, fds)], {})
    finally:
        os.close(port)
        listener.close()
        theirs.close()
    return control


def main(port: int, files: "dict[str, str]") -> None:
    # Commands are root of the guest without capabilities: as the relay's uid they could ptrace it or
    # write its /proc/N/mem, unless it is not dumpable (then both need CAP_SYS_PTRACE).
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit("bastion-relay: cannot make itself undumpable")
    mount_binds(MOUNTS)
    write_files(files)
    # Commands run as the workspace's owner (the sandbox's host uid, through 9p): the agent keeps root's
    # effective ids for its namespaces and starts each command with these real ones (resetids).
    owner = os.stat("/workspace")
    control = start_egress(owner.st_uid, owner.st_gid)
    enter_group(PIDS, MEMORY)
    os.setresgid(owner.st_gid, 0, 0)
    os.setresuid(owner.st_uid, 0, 0)
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    argv = [sys.executable, "-I", "-S", AGENT, str(there.fileno()), "pids=per-command", "/workspace", "/tmp"]  # noqa: S108
    os.set_inheritable(there.fileno(), True)
    os.posix_spawn(sys.executable, argv, {})
    there.close()
    Relay(port, here, control).loop()


if __name__ == "__main__":
    main(PORT, FILES)
