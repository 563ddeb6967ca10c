"""Landlock inside a real bubblewrap sandbox: what the agent and its commands may still change.

Each probe runs the module's source with a probe script appended, as the agent
will (``python3 -I -S -c SRC``), inside bwrap with a writable /workspace and /tmp
and a /scratch tmpfs that uid 0 of the sandbox could write without Landlock. The
"none" probe runs the same script unrestricted, so every denial below is shown
to come from Landlock and not from bwrap. These prove the kernel boundary on
this kernel (ABI 7); forced lower ABIs prove the rulesets older kernels accept,
not their enforcement.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SRC_DIR = Path(__file__).resolve().parents[3] / "src" / "bastion" / "sandbox" / "inside"
MODULE_SOURCE = (SRC_DIR / "landlock.py").read_text(encoding="utf-8")
DENIED = {"EACCES", "EPERM"}
REPARENT_DENIED = {"EXDEV", "EACCES"}

PROBE = r"""
import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys


def attempt(fn):
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok"


def write(path):
    with open(path, "w") as f:
        f.write("x")


def read(path):
    with open(path, "rb") as f:
        f.read(4)


def fd_passing():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    socket.send_fds(a, [b"m"], [w])
    _data, fds, _flags, _addr = socket.recv_fds(b, 16, 1)
    os.write(fds[0], b"through")
    assert os.read(r, 16) == b"through"


def clone_newpid():
    libc = ctypes.CDLL(None, use_errno=True)
    number = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    pid = libc.syscall(ctypes.c_long(number), ctypes.c_long(0x20000000 | signal.SIGCHLD), *[ctypes.c_long(0)] * 4)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone")
    if pid == 0:
        os._exit(0 if os.getpid() == 1 else 3)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise OSError(errno.ESRCH, "child was not PID 1")


def mount_tmpfs():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/scratch/w", b"tmpfs", ctypes.c_ulong(0), None) != 0:
        raise OSError(ctypes.get_errno(), "mount")


def abstract_listener(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(name)
    s.listen(1)
    return s


def connect(name):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect(name)
    finally:
        c.close()


quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
os.mkdir("/scratch/w")
write("/scratch/w/f")
write("/scratch/pre")
os.mkdir("/workspace/d1")
os.mkdir("/workspace/d2")
write("/workspace/d1/a")
early = subprocess.Popen(["/bin/sleep", "30"], **quiet)
early_listener = abstract_listener("\0bastion-early")

mode = sys.argv[1]
info = None
if mode == "read-limited":
    info = restrict(["/workspace"], read_all=False)
elif mode != "none":
    if mode.startswith("abi="):
        forced = int(mode[4:])
        landlock_abi = lambda: forced  # noqa: E731 - restrict() looks the probe up by name
    info = restrict(["/workspace", "/tmp", "/scratch/w"])

r = {"info": info}
r["write_workspace"] = attempt(lambda: write("/workspace/x"))
r["write_tmp"] = attempt(lambda: write("/tmp/x"))
r["write_dev_shm"] = attempt(lambda: write("/dev/shm/x"))
r["write_scratch"] = attempt(lambda: write("/scratch/x"))
r["append_scratch_existing"] = attempt(lambda: open("/scratch/pre", "a").close())
r["truncate_scratch"] = attempt(lambda: os.truncate("/scratch/pre", 0))
r["read_scratch"] = attempt(lambda: read("/scratch/pre"))
r["list_scratch"] = attempt(lambda: os.listdir("/scratch"))
r["unlink_scratch"] = attempt(lambda: os.unlink("/scratch/pre"))
r["mkdir_scratch"] = attempt(lambda: os.mkdir("/scratch/d"))
r["symlink_scratch"] = attempt(lambda: os.symlink("/etc/passwd", "/scratch/s"))
r["mkfifo_scratch"] = attempt(lambda: os.mkfifo("/scratch/p"))
r["bind_socket_scratch"] = attempt(lambda: socket.socket(socket.AF_UNIX).bind("/scratch/sock"))
r["rename_out_of_workspace"] = attempt(lambda: os.rename("/workspace/x", "/scratch/x"))
r["link_out_of_write_dir"] = attempt(lambda: os.link("/scratch/w/f", "/scratch/l"))
r["rename_out_of_write_dir"] = attempt(lambda: os.rename("/scratch/w/f", "/scratch/f"))
r["rename_across_workspace_dirs"] = attempt(lambda: os.rename("/workspace/d1/a", "/workspace/d2/a"))
r["write_dev_null"] = attempt(lambda: write("/dev/null"))
r["write_dev_full"] = attempt(lambda: write("/dev/full"))
r["read_dev_urandom"] = attempt(lambda: read("/dev/urandom"))
r["open_dev_stderr_pipe"] = attempt(lambda: open("/dev/stderr", "w").close())
r["read_usr_bin_env"] = attempt(lambda: read("/usr/bin/env"))
r["exec_true"] = subprocess.run(["/bin/true"], **quiet).returncode
r["child_write_scratch"] = subprocess.run(["/bin/sh", "-c", "echo > /scratch/y"], **quiet).returncode
r["child_wrote_scratch"] = os.path.exists("/scratch/y")
r["chdir_workspace"] = attempt(lambda: os.chdir("/workspace/d2"))
r["fd_passing"] = attempt(fd_passing)
r["clone_newpid"] = attempt(clone_newpid)
r["kill_parent"] = attempt(lambda: os.kill(os.getppid(), 0))
r["kill_early_child"] = attempt(lambda: os.kill(early.pid, 0))
late = subprocess.Popen(["/bin/sleep", "30"], **quiet)
r["kill_late_child"] = attempt(lambda: os.kill(late.pid, signal.SIGKILL))
r["late_child_status"] = late.wait()
r["connect_abstract_early"] = attempt(lambda: connect("\0bastion-early"))
late_listener = abstract_listener("\0bastion-late")
r["connect_abstract_late"] = attempt(lambda: connect("\0bastion-late"))
r["mount_tmpfs"] = attempt(mount_tmpfs)
print(json.dumps(r))
"""


def bwrap_argv(workspace: Path, source: str, mode: str) -> list[str]:
    # The capabilities production's agent keeps (sandbox/_spawn.py), so the control runs
    # behave the same whether the tests run as root or as an unprivileged user.
    return [
        "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "0",
        "--gid",
        "0",
        "--die-with-parent",
        "--cap-add",
        "CAP_SYS_ADMIN",
        "--cap-add",
        "CAP_SETPCAP",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--bind",
        str(workspace),
        "/workspace",
        "--tmpfs",
        "/scratch",
        "--",
        "/usr/bin/python3",
        "-I",
        "-S",
        "-c",
        source,
        mode,
    ]


def run_probe(workspace: Path, mode: str) -> dict[str, Any]:
    proc = subprocess.run(
        bwrap_argv(workspace, MODULE_SOURCE + "\n" + PROBE, mode), capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    cache: dict[str, dict[str, Any]] = {}

    def get(mode: str) -> dict[str, Any]:
        if mode not in cache:
            cache[mode] = run_probe(tmp_path_factory.mktemp("ws"), mode)
        return cache[mode]

    return get


@pytest.fixture
def module() -> ModuleType:
    """The module loaded by path: the agent gets its source, never the bastion package."""
    spec = importlib.util.spec_from_file_location("bastion_landlock_under_test", SRC_DIR / "landlock.py")
    assert spec is not None
    assert spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


# -- without Landlock: the sandbox's root could change /scratch ---------------------------------------------


@pytest.mark.bwrap
def test_unrestricted_sandbox_root_can_write_scratch(probe: Callable[[str], dict[str, Any]]) -> None:
    """The control: every change denied below succeeds without restrict(), so Landlock is what denies it."""
    r = probe("none")
    for key in (
        "write_scratch",
        "append_scratch_existing",
        "truncate_scratch",
        "unlink_scratch",
        "mkdir_scratch",
        "symlink_scratch",
        "mkfifo_scratch",
        "bind_socket_scratch",
        "link_out_of_write_dir",
        "rename_out_of_write_dir",
        "kill_parent",
        "kill_early_child",
        "connect_abstract_early",
        "mount_tmpfs",
    ):
        assert r[key] == "ok", key
    assert r["child_wrote_scratch"] is True


# -- restrict(): what stays allowed -------------------------------------------------------------------------


@pytest.mark.bwrap
def test_restrict_applies_full_abi_with_scoping(probe: Callable[[str], dict[str, Any]]) -> None:
    r = probe("all")
    assert r["info"] == {"abi": r["info"]["abi"], "applied": True, "scoped": True, "warning": None}
    assert r["info"]["abi"] >= 6


@pytest.mark.bwrap
def test_restrict_keeps_write_dirs_and_devices_writable(probe: Callable[[str], dict[str, Any]]) -> None:
    r = probe("all")
    for key in (
        "write_workspace",
        "write_tmp",
        "write_dev_shm",
        "write_dev_null",
        "read_dev_urandom",
        "open_dev_stderr_pipe",
        "rename_across_workspace_dirs",
        "chdir_workspace",
    ):
        assert r[key] == "ok", key
    assert r["write_dev_full"] == "ENOSPC"  # opened for writing; the device itself refuses


@pytest.mark.bwrap
def test_restrict_keeps_what_the_agent_needs(probe: Callable[[str], dict[str, Any]]) -> None:
    """Reading and executing /usr, fd passing over socketpairs, clone(CLONE_NEWPID), signals to own children."""
    r = probe("all")
    assert r["read_usr_bin_env"] == "ok"
    assert r["read_scratch"] == "ok"
    assert r["list_scratch"] == "ok"
    assert r["exec_true"] == 0
    assert r["fd_passing"] == "ok"
    assert r["clone_newpid"] == "ok"
    assert r["kill_late_child"] == "ok"
    assert r["late_child_status"] == -9
    assert r["connect_abstract_late"] == "ok"


# -- restrict(): one test per escape ------------------------------------------------------------------------


@pytest.mark.bwrap
def test_restrict_refuses_writing_outside_write_dirs(probe: Callable[[str], dict[str, Any]]) -> None:
    """A new file, an existing file (append, truncate, unlink) outside write_dirs: all EACCES."""
    r = probe("all")
    for key in ("write_scratch", "append_scratch_existing", "truncate_scratch", "unlink_scratch"):
        assert r[key] == "EACCES", key


@pytest.mark.bwrap
def test_restrict_refuses_making_nodes_outside_write_dirs(probe: Callable[[str], dict[str, Any]]) -> None:
    r = probe("all")
    for key in ("mkdir_scratch", "symlink_scratch", "mkfifo_scratch", "bind_socket_scratch"):
        assert r[key] == "EACCES", key


@pytest.mark.bwrap
def test_restrict_refuses_rename_and_link_out_of_write_dir(probe: Callable[[str], dict[str, Any]]) -> None:
    """Reparenting from a write dir to a read-only place on the same tmpfs is refused.

    /workspace -> /scratch is also refused, but that is two mounts (EXDEV from the VFS
    whatever Landlock says); /scratch/w -> /scratch is one tmpfs, and the control
    probe shows it succeeds unrestricted.
    """
    r = probe("all")
    assert r["rename_out_of_workspace"] in REPARENT_DENIED
    assert r["rename_out_of_write_dir"] in REPARENT_DENIED
    assert r["link_out_of_write_dir"] in REPARENT_DENIED


@pytest.mark.bwrap
def test_restrict_is_inherited_by_exec_children(probe: Callable[[str], dict[str, Any]]) -> None:
    """A command the restricted process starts (fork + exec /bin/sh) cannot write /scratch either."""
    r = probe("all")
    assert r["child_write_scratch"] != 0
    assert r["child_wrote_scratch"] is False


@pytest.mark.bwrap
def test_restrict_scopes_signals_to_own_domain(probe: Callable[[str], dict[str, Any]]) -> None:
    """ABI 6: no signal (not even 0) to the unrestricted parent or to a child started before restrict().

    Children started after restrict() stay killable (test_restrict_keeps_what_the_agent_needs).
    """
    r = probe("all")
    assert r["kill_parent"] == "EPERM"
    assert r["kill_early_child"] == "EPERM"


@pytest.mark.bwrap
def test_restrict_scopes_abstract_unix_sockets(probe: Callable[[str], dict[str, Any]]) -> None:
    """ABI 6: no connect to an abstract socket bound outside the domain (even by the same process, earlier)."""
    assert probe("all")["connect_abstract_early"] == "EPERM"


@pytest.mark.bwrap
def test_restrict_forbids_mount(probe: Callable[[str], dict[str, Any]]) -> None:
    """Landlock forbids mount once a filesystem ruleset is in force: the agent must mount before restrict()."""
    assert probe("all")["mount_tmpfs"] == "EPERM"


@pytest.mark.bwrap
def test_restrict_read_limited_refuses_reads_elsewhere(probe: Callable[[str], dict[str, Any]]) -> None:
    """read_all=False: /usr, /dev and write_dirs stay readable; /scratch does not."""
    r = probe("read-limited")
    assert r["info"]["applied"] is True
    assert r["read_scratch"] == "EACCES"
    assert r["list_scratch"] == "EACCES"
    assert r["read_usr_bin_env"] == "ok"
    assert r["exec_true"] == 0
    assert r["read_dev_urandom"] == "ok"
    assert r["write_dev_null"] == "ok"
    assert r["write_workspace"] == "ok"
    assert r["write_tmp"] == "EACCES"


# -- older kernels ------------------------------------------------------------------------------------------


@pytest.mark.bwrap
@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5])
def test_restrict_on_older_abi_still_confines_writes_and_warns(
    probe: Callable[[str], dict[str, Any]], abi: int
) -> None:
    """The ruleset built for an older ABI is accepted and enforced; the result names what is missing.

    Run on a newer kernel with the probe forced lower: proves the attr sizes and
    rights each ABI accepts, not how an old kernel behaves.
    """
    r = probe(f"abi={abi}")
    assert r["info"]["abi"] == abi
    assert r["info"]["applied"] is True
    assert r["info"]["scoped"] is False
    assert "not scoped" in r["info"]["warning"]
    assert r["write_workspace"] == "ok"
    assert r["write_dev_null"] == "ok"
    assert r["write_scratch"] == "EACCES"
    assert r["child_wrote_scratch"] is False
    assert r["kill_parent"] == "ok"
    if abi == 1:
        assert r["rename_across_workspace_dirs"] == "EXDEV"  # ABI 1 cannot allow reparenting at all
    else:
        assert r["rename_across_workspace_dirs"] == "ok"
    assert r["truncate_scratch"] == ("EACCES" if abi >= 3 else "ok")


def test_landlock_abi_is_available_here(module: ModuleType) -> None:
    assert module.landlock_abi() >= 1


def test_restrict_without_landlock_returns_a_warning(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """ABI 0 degrades loudly: applied False and a warning for the caller to log, nothing raised."""
    monkeypatch.setattr(module, "landlock_abi", lambda: 0)
    result = module.restrict(["/workspace"])
    assert result["abi"] == 0
    assert result["applied"] is False
    assert result["scoped"] is False
    assert isinstance(result["warning"], str)
    assert "not applied" in result["warning"]


# -- the source is prepended to the agent's -----------------------------------------------------------------


def test_source_runs_on_python39_when_prepended() -> None:
    """No __future__ import (it would have to open the joined file), 3.9 grammar, no evaluated `X | Y`."""
    tree = ast.parse(MODULE_SOURCE, feature_version=(3, 9))
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in ast.walk(tree))
    evaluated: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            evaluated += [a.annotation for a in node.args.args + node.args.kwonlyargs if a.annotation]
            evaluated += [node.returns] if node.returns else []
    evaluated += [n.annotation for n in tree.body if isinstance(n, ast.AnnAssign)]
    assert not any(isinstance(n, ast.BinOp) for a in evaluated for n in ast.walk(a))
    imports = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for alias in n.names}
    assert imports <= set(sys.stdlib_module_names)


def test_source_names_do_not_collide_with_the_agent() -> None:
    """Prepended, a name the agent also binds would be silently rebound under restrict()."""

    def bound(source: str) -> set[str]:
        names: set[str] = set()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return names

    agent = (SRC_DIR / "agent.py").read_text(encoding="utf-8")
    assert bound(MODULE_SOURCE) & bound(agent) == set()
