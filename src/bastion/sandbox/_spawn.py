"""Raw process spawning and bubblewrap argv building. DANGEROUS.

This is the only module allowed to start processes (ruff's banned-api enforces
it). Everything here trusts its arguments: callers pass argv that the safety
core has already checked, and paths the config loader has already validated.
The kernel boundary built here is what makes a command harmless, so a change
to the bind list or the namespace flags is a security change: review it so.
"""

from __future__ import annotations

import functools
import importlib.util
import marshal
import os
import resource
import shutil
import socket
import stat
import subprocess  # allowed in pyproject.toml: this is the dangerous layer
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeAlias

from bastion.safety.errors import Unavailable
from bastion.sandbox._devices import DEV, SCRATCH, SHM_SIZE_BYTES, TMP_SIZE_BYTES
from bastion.sandbox.seccomp import DENIED, HOST_WORKSPACE_DENIED, SETID_DENIED, write_filter_fd

# The type of a started sandbox, so the layer above can hold one without importing subprocess.
SandboxProcess: TypeAlias = subprocess.Popen[bytes]
SANDBOX_WORKSPACE: Final = "/workspace"
SANDBOX_PATH: Final = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
# The programs bastion runs inside, shown read-only under /opt/bastion (never on a command line:
# `ps` inside and on the host shows a short one). The agent runs with no site-packages:
# Landlock's code travels with it, in front.
PROGRAMS_DIR: Final = "/opt/bastion"
EGRESS_DIR: Final = "/run/bastion"  # the host folder bound here holds the sandbox's egress proxy socket
EGRESS_SOCKET_NAME: Final = "egress.sock"  # (workbench.network; a microVM's host end connects to it)
AGENT_PATH: Final = f"{PROGRAMS_DIR}/agent.py"
KERNEL_PATH: Final = f"{PROGRAMS_DIR}/kernel.py"
FORWARDER_PATH: Final = f"{PROGRAMS_DIR}/forwarder.py"
REPL_PATH: Final = f"{PROGRAMS_DIR}/repl.py"
# Node's os.networkInterfaces() throws where the seccomp filter refuses netlink; this shim, preloaded into
# every node process, answers with the loopback interface instead (see inside/netif.js). Not a security layer.
NETIF_SHIM_PATH: Final = f"{PROGRAMS_DIR}/netif.js"
SANDBOX_NODE_OPTIONS: Final = f"--require={NETIF_SHIM_PATH}"
SHARED_PIDS: Final = "pids=shared"  # the agent's mode argument (inside/agent.py)
PER_COMMAND_PIDS: Final = "pids=per-command"
_INSIDE: Final = Path(__file__).parent / "inside"
# Every program of inside/ under its own name; the agent with Landlock's code in front; node's shim.
INSIDE_FILES: Final = {
    **{
        f"{PROGRAMS_DIR}/{path.name}": path.read_text(encoding="utf-8")
        for path in sorted(_INSIDE.glob("*.py"))
        if path.name not in ("__init__.py", "landlock.py", "agent.py")
    },
    AGENT_PATH: "\n\n".join((_INSIDE / name).read_text(encoding="utf-8") for name in ("landlock.py", "agent.py")),
    NETIF_SHIM_PATH: (_INSIDE / "netif.js").read_text(encoding="utf-8"),
}
TMP_DIR: Final = "/tmp"  # noqa: S108 - the sandbox's own tmpfs
SHM_DIR: Final = "/dev/shm"  # noqa: S108 - the sandbox's own tmpfs
# Who commands are inside: an ordinary uid, mapped outside to the sandbox's host identity
# (an id of its own from host_id_range when the server is root; else the server's). The host's
# own /etc/passwd and /etc/group are not shown (they name the host's users); these are.
# bwrap's own environment: what it needs to run, not the server's (which may hold secrets).
BWRAP_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
SANDBOX_UID: Final = 1000
SANDBOX_GID: Final = 1000
SANDBOX_USER: Final = "sandbox"
GIT_AUTHOR_NAME: Final = "bastion sandbox"
GIT_AUTHOR_EMAIL: Final = "sandbox@bastion.invalid"  # RFC 2606: .invalid never resolves
IDENTITY_FILES: Final[dict[str, str]] = {
    "/etc/passwd": (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:bastion sandbox:/workspace:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "/etc/group": f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
    # A default author, so `git commit` works in a fresh sandbox; a repository's or HOME's config overrides it.
    # Replaces the host's /etc/gitconfig, which is the host's business (and could name hooks or helpers).
    "/etc/gitconfig": f"[user]\n\tname = {GIT_AUTHOR_NAME}\n\temail = {GIT_AUTHOR_EMAIL}\n",
    # Loopback names, so "localhost" resolves (`--bind localhost`, node's listen(port, "localhost"), vite):
    # without a hosts file glibc asks DNS, which a sandbox's namespace does not reach (EAI_AGAIN). Not the
    # host's /etc/hosts, which names its own machines. With no /etc/host.conf ("multi off", host.conf(5)) glibc
    # answers a name's first line only: localhost is 127.0.0.1, where a preview connects (`WarmSandbox.connect`).
    "/etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
}

_ETC_COPY_MAX_BYTES: Final = 1024 * 1024  # a larger /etc file is bound, not copied into each sandbox's memory
# System folders bound read-only. /etc is not bound whole: only what programs
# need to start and name users, never shadow files, keys or the host's config.
_RO_SYSTEM_DIRS: Final = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_RO_ETC_FILES: Final = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
    "/etc/magic",
    "/etc/magic.mime",
    "/etc/ssl/certs",  # public CA certificates, for TLS through the egress proxy (pip, npm, curl)
)


@dataclass(frozen=True)
class SandboxSpec:
    """What one warm sandbox sees and may do."""

    workspace: str
    read_only_binds: tuple[tuple[str, str], ...] = ()
    tmp_size_bytes: int = TMP_SIZE_BYTES
    shm_size_bytes: int = SHM_SIZE_BYTES
    """Sizes of bwrap's own /tmp and /dev/shm, when `devices` is None (else they are its tmpfs of its own)."""
    cgroup_procs: tuple[str, ...] = ()
    """``cgroup.procs`` files bwrap must be inside before it starts, one per hierarchy."""
    devices: str | None = None
    """A folder of the sandbox's own (`_devices`): its /dev (device nodes, links, a tmpfs at /dev/shm and a
    devpts at /dev/pts), bound in place of bwrap's, and a tmpfs bound at /tmp."""
    identity: tuple[int, int] | None = None
    """Host (uid, gid) bwrap drops to before it starts, so the sandbox's uid maps to it, not to
    the server's root (see `bastion.sandbox.identity`). None: the server's own (not root)."""
    command_groups: bool = False
    """Commands share the sandbox's PID namespace, the agent its PID 1, each command in a cgroup
    of its own (`bastion.sandbox.command_groups`); else each gets a PID namespace of its own."""
    host_folder: bool = False
    """`workspace` is a host workspace's folder, which other local users can reach: its processes start
    with a umask withholding others' write permission and may neither drop it nor chmod o+w
    (`seccomp.HOST_WORKSPACE_DENIED`). False: an agent sandbox's own folder, no one else's to reach."""
    read_only_paths: tuple[str, ...] = ()
    """Entries of `workspace` (relative, parents first) shown read-only to its commands where they exist with
    no link on the way when the sandbox starts, and pinned there (a mount point is neither moved nor removed):
    a host workspace's repository, which the folder's owner runs with git (`protect_git`, `repository`)."""
    sealed_paths: tuple[str, ...] = ()
    """Folders of `workspace` shown as empty read-only folders (made empty on the host if missing): a host
    workspace's submodule folders that do not exist, where the agent would make a repository of its own."""


# Joins the cgroups (none: "0"), then becomes bwrap (same pid; through setpriv when it drops to the
# sandbox's own identity), so bwrap and everything it forks start inside: attaching
# bwrap's pid after spawn would miss the children it forks at once. `echo` is the
# shell's builtin, so the shell itself moves ("0" = the writer).
# Only our own paths and argv reach it, as positional parameters: nothing is parsed.
_JOIN_LOOP: Final = """n=$1; shift
while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 126; shift; n=$((n - 1)); done
"""
_JOIN_CGROUPS: Final = _JOIN_LOOP + 'exec "$@"\n'

# A held start's step after the joins (`hold_sandbox`): its stdin is a pipe from the server, which writes
# "go" once the sandbox's folders are made (`release`); anything else (EOF: the server closed it, or died)
# ends the shell before bwrap runs. bwrap then gets /dev/null, as an unheld start's stdin.
_AWAIT_GO: Final = """IFS= read -r go && [ "$go" = go ] || exit 126
exec "$@" </dev/null
"""
_GO: Final = b"go\n"


# A sandbox's first step, before `_JOIN_CGROUPS` in the same shell: the open-file limit, soft then hard
# (a soft limit above the new hard one would be refused).
_LIMIT_OPEN_FILES: Final = """ulimit -S -n "$1" && ulimit -H -n "$2" || exit 126; shift 2
"""

OPEN_FILES_LIMIT: Final = (1024, 4096)
"""RLIMIT_NOFILE (soft, hard) of a sandbox's processes; the server's own where that is lower. Inherited, the
server's (20,000, or systemd's 65,536) let one process hold 1,500 netlink sockets whose queues no memory
cgroup counted. A hard limit only goes down without CAP_SYS_RESOURCE in the host's user namespace; a process
may raise its soft limit to 4096 (node does). Per process: a sandbox's whole count is this times its pids
limit, bounded in memory by its cgroup (an open file is charged to it)."""


def open_files_limit() -> tuple[int, int]:
    """`OPEN_FILES_LIMIT`, each lowered to this process's own limit where that is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want_soft, want_hard = OPEN_FILES_LIMIT
    new_hard = want_hard if hard == resource.RLIM_INFINITY else min(want_hard, hard)
    new_soft = want_soft if soft == resource.RLIM_INFINITY else min(want_soft, soft)
    return min(new_soft, new_hard), new_hard


NO_CORE_DUMPS: Final = (1, 1)
"""RLIMIT_CORE (soft, hard) of the server and so of every process a sandbox starts. A hard limit only goes
down without CAP_SYS_RESOURCE in the host's user namespace, so nothing inside can raise it. 1, not 0: a
core file needs at least a page, and the kernel skips a `core_pattern` pipe helper (systemd-coredump,
apport: root, on the host) for a limit of exactly 1, never for 0. The server holds tokens and keys: it
leaves no core either."""


def limit_core_dumps() -> None:
    """Lower this process's core-size limit to `NO_CORE_DUMPS` (before a sandbox starts: it is inherited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if (soft, hard) == NO_CORE_DUMPS or hard == 0:  # a hard 0 cannot be raised without privilege: no file cores
        return
    resource.setrlimit(resource.RLIMIT_CORE, NO_CORE_DUMPS)


def setpriv_argv(uid: int, gid: int) -> list[str]:
    """The command prefix that becomes `uid`:`gid` with no group, capability or way back.

    setpriv (util-linux, on every Debian) sets the real, effective and saved ids, so the
    kernel clears every capability (capabilities(7), "Effect of user ID changes");
    no_new_privs also stops a setuid program from giving them back.
    """
    found = shutil.which("setpriv", path=BWRAP_ENV["PATH"])
    if found is None:
        raise Unavailable("setpriv is not installed: run 'apt-get install util-linux'")
    return [
        found,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def bwrap_path() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise Unavailable("bubblewrap (bwrap) is not installed: run 'make install' or 'apt-get install bubblewrap'")
    return found


def probe_bwrap(args: Sequence[str], timeout_s: float = 10.0) -> tuple[int, str]:
    """Run bubblewrap once with `args`, for `bastion doctor`; no sandbox of the server's.

    Returns:
        Its exit status and the last line it printed (stderr first, then stdout).

    Raises:
        Unavailable: bwrap is missing, cannot be executed, or did not finish in time.
    """
    argv = [bwrap_path(), *args]
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, check=False, env=BWRAP_ENV
        )
    except subprocess.TimeoutExpired:
        raise Unavailable(f"bwrap did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise Unavailable(f"cannot run bwrap: {exc.strerror}") from None
    lines = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def sandbox_python() -> str:
    """An interpreter visible inside the sandbox for the agent.

    Prefer the system's /usr/bin/python3 (already bound); else the server's own
    base interpreter, whose install prefix is then bound read-only.
    """
    system = "/usr/bin/python3"
    if os.access(system, os.X_OK):
        return system
    return os.path.realpath(sys.executable)


def host_etc_fds() -> dict[str, int]:
    """Read-only fds of the host's /etc files a sandbox sees (`_RO_ETC_FILES`) that are regular,
    world-readable files of at most `_ETC_COPY_MAX_BYTES`, by path; the caller closes them. bwrap copies
    them in (`--file`): a bind costs it a read of the host's whole mount table, which grows with each open
    sandbox. Anything else stays a bind, which the sandbox's own id reads under the host's permissions."""
    fds: dict[str, int] = {}
    try:
        for path in _RO_ETC_FILES:
            copied = _etc_copy_fd(path)
            if copied is not None:
                fds[path] = copied
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _etc_copy_fd(path: str) -> int | None:
    """An fd to read `path` from, if it is to be copied in (`host_etc_fds`); else None.

    Looked at through an O_PATH fd first: the server is root, and opening a device node or a FIFO
    put at the path could act on it (a watchdog, a terminal) or wait; only a regular file is opened
    for reading, through that same fd (no second lookup of the path).
    """
    try:
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None  # absent: the bind list skips it too
    try:
        info = os.fstat(handle)
        if not (stat.S_ISREG(info.st_mode) and info.st_mode & stat.S_IROTH and info.st_size <= _ETC_COPY_MAX_BYTES):
            return None
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None
    finally:
        os.close(handle)


def system_binds() -> list[str]:
    """bwrap arguments showing the system's programs and libraries (/usr, /bin, /lib...) read-only, as in a
    sandbox: links stay links, folders are bound."""
    argv: list[str] = []
    for path in _RO_SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv


def _bind_system(argv: list[str], python: str, copied: Mapping[str, int]) -> None:
    argv += system_binds()
    for path in _RO_ETC_FILES:
        if path in copied:
            argv += ["--perms", "0444", "--file", str(copied[path]), path]
        elif os.path.exists(path):
            argv += ["--ro-bind", path, path]
    if not python.startswith("/usr/"):
        prefix = os.path.realpath(sys.base_prefix)
        argv += ["--ro-bind", prefix, prefix]


def build_bwrap_argv(
    spec: SandboxSpec,
    agent_fd: int,
    python: str,
    seccomp_fd: int,
    data_fds: Mapping[str, int] | None = None,
    etc_fds: Mapping[str, int] | None = None,
    read_only_fds: Mapping[str, int] | None = None,
) -> list[str]:
    """The bubblewrap command line of a warm sandbox running the agent.

    Namespaces: user (the agent's capabilities only reach the sandbox's own
    namespaces), mount, PID, IPC, UTS, cgroup and network (loopback only).
    `data_fds`: files to show read-only, by destination (their content is read from the fd); they
    must include `AGENT_PATH` (`inside_fds`). `etc_fds`: the host /etc files to copy in rather than
    bind, by path (`host_etc_fds`).
    """
    argv = [bwrap_path(), "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    argv += ["--die-with-parent", "--new-session", "--hostname", "bastion"]
    # The agent keeps CAP_SYS_ADMIN (to make a PID namespace per command without cgroups; with
    # them, holding it keeps ptrace and /proc/1/fd refused to commands) and CAP_SETPCAP (to
    # empty the bounding set), both confined to the sandbox's user namespace; it leaves
    # nothing a command could inherit (see inside/agent.py).
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
    _bind_system(argv, python, etc_fds or {})
    for dest, fd in (data_fds or {}).items():
        # Copied onto the root tmpfs, which is made read-only below: one bind each (--ro-bind-data) cost
        # bwrap a read of the host's whole mount table, a start ~1.3 ms, more with each open sandbox.
        # --file writes through whatever is at `dest` (creat, following links): every one must come
        # before the first writable bind, never beneath one, or it would write a host file.
        argv += ["--perms", "0600", "--file", str(fd), dest]
    argv += ["--proc", "/proc"]
    if spec.devices is not None:
        # A /dev of its own, in one bind (`_devices`): nodes instead of the host's, whose times a
        # write-access utimensat could change; /dev/shm and /dev/pts mounted in it. /tmp and /dev/shm
        # have caps on size and inodes, and outlive the agent (an idle sandbox sleeps without losing them).
        argv += ["--dev-bind", f"{spec.devices}/{DEV}", "/dev", "--bind", f"{spec.devices}/{SCRATCH[0]}", TMP_DIR]
    else:
        # A size cap only (bwrap has no inode option), and without it /dev/shm would have none.
        argv += ["--dev", "/dev"]
        argv += ["--size", str(spec.tmp_size_bytes), "--tmpfs", TMP_DIR]
        argv += ["--size", str(spec.shm_size_bytes), "--tmpfs", SHM_DIR]
    argv += ["--bind", spec.workspace, SANDBOX_WORKSPACE]
    for path, fd in (read_only_fds or {}).items():
        # By fd (`workspace_entry_fds`): a path would be resolved again by bwrap, following a link made meanwhile.
        argv += ["--ro-bind-fd", str(fd), f"{SANDBOX_WORKSPACE}/{path}"]
    for path in spec.sealed_paths:
        argv += ["--tmpfs", f"{SANDBOX_WORKSPACE}/{path}", "--remount-ro", f"{SANDBOX_WORKSPACE}/{path}"]
    for source, dest in spec.read_only_binds:
        argv += ["--ro-bind", source, dest]
    # Last of the mounts: bwrap's root tmpfs (/etc, /opt/bastion and the mount points) read-only, not
    # just out of Landlock's reach; it has no size or inode cap of its own. Not recursive: /tmp,
    # /dev and /workspace keep their own flags.
    argv += ["--remount-ro", "/"]
    argv += ["--chdir", SANDBOX_WORKSPACE, "--clearenv", "--setenv", "PATH", SANDBOX_PATH]
    # bwrap loads the filter just before it execs the agent: the agent and every command run under it.
    argv += ["--seccomp", str(seccomp_fd)]
    # With cgroups, commands share one PID namespace whose PID 1 is the agent itself (so
    # `ps`, `kill` and /proc agree on pids); without, each gets one of its own (inside/agent.py).
    if spec.command_groups:
        argv += ["--as-pid-1"]
    pids = SHARED_PIDS if spec.command_groups else PER_COMMAND_PIDS
    argv += ["--", python, "-I", "-S", AGENT_PATH, str(agent_fd), pids, SANDBOX_WORKSPACE, TMP_DIR]
    return argv


def _host_folder_umask() -> int:
    """This process's umask with S_IWOTH added: what a host workspace's processes start with.

    Read from /proc (Linux 4.7): umask(2) can only read the mask by setting it, which would
    race the server's other threads making files.
    """
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8) | stat.S_IWOTH
    raise Unavailable("/proc/self/status shows no umask: run bastion on Linux 4.7 or later")


def start_sandbox(spec: SandboxSpec) -> tuple[SandboxProcess, socket.socket]:
    """Start bwrap with the agent inside; return the process and the host's socket end."""
    return _spawn_sandbox(spec, go=None)


def hold_sandbox(spec: SandboxSpec) -> tuple[SandboxProcess, socket.socket, int]:
    """`start_sandbox`'s first step only: the process joins the sandbox's cgroups, then waits; bwrap runs once
    `release` is given the returned fd (the write end of its stdin), and never if that fd is closed unused.

    Why: the first write of a cgroup.procs after a quiet spell waits for an RCU grace period (the cgroup
    threadgroup lock's writer side: 6 ms median, 10 ms p90 measured here), which a held start spends while
    the caller makes the sandbox's folders, where an unheld one would add it to the start.
    """
    go_read, go_write = os.pipe2(os.O_CLOEXEC)
    try:
        proc, sock = _spawn_sandbox(spec, go=go_read)
    except BaseException:
        os.close(go_write)
        raise
    finally:
        os.close(go_read)
    return proc, sock, go_write


def release(go: int) -> None:
    """Let a held start (`hold_sandbox`) go on to bwrap, and close `go`. A start that ended meanwhile (its
    cgroup refused it) is not an error here: its agent never says hello, and the caller reports that."""
    try:
        os.write(go, _GO)  # 3 bytes into an empty pipe: never blocks, never split
    except OSError:
        pass
    finally:
        os.close(go)


def _spawn_sandbox(spec: SandboxSpec, go: int | None) -> tuple[SandboxProcess, socket.socket]:
    """Spawn the shell that joins the cgroups and becomes bwrap; with `go` (a pipe's read end), it waits for
    "go" on it first (`hold_sandbox`)."""
    limit_core_dumps()
    umask = _host_folder_umask() if spec.host_folder else -1  # -1: Popen keeps the server's
    seccomp_fd = write_filter_fd(HOST_WORKSPACE_DENIED if spec.host_folder else DENIED)
    data_fds: dict[str, int] = {}
    etc_fds: dict[str, int] = {}
    read_only_fds: dict[str, int] = {}
    args_fd = -1
    host_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        for dest, text in IDENTITY_FILES.items():
            data_fds[dest] = _data_fd(text)
        python = sandbox_python()
        # The agent and the egress forwarder are what a start waits for, and run on `python` itself.
        images = {dest: program_image(python, dest) for dest in (AGENT_PATH, FORWARDER_PATH)}
        data_fds |= inside_fds(images=images)
        etc_fds = host_etc_fds()
        read_only_fds = workspace_entry_fds(spec.workspace, spec.read_only_paths)
        full = build_bwrap_argv(spec, agent_end.fileno(), python, seccomp_fd, data_fds, etc_fds, read_only_fds)
        # bwrap is PID 1 inside, and /proc/1/cmdline is readable there: its options (host paths
        # of the workspace, the state folder, binds) go through a memfd, not the command line.
        # The command after "--" must stay on the real command line (bwrap takes it from there).
        split = full.index("--")
        args_fd = _data_fd("".join(arg + "\0" for arg in full[1:split]))
        argv = [full[0], "--args", str(args_fd), *full[split:]]
        if spec.identity is not None:
            argv = [*setpriv_argv(*spec.identity), *argv]
        argv = [
            "/bin/sh",
            "-c",
            _LIMIT_OPEN_FILES + (_JOIN_CGROUPS if go is None else _JOIN_LOOP + _AWAIT_GO),
            "bastion-join",
            *map(str, open_files_limit()),
            str(len(spec.cgroup_procs)),
            *spec.cgroup_procs,
            *argv,
        ]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL if go is None else go,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(
                agent_end.fileno(),
                seccomp_fd,
                args_fd,
                *data_fds.values(),
                *etc_fds.values(),
                *read_only_fds.values(),
            ),
            close_fds=True,
            start_new_session=True,
            env=BWRAP_ENV,
            umask=umask,
        )
    except OSError as exc:
        host_end.close()
        raise Unavailable(f"cannot start bubblewrap: {exc.strerror}") from exc
    except BaseException:  # e.g. Unavailable: no bwrap on PATH; the host end would leak
        host_end.close()
        raise
    finally:
        agent_end.close()
        for fd in (seccomp_fd, *data_fds.values(), *etc_fds.values(), *read_only_fds.values()):
            os.close(fd)
        if args_fd >= 0:
            os.close(args_fd)
    return proc, host_end


class LinkOnPath(Exception):
    """A component of a path is a symbolic link (its message: the path)."""


def open_beneath(root_fd: int, rel: str) -> int | None:
    """An O_PATH fd of `rel` (plain components, no '..') beneath `root_fd`, following no link; None if it does
    not exist. The caller closes it.

    Raises:
        LinkOnPath: a component of `rel` is a symbolic link.
    """
    fd = os.dup(root_fd)
    try:
        for part in rel.split("/"):
            try:
                child = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                return None
            os.close(fd)
            fd = child
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise LinkOnPath(rel)
        found, fd = fd, -1
        return found
    finally:
        if fd >= 0:
            os.close(fd)


def workspace_entry_fds(workspace: str, paths: Sequence[str]) -> dict[str, int]:
    """O_PATH fds of the entries `paths` (relative, plain components) of `workspace` that exist with no
    symbolic link on the way, by path; the caller closes them. A link is left alone: bwrap would bind what
    it leads to.

    Raises:
        Unavailable: the workspace folder cannot be opened.
    """
    fds: dict[str, int] = {}
    if not paths:
        return fds
    try:
        root = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unavailable(f"cannot open the workspace folder {workspace}: {exc.strerror}") from None
    try:
        for path in paths:
            try:
                fd = open_beneath(root, path)
            except (LinkOnPath, OSError):  # a link, or unreadable to the server: nothing to show read-only
                continue
            if fd is not None:
                fds[path] = fd
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        os.close(root)
    return fds


def inside_fds(*, images: Mapping[str, str | bytes] | None = None) -> dict[str, int]:
    """memfds of the programs bastion runs inside (`INSIDE_FILES`), by destination; the caller closes them.

    `images`: what to show at some destinations instead of their source (`program_image`).
    """
    fds: dict[str, int] = {}
    try:
        for dest, text in INSIDE_FILES.items():
            fds[dest] = _data_fd((images or {}).get(dest, text))
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def agent_image(python: str) -> str | bytes:
    """What `python` runs fastest at `AGENT_PATH` (`program_image`)."""
    return program_image(python, AGENT_PATH)


def program_image(python: str, dest: str) -> str | bytes:
    """What `python` runs fastest at `dest`: the program compiled here when that interpreter reads
    this one's bytecode (same magic number), else its source, which it would compile at every start
    (3 ms of CPU for the agent). Python runs a file as bytecode when it starts with its magic number,
    whatever its name (pythonrun.c, `maybe_pyc_file`), so the command line stays the same. Only for
    programs `python` itself runs: the code contexts' kernel and REPL may run on another Python."""
    try:
        st = os.stat(python)
    except OSError:
        return INSIDE_FILES[dest]
    if _bytecode_magic(python, st.st_ino, st.st_mtime_ns) != importlib.util.MAGIC_NUMBER:
        return INSIDE_FILES[dest]
    return _bytecode(dest)


@functools.cache
def _bytecode_magic(python: str, _ino: int, _mtime_ns: int) -> bytes | None:
    """The magic number of the bytecode `python` reads (asked once per binary: an upgrade asks again)."""
    probe = "import _frozen_importlib_external as b, sys; sys.stdout.write(b.MAGIC_NUMBER.hex())"
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", probe], capture_output=True, timeout=10, check=False, env=BWRAP_ENV
        )
        return bytes.fromhex(done.stdout.decode("ascii")) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


@functools.cache
def _bytecode(dest: str) -> bytes:
    """A .pyc image of a program: magic, flags 0, 8 unused bytes (a script's is not checked), the code."""
    code = compile(INSIDE_FILES[dest], dest, "exec", dont_inherit=True, optimize=0)
    return importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)


def _data_fd(text: str | bytes) -> int:
    """A memfd holding `text` (UTF-8 if a str), positioned at 0, for bwrap's --file and --args."""
    fd = os.memfd_create("bastion-data", os.MFD_CLOEXEC)
    view = memoryview(text.encode("utf-8") if isinstance(text, str) else text)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# The VMM's own python step, after setpriv and before QEMU (same pid): it loads the setuid/setgid
# part of the sandbox's seccomp filter (`seccomp.SETID_DENIED`, from the sealed memfd argv[1] names)
# and execs QEMU. QEMU's 9p server does what the guest asks as the sandbox's uid (security_model=none),
# so without it a guest's `chmod u+s` in the workspace made a setuid file on the host.
_VMM_PYTHON: Final = "/usr/bin/python3"
_VMM_SECCOMP: Final = """
import ctypes, os, sys
fd = int(sys.argv[1])
program = os.pread(fd, os.fstat(fd).st_size, 0)
os.close(fd)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
prog = Prog(len(program) // 8, program)
prctl = ctypes.CDLL(None, use_errno=True).prctl
one, filter_mode = ctypes.c_ulong(1), ctypes.c_ulong(2)
zero = ctypes.c_ulong(0)
if prctl(38, one, zero, zero, zero) != 0 or prctl(22, filter_mode, ctypes.byref(prog), zero, zero) != 0:
    sys.exit("bastion-vmm: cannot load the seccomp filter: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[2], sys.argv[2:])
"""


def start_vmm(argv: Sequence[str], *, identity: tuple[int, int] | None, cgroup_procs: Sequence[str]) -> SandboxProcess:
    """Start a VMM (`bastion.sandbox.microvm`): in the given cgroups from its first instruction,
    as `identity` when given (setpriv), killed if the server dies, in a session of its own, with
    only its argv and a bare PATH, under the seccomp filter's setuid/setgid rules (no_new_privs).
    Its stdout is a pipe (the guest's serial console, `-serial stdio`): a file there would be one the
    guest can grow on the host's disk without bound, and RLIMIT_FSIZE would cap its workspace's files too."""
    # Killed with the server (bwrap has --die-with-parent; QEMU has no such option): a guest must
    # never outlive the process that holds its channel and its cgroup.
    prefix = setpriv_argv(*identity) if identity is not None else [*setpriv_argv(0, 0)[:1], "--"]
    limit_core_dumps()
    filter_fd = write_filter_fd(SETID_DENIED)
    try:
        loader = [_VMM_PYTHON, "-I", "-S", "-c", _VMM_SECCOMP, str(filter_fd)]
        full = [*prefix[:-1], "--pdeathsig=KILL", "--", *loader, *argv]
        if cgroup_procs:
            full = ["/bin/sh", "-c", _JOIN_CGROUPS, "bastion-join", str(len(cgroup_procs)), *cgroup_procs, *full]
        return subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            pass_fds=(filter_fd,),
            start_new_session=True,
            env=BWRAP_ENV,
        )
    except OSError as exc:
        raise Unavailable(f"cannot start the VMM {argv[0]}: {exc.strerror}") from exc
    finally:
        os.close(filter_fd)
