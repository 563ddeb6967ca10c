"""What `_spawn` shows the sandbox: at /opt/bastion/agent.py bytecode when the interpreter reads ours, else
source; which host /etc files it copies in rather than binds."""

from __future__ import annotations

import importlib.util
import marshal
import os
import resource
import subprocess
from pathlib import Path

import pytest

from bastion.sandbox import _spawn
from bastion.sandbox._spawn import (
    AGENT_PATH,
    FORWARDER_PATH,
    IDENTITY_FILES,
    INSIDE_FILES,
    NETIF_SHIM_PATH,
    PROGRAMS_DIR,
    SANDBOX_NODE_OPTIONS,
    agent_image,
    program_image,
    sandbox_python,
)


@pytest.mark.parametrize(
    ("program", "names"),
    [(AGENT_PATH, {"restrict", "Agent"}), (FORWARDER_PATH, {"Relay", "Pair"})],
    ids=["agent", "forwarder"],
)
def test_a_program_is_bytecode_of_its_own_source_when_the_interpreter_reads_ours(program: str, names: set[str]) -> None:
    """Invariant: the image starts with this interpreter's magic number and holds the program's source
    compiled (the agent's with landlock.py's code in front), so the sandbox runs exactly what the source says."""
    python = sandbox_python()
    probe = "import _frozen_importlib_external as b, sys; sys.stdout.write(b.MAGIC_NUMBER.hex())"
    theirs = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True).stdout
    image = program_image(python, program)
    if bytes.fromhex(theirs) != importlib.util.MAGIC_NUMBER:
        assert image == INSIDE_FILES[program]
        return
    assert isinstance(image, bytes)
    assert image[:4] == importlib.util.MAGIC_NUMBER
    code = marshal.loads(image[16:])
    assert code.co_code == compile(INSIDE_FILES[program], program, "exec", dont_inherit=True).co_code
    assert names <= set(code.co_names)
    assert agent_image(python) == program_image(python, AGENT_PATH)


def test_agent_is_source_for_an_interpreter_that_cannot_say_its_magic(tmp_path: Path) -> None:
    """Invariant: an interpreter that does not answer the probe (another version, a broken binary)
    gets the source, which any Python 3 compiles, never bytecode it might misread."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert agent_image(str(fake)) == INSIDE_FILES[AGENT_PATH]
    assert agent_image(str(tmp_path / "missing")) == INSIDE_FILES[AGENT_PATH]


# What the agent and the forwarder may load as they start: modules written in C only (built in or extensions), whose
# import is a lookup or a dlopen; a Python module (ctypes, os, struct...) costs ms at every start.
IMPORT_PROBE = """
import sys
before = set(sys.modules)
exec(compile(sys.stdin.read(), "program", "exec"), {"__name__": "program"})
for name in sorted(set(sys.modules) - before):
    origin = sys.modules[name].__spec__.origin
    print(name, "C" if origin == "built-in" or origin.endswith(".so") else origin)
"""


@pytest.mark.parametrize(
    ("program", "own"), [(AGENT_PATH, "_ctypes"), (FORWARDER_PATH, "select")], ids=["agent", "forwarder"]
)
def test_a_program_the_sandbox_waits_for_loads_no_python_module_as_it_starts(program: str, own: str) -> None:
    """Invariant: importing the agent's image (landlock.py's code in front, main not run), or the
    egress forwarder's, in the sandbox's interpreter as `_spawn` starts them, loads only built-in or
    extension modules: each sandbox's start (and, with a network, its forwarder's) waits for them."""
    done = subprocess.run(
        [sandbox_python(), "-I", "-S", "-c", IMPORT_PROBE],
        input=INSIDE_FILES[program],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = dict(line.split() for line in done.stdout.splitlines())
    assert own in loaded  # the probe sees the program's own imports
    assert set(loaded.values()) == {"C"}, loaded


def test_fifo_or_device_at_an_etc_path_is_not_opened_and_stays_a_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: a FIFO, a folder or a device node (here /dev/null) where a host /etc file the sandbox sees
    should be. Invariant: the root server never opens it for reading (a FIFO would hold the start, a device
    could act), it is not copied, and bwrap binds it as before."""
    fifo, folder, plain = tmp_path / "fifo", tmp_path / "folder", tmp_path / "plain"
    os.mkfifo(fifo)
    folder.mkdir()
    plain.write_text("x = 1\n")
    paths = (str(fifo), str(folder), "/dev/null", str(plain), str(tmp_path / "absent"))
    monkeypatch.setattr(_spawn, "_RO_ETC_FILES", paths)
    fds = _spawn.host_etc_fds()
    try:
        assert list(fds) == [str(plain)]
        assert os.read(fds[str(plain)], 100) == b"x = 1\n"
        argv: list[str] = []
        _spawn._bind_system(argv, "/usr/bin/python3", fds)
        assert ["--ro-bind", str(fifo), str(fifo)] == argv[argv.index(str(fifo)) - 1 : argv.index(str(fifo)) + 2]
        assert ["--perms", "0444", "--file", str(fds[str(plain)]), str(plain)] == argv[-5:]
        assert str(tmp_path / "absent") not in argv
    finally:
        for fd in fds.values():
            os.close(fd)


def test_large_etc_file_is_bound_not_copied_into_each_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant: a host /etc file over the copy cap is bound (no copy of it in every sandbox's memory);
    one at the cap is copied."""
    big, at_cap = tmp_path / "big", tmp_path / "at_cap"
    big.write_bytes(b"x" * (_spawn._ETC_COPY_MAX_BYTES + 1))
    at_cap.write_bytes(b"x" * _spawn._ETC_COPY_MAX_BYTES)
    monkeypatch.setattr(_spawn, "_RO_ETC_FILES", (str(big), str(at_cap)))
    fds = _spawn.host_etc_fds()
    try:
        assert list(fds) == [str(at_cap)]
    finally:
        for fd in fds.values():
            os.close(fd)


def test_etc_file_the_sandbox_could_not_read_is_bound_not_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: a host /etc file (or a link's target) readable by its owner only. Invariant: the root server
    does not copy it in world-readable; it stays a bind, which the sandbox's own id reads under the host's
    permissions (refused), as before copies existed."""
    private, public = tmp_path / "private", tmp_path / "public"
    private.write_text("TOPSECRET\n")
    private.chmod(0o600)
    public.write_text("ok\n")
    public.chmod(0o644)
    link = tmp_path / "link"
    link.symlink_to(private)
    monkeypatch.setattr(_spawn, "_RO_ETC_FILES", (str(private), str(link), str(public)))
    fds = _spawn.host_etc_fds()
    try:
        assert list(fds) == [str(public)]
    finally:
        for fd in fds.values():
            os.close(fd)


def test_open_files_limit_is_bounded_and_never_above_the_servers() -> None:
    """Attack (found by attack): a sandbox inherited the server's open-file limit (20,000) and one process held
    1,500 netlink sockets. Invariant: a sandbox starts with `OPEN_FILES_LIMIT` (1024 soft, 4096 hard), or the
    server's own soft limit where that is lower (a hard limit is never asked above the server's). The limit in
    a real sandbox, and that it cannot be raised, is tested in tests/attacks/test_kernel_attacks.py."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < _spawn.OPEN_FILES_LIMIT[1]:
        pytest.skip(f"the hard limit on open files is {hard}: below the sandbox's")
    assert _spawn.open_files_limit() == (min(1024, soft), 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert _spawn.open_files_limit() == (512, 4096)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_node_shim_ships_where_the_default_node_options_name_it() -> None:
    """Invariant: the sandbox's default NODE_OPTIONS preloads exactly the file `_spawn` shows under /opt/bastion
    (as it shows the agent: bwrap copies it in read-only; a microVM's relay writes it), holding inside/netif.js.
    A missing file would make every node command fail ("Cannot find module"). That it works is tested in
    tests/sandbox/test_seccomp.py and tests/attacks/test_kernel_attacks.py."""
    source = Path(_spawn.__file__).parent / "inside" / "netif.js"
    assert SANDBOX_NODE_OPTIONS.removeprefix("--require=") == NETIF_SHIM_PATH
    assert NETIF_SHIM_PATH.startswith(f"{PROGRAMS_DIR}/")
    assert INSIDE_FILES[NETIF_SHIM_PATH] == source.read_text(encoding="utf-8")


def test_hosts_file_names_loopback_only() -> None:
    """Invariant: the sandbox's /etc/hosts (written like /etc/passwd) names localhost for loopback and nothing
    of the host's; localhost's first line is 127.0.0.1, the address a preview connects to."""
    lines = [line.split() for line in IDENTITY_FILES["/etc/hosts"].splitlines()]
    assert lines == [["127.0.0.1", "localhost"], ["::1", "localhost", "ip6-localhost", "ip6-loopback"]]


@pytest.mark.bwrap
@pytest.mark.parametrize(
    "given", [None, b"no\n", b"gone\n", b"go"], ids=["closed", "other-word", "longer", "no-newline"]
)
def test_a_held_start_not_told_go_exits_before_bubblewrap(tmp_path: Path, given: bytes | None) -> None:
    """Attack on the held start (the server closed, died, or wrote something else): its shell waits on a pipe
    between joining the cgroups and running bwrap. Invariant: anything but the exact line "go" (EOF, another
    word, an unfinished line) ends it with status 126, and bwrap never runs (its agent never says hello)."""
    proc, sock, go = _spawn.hold_sandbox(_spawn.SandboxSpec(workspace=str(tmp_path)))
    try:
        if given is not None:
            os.write(go, given)
        os.close(go)
        assert proc.wait(timeout=20) == 126
        assert sock.recv(4096) == b""
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.bwrap
def test_a_held_start_told_go_runs_the_agent_in_folders_made_after_it_began(tmp_path: Path) -> None:
    """The held start's point: the workspace may be made while the shell waits. Invariant: once released, bwrap
    binds what exists then and the agent says hello."""
    workspace = tmp_path / "made-later"
    proc, sock, go = _spawn.hold_sandbox(_spawn.SandboxSpec(workspace=str(workspace)))
    try:
        workspace.mkdir()
        _spawn.release(go)
        sock.settimeout(20)
        assert b'"ready"' in sock.recv(65536)
    finally:
        sock.close()
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
