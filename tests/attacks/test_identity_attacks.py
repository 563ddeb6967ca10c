"""Identity attacks (issue 12): setuid files planted on the host, host /dev nodes changed, one
sandbox reaching another's files, all tried through the real tools over the real MCP client,
against a real root server and real bubblewrap.

Each technique runs in the demo's host workspace (``default``, the demo command policy), in a
root-owned host workspace whose policy allows every program (``open``: the kernel layers must
hold when the policy does not stand in the way), in a host workspace owned by an ordinary user
(``user``, uid 12345), and in an agent sandbox made with ``create_sandbox``. After each test,
nothing under the test's folder (every workspace folder, the state folder with every sandbox's
folder, snapshots and idmapped mounts, the shared folder) has S_ISUID or S_ISGID, and the host's
/dev/null, zero, full, random, urandom and tty have the mode, owner, group, device number,
mtime, ctime and extended attributes they had before.

What this does not prove: that no other technique works (these are the ones thought of: every
syscall that takes a mode, on both x86 ABIs, and the programs that preserve modes), anything
about a kernel bug, a server run as an ordinary user, or a config other than the one below.
Where several layers would refuse (the policy, seccomp, the unprivileged identity, Landlock,
nosuid), the test names the one seen: the errno each layer answers differs.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import io
import itertools
import json
import os
import shlex
import shutil
import stat
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import Config, load_config
from tests.helpers import DATA_ENV, call, create, demo_config_at, sh

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="the identity layer is a root server's: run as root"),
]

DEFAULT, OPEN, USER = "default", "open", "user"  # the host workspaces of the config below
ORDINARY = 12345  # the owner of the `user` workspace folder: an ordinary host user
SHARED_DEST = "/shared"
SETID = stat.S_ISUID | stat.S_ISGID
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
EPERM_TEXT = "Operation not permitted"
# Ids of this test process's own within the default range's neighbourhood: servers of other test
# runs on this machine start at the default's first id, and ids are not coordinated across servers.
HOST_ID_RANGE = f"{0x70000000 + 0x10000 * (1 + os.getpid() % 0x7FF)}:65536"


def with_range(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count("[sandboxes]\n") == 1, "the demo config no longer has one [sandboxes] section"
    path.write_text(
        text.replace("[sandboxes]\n", f"[sandboxes]\nhost_id_range = {HOST_ID_RANGE!r}\n"), encoding="utf-8"
    )


@pytest.fixture
def demo_config_path(tmp_path: Path) -> Path:
    """The demo config, plus two host workspaces that allow every program (one root's, one an
    ordinary user's) and a template that binds `shared/` read-only at /shared."""
    path = demo_config_at(tmp_path / "demo", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)
    with_range(path)
    (path.parent / OPEN).mkdir()
    (path.parent / USER).mkdir()
    os.chown(path.parent / USER, ORDINARY, ORDINARY)
    shared = tmp_path / "shared"
    shared.mkdir()
    extra = f"""
[[workspace]]
id = "{OPEN}"
path = "{OPEN}"
[workspace.policy]
allow = ["*"]

[[workspace]]
id = "{USER}"
path = "{USER}"
[workspace.policy]
allow = ["*"]

[[template]]
name = "shared"
read_only = [{{ source = {json.dumps(str(shared))}, dest = "{SHARED_DEST}" }}]
"""
    path.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")
    return path


# -- what must hold after every test -------------------------------------------------------------


def dev_state() -> dict[str, tuple[object, ...]]:
    """What a sandbox must not change about the host's /dev nodes (atime left out: reading
    a node may move it, and no attack here needs it). /dev/tty's mtime is left out too: the
    tty layer sets it when anyone on the host writes to a terminal opened through it (a test
    of another worker, a shell), while a chmod, chown or xattr still moves its ctime."""
    state: dict[str, tuple[object, ...]] = {}
    for path in DEV_NODES:
        info = os.stat(path)
        state[path] = (
            stat.filemode(info.st_mode),
            info.st_uid,
            info.st_gid,
            info.st_rdev,
            None if path == "/dev/tty" else info.st_mtime_ns,
            info.st_ctime_ns,
            tuple(sorted(os.listxattr(path))),
        )
    return state


def _raise(error: OSError) -> None:
    raise error


def setid_entries(root: Path) -> list[str]:
    """Every entry at or under `root` with S_ISUID or S_ISGID (lstat: no link is followed)."""
    found = []
    if os.lstat(root).st_mode & SETID:
        found.append(str(root))
    for folder, dirs, files in os.walk(root, onerror=_raise, followlinks=False):
        for name in (*dirs, *files):
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            if mode & SETID:
                found.append(f"{path} {stat.filemode(mode)}")
    return found


def assert_host_intact(config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]) -> None:
    """No setuid or setgid entry anywhere in the test's folder, which holds every workspace, the
    state folder (sandbox folders, idmapped mounts, snapshots) and the shared folder; the host's
    /dev nodes unchanged."""
    for folder in (config.state_dir, config.sandboxes_dir, *(ws.path for ws in config.workspace)):
        assert folder.resolve().is_relative_to(tmp_path.resolve()), folder
    assert setid_entries(tmp_path) == []
    assert dev_state() == dev_before


@pytest.fixture
def dev_before() -> dict[str, tuple[object, ...]]:
    """The host's /dev nodes before the test's attacks."""
    return dev_state()


# -- helpers -------------------------------------------------------------------------------------


def detail(payload: dict[str, object]) -> dict[str, Any]:
    found = payload["detail"]
    assert isinstance(found, dict), payload
    return found


def ran(payload: dict[str, object]) -> dict[str, Any]:
    """The detail of a command the policy let run."""
    assert payload["ok"], payload
    return detail(payload)


def host_folder(config: Config, where: str) -> Path:
    """The host folder behind a workspace id or a sandbox id."""
    workspace = config.workspace_by_id(where)
    return workspace.path if workspace is not None else config.sandboxes_dir / where / "workspace"


async def run_script(client: Client, where: str, name: str, script: str, *args: str) -> dict[str, Any]:
    """Write `script` to `name` with write_file and run it with sh (a program the `*` policies and
    every sandbox allow; a host workspace's command line is an argv of one line, no shell)."""
    written = await call(client, "write_file", path=name, content=script, sandbox_id=where)
    assert written["ok"], written
    return ran(await sh(client, where, shlex.join(("sh", name, *args))))


async def run_python(client: Client, where: str, name: str, source: str) -> dict[str, Any]:
    """Write `source` to `name` and run it with the sandbox's python3 (isolated, no site)."""
    written = await call(client, "write_file", path=name, content=source, sandbox_id=where)
    assert written["ok"], written
    return ran(await sh(client, where, shlex.join(("python3", "-I", "-S", name))))


def mode_of(path: Path) -> int:
    return os.lstat(path).st_mode & 0o7777


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def put(client: Client, where: str, path: str, data: bytes) -> None:
    """upload_file, new file."""
    payload = await call(client, "upload_file", path=path, content_base64=b64(data), sandbox_id=where)
    assert payload["ok"], payload


def syscall_numbers() -> dict[str, int]:
    """This machine's x86_64 numbers from libseccomp's table (the probe's raw syscalls).
    setxattrat (463, Linux 6.13) is newer than Debian 12's libseccomp: its number is written out."""
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    names = ("chmod", "fchmod", "fchmodat", "fchmodat2", "open", "creat", "openat2", "mkdir", "mkdirat", "mknodat")
    numbers = {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in (*names, "io_uring_setup")}
    assert all(nr >= 0 for nr in numbers.values()), numbers
    numbers["setxattrat"] = 463
    numbers["x32_chmod"] = 0x40000000 | numbers["chmod"]  # the x32 ABI's bit on x86_64's chmod
    return numbers


# -- 1. archives that carry setuid and setgid modes -----------------------------------------------

TRUE_ELF = Path("/usr/bin/true").read_bytes()
# name -> mode in the archive; each must be extracted, without the bits.
ARCHIVE_MEMBERS = {"suid": 0o4755, "sgid": 0o2755, "both": 0o6755, "sgiddir": 0o2775, "sgiddir/inner": 0o4711}


def setid_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, mode in ARCHIVE_MEMBERS.items():
            member = tarfile.TarInfo(name)
            member.mode, member.uid, member.gid, member.mtime = mode, 0, 0, 1_700_000_000
            if name == "sgiddir":
                member.type = tarfile.DIRTYPE
                archive.addfile(member)
            else:
                member.size = len(TRUE_ELF)
                archive.addfile(member, io.BytesIO(TRUE_ELF))
    return buffer.getvalue()


def setid_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, mode in ARCHIVE_MEMBERS.items():
            info = zipfile.ZipInfo(name + ("/" if name == "sgiddir" else ""), (2024, 1, 1, 0, 0, 0))
            info.create_system = 3  # unix: unzip reads the mode from the high half
            kind = stat.S_IFDIR if name == "sgiddir" else stat.S_IFREG
            info.external_attr = (kind | mode) << 16
            archive.writestr(info, b"" if name == "sgiddir" else TRUE_ELF)
    return buffer.getvalue()


def assert_extracted_without_setid(folder: Path, technique: str) -> None:
    """Every member is there (the technique really ran), and none kept S_ISUID or S_ISGID."""
    for name in ARCHIVE_MEMBERS:
        path = folder / name
        assert path.exists(), f"{technique}: {name} was not extracted"
        got = mode_of(path)
        assert got & SETID == 0, f"{technique}: {name} is {oct(got)} on the host"
        if name != "sgiddir":
            assert path.read_bytes() == TRUE_ELF, f"{technique}: {name} was not extracted whole"


EXTRACT_SCRIPT = """
mkdir t1 t2 t3 t4
tar -xpf x.tar -C t1; echo "tar_xp $?"
tar --same-permissions -xf x.tar -C t2; echo "tar_same_permissions $?"
python3 -I -S -c "import tarfile; tarfile.open('x.tar').extractall('t3')"; echo "python_tarfile $?"
unzip -K -q x.zip -d t4; echo "unzip_K $?"
"""


async def test_setuid_archive_extracted_with_modes_kept_leaves_no_setuid_file(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: tar -xpf, tar --same-permissions, Python's tarfile and unzip -K of archives whose
    members are 4755, 2755, 6755 (files) and 2775 (a folder) extract every member without S_ISUID
    or S_ISGID, seen from the host, in each host workspace and in an agent sandbox; tar reports
    the refused chmod (EPERM from the seccomp mode filter). In the demo policy's workspace python3
    and unzip are refused by the policy, tar runs. Does not prove anything about archive formats
    not tried here (cpio, rpm, 7z: none is installed)."""
    box = await create(client)
    for where in (DEFAULT, OPEN, USER, box):
        await put(client, where, "x.tar", setid_tar())
        await put(client, where, "x.zip", setid_zip())

    # The demo policy: tar runs (no shell), python3 and unzip do not.
    for folder in ("t1", "t2"):
        ran(await sh(client, DEFAULT, f"mkdir {folder}"))
    for technique, command in (
        ("tar -xpf", "tar -xpf x.tar -C t1"),
        ("tar --same-permissions", "tar --same-permissions -xf x.tar -C t2"),
    ):
        out = ran(await sh(client, DEFAULT, command))
        assert out["exit_status"] == 2, (technique, out)
        assert "Cannot change mode to rwsr-xr-x: Operation not permitted" in out["stderr"], (technique, out)
    for command in ("python3 -c 'import tarfile'", "unzip -K x.zip -d t4"):
        refused = await sh(client, DEFAULT, command)
        assert refused["code"] == "POLICY_DENIED", refused
    workspace = host_folder(demo_config, DEFAULT)
    assert_extracted_without_setid(workspace / "t1", "default: tar -xpf")
    assert_extracted_without_setid(workspace / "t2", "default: tar --same-permissions")

    # Every program allowed: the kernel layers alone.
    for where in (OPEN, USER, box):
        out = await run_script(client, where, "extract.sh", EXTRACT_SCRIPT)
        status = dict(line.split() for line in out["stdout"].splitlines())
        assert status == {"tar_xp": "2", "tar_same_permissions": "2", "python_tarfile": "0", "unzip_K": "1"}, out
        assert "tar: suid: Cannot change mode to rwsr-xr-x: Operation not permitted" in out["stderr"], out
        assert "fchmod (file attributes) error: Operation not permitted" in out["stderr"], out  # unzip
        extracted = host_folder(demo_config, where)
        for name, technique in (
            ("t1", "tar -xpf"),
            ("t2", "tar --same-permissions"),
            ("t3", "tarfile"),
            ("t4", "unzip -K"),
        ):
            assert_extracted_without_setid(extracted / name, f"{where}: {technique}")

    assert_host_intact(demo_config, tmp_path, dev_before)


# -- 2. a setuid binary copied in, then rewritten ---------------------------------------------------

COPY_SCRIPT = """
cp -p /usr/bin/passwd pw; echo "cp_p $?"
cp -a /usr/bin/passwd pwa; echo "cp_a $?"
cp --preserve=mode /usr/bin/passwd pwm; echo "cp_preserve_mode $?"
"""
# A command writing into a setuid file the host left in the workspace.
WRITE_SCRIPT = """
printf x >> cmd_append; echo "append $?"
truncate -s 0 cmd_truncate; echo "truncate $?"
"""
PLANTED = {"planted_write": 0o4755, "planted_upload": 0o6755, "planted_append": 0o2755}
PLANTED_FOR_COMMANDS = {"cmd_append": 0o4755, "cmd_truncate": 0o6755}


def plant(folder: Path, modes: dict[str, int]) -> tuple[int, int]:
    """As the host: setuid/setgid copies of `true`, owned by the folder's owner (who may do that
    in their own folder). Returns that owner."""
    info = os.stat(folder)
    for name, mode in modes.items():
        path = folder / name
        path.write_bytes(TRUE_ELF)
        os.chown(path, info.st_uid, info.st_gid)
        os.chmod(path, mode)
        assert mode_of(path) == mode
    return info.st_uid, info.st_gid


async def test_setuid_binary_copied_in_then_rewritten_is_not_setuid(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: cp -p, cp -a and cp --preserve=mode of the host's setuid-root passwd give a file
    without S_ISUID, and write_file or upload_file over it with another ELF leave it so (the
    demo policy allows cp; so do the others). A setuid or setgid file the host itself left in a
    workspace loses both bits when write_file, write_file(append) or upload_file(overwrite)
    writes it (the tool clears them before writing), and when a command appends to it, truncates
    it or writes it through a shared mapping (the kernel clears them for a writer without
    CAP_FSETID). Owner and group stay the folder owner's. Does not prove what an ordinary user
    would do with a setuid file of their own: the planted files are only the precondition; nor
    anything about a write through a shared mapping (next test)."""
    box = await create(client)
    copies = ("pw", "pwa", "pwm")

    # cp -p and -a drop the bits silently when they cannot keep the owner; --preserve=mode asks
    # for the mode itself and reports the refused chmod.
    for command, status in (
        ("cp -p /usr/bin/passwd pw", 0),
        ("cp -a /usr/bin/passwd pwa", 0),
        ("cp --preserve=mode /usr/bin/passwd pwm", 1),
    ):
        out = ran(await sh(client, DEFAULT, command))
        assert out["exit_status"] == status, out
    assert f"preserving permissions for \u2018pwm\u2019: {EPERM_TEXT}" in out["stderr"], out
    for where in (OPEN, USER, box):
        out = await run_script(client, where, "copy.sh", COPY_SCRIPT)
        assert out["stdout"].split() == ["cp_p", "0", "cp_a", "0", "cp_preserve_mode", "1"], out
        assert f"preserving permissions for \u2018pwm\u2019: {EPERM_TEXT}" in out["stderr"], out
    for where in (DEFAULT, OPEN, USER, box):
        folder = host_folder(demo_config, where)
        owner = os.stat(folder).st_uid, os.stat(folder).st_gid
        for name in copies:
            info = os.lstat(folder / name)
            assert (folder / name).read_bytes() == Path("/usr/bin/passwd").read_bytes(), (where, name)
            assert info.st_mode & SETID == 0, f"{where}: {name} is {stat.filemode(info.st_mode)} on the host"
            assert (info.st_uid, info.st_gid) == owner, (where, name)
        written = await call(
            client, "write_file", path="pw", content=b64(TRUE_ELF), encoding="base64", sandbox_id=where
        )
        assert written["ok"], written
        uploaded = await call(
            client, "upload_file", path="pwa", content_base64=b64(TRUE_ELF), overwrite=True, sandbox_id=where
        )
        assert uploaded["ok"], uploaded
        for name in ("pw", "pwa"):
            assert (folder / name).read_bytes() == TRUE_ELF, (where, name)
            assert mode_of(folder / name) & SETID == 0, (where, name, oct(mode_of(folder / name)))

    # The host's own setuid files, written by the file tools.
    for where in (DEFAULT, OPEN, USER, box):
        folder = host_folder(demo_config, where)
        owner = plant(folder, PLANTED)
        tools = (
            await call(
                client, "write_file", path="planted_write", content=b64(TRUE_ELF), encoding="base64", sandbox_id=where
            ),
            await call(
                client,
                "upload_file",
                path="planted_upload",
                content_base64=b64(b"new"),
                overwrite=True,
                sandbox_id=where,
            ),
            await call(client, "write_file", path="planted_append", content="more", append=True, sandbox_id=where),
        )
        assert all(result["ok"] for result in tools), tools
        expected = {"planted_write": TRUE_ELF, "planted_upload": b"new", "planted_append": TRUE_ELF + b"more"}
        for name, content in expected.items():
            info = os.lstat(folder / name)
            assert info.st_mode & SETID == 0, f"{where}: the tool left {name} {stat.filemode(info.st_mode)}"
            assert info.st_mode & 0o777 == PLANTED[name] & 0o777, (where, name, oct(info.st_mode))
            assert (info.st_uid, info.st_gid) == owner, (where, name)
            assert (folder / name).read_bytes() == content, (where, name)

    # The host's own setuid files, written by commands (every program allowed).
    for where in (OPEN, USER, box):
        folder = host_folder(demo_config, where)
        plant(folder, PLANTED_FOR_COMMANDS)
        out = await run_script(client, where, "write.sh", WRITE_SCRIPT)
        assert out["stdout"].split() == ["append", "0", "truncate", "0"], out
        for name in PLANTED_FOR_COMMANDS:
            got = mode_of(folder / name)
            assert got & SETID == 0, f"{where}: a command wrote {name} and it is still {oct(got)} on the host"

    assert_host_intact(demo_config, tmp_path, dev_before)


MMAP_WRITE = """
import mmap, os
fd = os.open("cmd_mmap", os.O_RDWR)
with mmap.mmap(fd, 4) as mapping:
    mapping[:4] = b"EVIL"
    mapping.flush()
"""


@pytest.mark.xfail(
    strict=True,
    reason="THROUGH: Linux (6.18, ext4) clears S_ISUID/S_ISGID on write(2) and truncate(2) but not on a write "
    "through a shared mapping; a setuid file the host puts in a workspace while the server runs (the start-time "
    "refusal sees only those there at start) keeps its bit with the agent's bytes",
)
async def test_host_planted_setuid_file_rewritten_through_a_shared_mapping_loses_its_bit(
    client: Client, demo_config: Config
) -> None:
    """Invariant wanted: a setuid or setgid file the host left in a workspace cannot get the
    agent's bytes and keep its bit. Seen: a command that maps it MAP_SHARED and writes the mapping
    changes its content and the bit stays, in every workspace and in a sandbox (whose disk is
    mounted nosuid, but a host workspace's folder is not); in the root-owned `open` workspace
    that is a setuid-root file with the agent's bytes. The precondition is the host's own
    setuid file in the workspace, put there after the server started (a root server refuses a
    workspace that holds one at start): no command or tool here can make one (the other tests)."""
    box = await create(client)
    planted: list[Path] = []
    try:
        for where in (OPEN, USER, box):
            folder = host_folder(demo_config, where)
            plant(folder, {"cmd_mmap": 0o4755})
            planted.append(folder / "cmd_mmap")
            out = await run_python(client, where, "mmap_write.py", MMAP_WRITE)
            assert out["exit_status"] == 0, out
            assert (folder / "cmd_mmap").read_bytes()[:4] == b"EVIL", where
        kept = {str(path): oct(mode_of(path)) for path in planted if mode_of(path) & SETID}
        assert kept == {}, f"written through a mapping, still setuid on the host: {kept}"
    finally:
        for path in planted:  # leave no setuid file in the kept temp folders
            os.chmod(path, 0o644)


# -- 3. every syscall that takes a mode, and the programs that set one -------------------------------

# Runs inside: makes `f` and `d` in a fresh folder (argv[2]), tries each way to give something
# S_ISUID or S_ISGID, and prints {attempt: [outcome (OK or an errno name), mode afterwards]}.
# Raw syscalls by the x86_64 numbers in argv[1] (a JSON file), 32-bit ones through int 0x80
# (the i386 ABI's own numbers, arguments in a page below 4 GiB).
MODE_PROBE = r"""
import ctypes, errno, json, mmap, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = json.load(open(sys.argv[1]))
os.mkdir(sys.argv[2])
os.chdir(sys.argv[2])
AT_FDCWD, AT_EMPTY_PATH, AT_SYMLINK_FOLLOW = -100, 0x1000, 0x400
out = {}

def fail():
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))

def raw(number, *args):
    rc = libc.syscall(number, *args)
    if rc < 0:
        fail()
    return rc

def attempt(name, fn, path=None):
    try:
        fn()
        res = "OK"
    except OSError as exc:
        res = errno.errorcode.get(exc.errno, str(exc.errno))
    mode = None
    if path is not None:
        try:
            mode = os.lstat(path).st_mode & 0o7777
        except FileNotFoundError:
            pass
    out[name] = [res, mode]

def link_fd(fd, name, empty_path):
    if empty_path:
        rc = libc.linkat(fd, b"", AT_FDCWD, name.encode(), AT_EMPTY_PATH)
    else:
        rc = libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD, name.encode(), AT_SYMLINK_FOLLOW)
    if rc < 0:
        fail()

def tmpfile(mode, name, empty_path=False, then_fchmod=None):
    fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, mode)
    if then_fchmod is not None:
        os.fchmod(fd, then_fchmod)
    link_fd(fd, name, empty_path)

open("f", "w").close()
os.mkdir("d")
fd = os.open("f", os.O_RDONLY)
CREATE = os.O_CREAT | os.O_WRONLY
attempt("control_chmod_0700", lambda: os.chmod("f", 0o700), "f")
# 1775, not 1777: a host workspace's filter refuses others' write (S_IWOTH) too (test_host_workspace_mode_attacks).
attempt("control_chmod_sticky_dir_1775", lambda: os.chmod("d", 0o1775), "d")
attempt("control_open_creat_0755", lambda: os.close(os.open("c1", CREATE, 0o755)), "c1")
attempt("chmod_4755", lambda: os.chmod("f", 0o4755), "f")
attempt("chmod_2755", lambda: os.chmod("f", 0o2755), "f")
attempt("chmod_dir_2775", lambda: os.chmod("d", 0o2775), "d")
attempt("chmod_proc_self_fd_6755", lambda: os.chmod(f"/proc/self/fd/{fd}", 0o6755), "f")
attempt("fchmod_4755", lambda: os.fchmod(fd, 0o4755), "f")
attempt("raw_chmod_4755", lambda: raw(NR["chmod"], b"f", 0o4755), "f")
attempt("raw_chmod_4755_high_bits_set", lambda: raw(NR["chmod"], b"f", 0xFFFF0000 | 0o4755), "f")
attempt("raw_fchmod_2755", lambda: raw(NR["fchmod"], fd, 0o2755), "f")
attempt("raw_fchmodat_4755", lambda: raw(NR["fchmodat"], AT_FDCWD, b"f", 0o4755), "f")
attempt("raw_fchmodat2_4755", lambda: raw(NR["fchmodat2"], AT_FDCWD, b"f", 0o4755, 0), "f")
attempt("raw_fchmodat2_empty_path_6755", lambda: raw(NR["fchmodat2"], fd, b"", 0o6755, AT_EMPTY_PATH), "f")
attempt("open_creat_4755", lambda: os.close(os.open("o1", CREATE, 0o4755)), "o1")
attempt("open_creat_2755", lambda: os.close(os.open("o2", CREATE, 0o2755)), "o2")
attempt("raw_open_creat_4755", lambda: raw(NR["open"], b"o3", CREATE, 0o4755), "o3")
attempt("raw_creat_4755", lambda: raw(NR["creat"], b"o4", 0o4755), "o4")
attempt("raw_creat_2755", lambda: raw(NR["creat"], b"o5", 0o2755), "o5")
how = (ctypes.c_uint64 * 3)(CREATE, 0o4755, 0)  # struct open_how
attempt("raw_openat2_4755", lambda: raw(NR["openat2"], AT_FDCWD, b"o6", ctypes.byref(how), 24), "o6")
attempt("o_tmpfile_4755_then_linkat", lambda: tmpfile(0o4755, "t1"), "t1")
attempt("o_tmpfile_2755_then_linkat_empty_path", lambda: tmpfile(0o2755, "t2", empty_path=True), "t2")
attempt("o_tmpfile_fchmod_4755_then_linkat", lambda: tmpfile(0o755, "t3", then_fchmod=0o4755), "t3")
attempt("mkdir_6777", lambda: os.mkdir("m1", 0o6777), "m1")
attempt("raw_mkdir_2777", lambda: raw(NR["mkdir"], b"m2", 0o2777), "m2")
attempt("raw_mkdirat_6777", lambda: raw(NR["mkdirat"], AT_FDCWD, b"m3", 0o6777), "m3")
attempt("mknod_regular_4755", lambda: os.mknod("n1", stat.S_IFREG | 0o4755), "n1")
attempt("raw_mknodat_regular_2755", lambda: raw(NR["mknodat"], AT_FDCWD, b"n2", stat.S_IFREG | 0o2755, 0), "n2")
attempt("mkfifo_4755", lambda: os.mkfifo("n3", 0o4755), "n3")
attempt("mknod_char_device_1_3", lambda: os.mknod("n4", stat.S_IFCHR | 0o666, os.makedev(1, 3)), "n4")
CAPS = (0x02000000).to_bytes(4, "little") + (1 << 7).to_bytes(4, "little") + bytes(12)  # v2, CAP_SETUID
attempt("setxattr_security_capability", lambda: os.setxattr("f", "security.capability", CAPS), "f")
attempt("lsetxattr_security_capability",
        lambda: os.setxattr("f", "security.capability", CAPS, follow_symlinks=False), "f")
attempt("fsetxattr_security_capability", lambda: os.setxattr(fd, "security.capability", CAPS), "f")
attempt("setxattr_posix_acl_access", lambda: os.setxattr("f", "system.posix_acl_access", b"\x02\x00\x00\x00"), "f")
attempt("raw_setxattrat", lambda: raw(NR["setxattrat"], AT_FDCWD, b"f", 0, None, 0), "f")
attempt("raw_io_uring_setup", lambda: raw(NR["io_uring_setup"], 8, ctypes.create_string_buffer(120)))
attempt("x32_chmod_4755", lambda: raw(NR["x32_chmod"], b"f", 0o4755), "f")
attempt("link_host_setuid_binary", lambda: os.link("/usr/bin/passwd", "l1"), "l1")
attempt("chown_to_root", lambda: os.chown("f", 0, 0), "f")

MAP_32BIT = 0x40
page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_32BIT)
code = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
# push rbx; eax=nr; ebx=a; ecx=b; edx=c; esi=d; edi=e; int 0x80; pop rbx; ret
code.write(bytes.fromhex("5389f889f34989ca89d14489d24489c64489cfcd805bc3"))
int80 = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_uint] * 6)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
assert base < 1 << 32

def cstr(offset, text):
    page[offset:offset + len(text) + 1] = text + b"\0"
    return base + offset

def i386(number, a=0, b=0, c=0, d=0, e=0):
    rc = int80(number, a, b, c, d, e)
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))

AT = AT_FDCWD & 0xFFFFFFFF
attempt("control_i386_getpid", lambda: i386(20))
attempt("control_i386_mkdirat_0755", lambda: i386(296, AT, cstr(0, b"i0"), 0o755), "i0")
attempt("i386_chmod_4755", lambda: i386(15, cstr(0, b"f"), 0o4755), "f")
attempt("i386_fchmod_2755", lambda: i386(94, fd, 0o2755), "f")
attempt("i386_fchmodat_4755", lambda: i386(306, AT, cstr(0, b"f"), 0o4755), "f")
attempt("i386_fchmodat2_4755", lambda: i386(452, AT, cstr(0, b"f"), 0o4755, 0), "f")
attempt("i386_creat_4755", lambda: i386(8, cstr(16, b"i1"), 0o4755), "i1")
attempt("i386_open_creat_4755", lambda: i386(5, cstr(32, b"i2"), CREATE, 0o4755), "i2")
attempt("i386_openat_creat_2755", lambda: i386(295, AT, cstr(48, b"i3"), CREATE, 0o2755), "i3")
attempt("i386_mkdir_6777", lambda: i386(39, cstr(64, b"i4"), 0o6777), "i4")
attempt("i386_mknod_regular_4755", lambda: i386(14, cstr(80, b"i5"), stat.S_IFREG | 0o4755), "i5")
attempt("i386_setxattr_security_capability",
        lambda: i386(226, cstr(0, b"f"), cstr(96, b"security.capability"), cstr(128, CAPS), len(CAPS)), "f")
attempt("i386_io_uring_setup", lambda: i386(425, 8, cstr(256, bytes(120))))
print(json.dumps(out))
"""

# Refused with EPERM by the seccomp filter (the mode filter, and io_uring).
SECCOMP_REFUSED = (
    "chmod_4755",
    "chmod_2755",
    "chmod_dir_2775",
    "chmod_proc_self_fd_6755",
    "fchmod_4755",
    "raw_chmod_4755",
    "raw_chmod_4755_high_bits_set",
    "raw_fchmod_2755",
    "raw_fchmodat_4755",
    "raw_fchmodat2_4755",
    "raw_fchmodat2_empty_path_6755",
    "open_creat_4755",
    "open_creat_2755",
    "raw_open_creat_4755",
    "raw_creat_4755",
    "raw_creat_2755",
    "o_tmpfile_4755_then_linkat",
    "o_tmpfile_2755_then_linkat_empty_path",
    "o_tmpfile_fchmod_4755_then_linkat",
    "mkdir_6777",
    "raw_mkdir_2777",
    "raw_mkdirat_6777",
    "mknod_regular_4755",
    "raw_mknodat_regular_2755",
    "mkfifo_4755",
    "raw_io_uring_setup",
    "i386_chmod_4755",
    "i386_fchmod_2755",
    "i386_fchmodat_4755",
    "i386_fchmodat2_4755",
    "i386_creat_4755",
    "i386_open_creat_4755",
    "i386_openat_creat_2755",
    "i386_mkdir_6777",
    "i386_mknod_regular_4755",
    "i386_io_uring_setup",
)
NOT_SUPPORTED = errno.errorcode[errno.EOPNOTSUPP]  # ENOTSUP: the same number on Linux
# What each attempt gets inside a sandbox or a host workspace, and which layer says so.
MODE_PROBE_EXPECTED: dict[str, str] = {
    "control_chmod_0700": "OK",
    "control_chmod_sticky_dir_1775": "OK",
    "control_open_creat_0755": "OK",
    "control_i386_getpid": "OK",
    "control_i386_mkdirat_0755": "OK",
    **dict.fromkeys(SECCOMP_REFUSED, "EPERM"),
    "raw_openat2_4755": "ENOSYS",  # seccomp: libc falls back to the checked openat
    "raw_setxattrat": "ENOSYS",  # seccomp: newer than libseccomp's table
    "x32_chmod_4755": "ENOSYS",  # seccomp: a foreign ABI
    "setxattr_security_capability": NOT_SUPPORTED,  # seccomp: every setxattr
    "lsetxattr_security_capability": NOT_SUPPORTED,
    "fsetxattr_security_capability": NOT_SUPPORTED,
    "setxattr_posix_acl_access": NOT_SUPPORTED,
    "i386_setxattr_security_capability": NOT_SUPPORTED,
    "mknod_char_device_1_3": "EPERM",  # the kernel: no CAP_MKNOD
    "chown_to_root": "EINVAL",  # the user namespace: root is not mapped inside
    "link_host_setuid_binary": "EXDEV",  # the mounts: /usr is another mount than /workspace
}
# The attempts that make something setuid or setgid: as an unprivileged host user without the
# sandbox (the calibration below), the kernel lets every one of them through.
SETID_MAKERS = (
    *(name for name in SECCOMP_REFUSED if "io_uring" not in name and "mkdir" not in name),
    "raw_openat2_4755",
)

TOOLS_SCRIPT = """
mkdir tools && cd tools && : > f && mkdir d || exit 99
try() { name=$1; shift; "$@" 2>"../tools.$name.err"; echo "$name $?"; }
try mkdir_m_6777 mkdir -m 6777 md
try chmod_u_s chmod u+s f
try chmod_g_s_dir chmod g+s d
try chmod_6755 chmod 6755 f
try install_m_4755 install -m 4755 /usr/bin/true inst
try install_m_2755 install -m 2755 /usr/bin/true inst2
try mkfifo_m_4755 mkfifo -m 4755 ff
try mknod_m_4755_fifo mknod -m 4755 np p
try setcap_cap_setuid setcap cap_setuid+ep f
try ln_passwd ln /usr/bin/passwd lp
try perl_chmod perl -e 'chmod(04755, "f") or die "chmod: $!\\n"'
"""
# name -> (exit status, what it says): each fails, and says why.
TOOLS_EXPECTED = {
    "mkdir_m_6777": (1, f"mkdir: cannot create directory \u2018md\u2019: {EPERM_TEXT}"),  # seccomp
    "chmod_u_s": (1, f"chmod: changing permissions of 'f': {EPERM_TEXT}"),  # seccomp
    "chmod_g_s_dir": (1, f"chmod: changing permissions of 'd': {EPERM_TEXT}"),  # seccomp
    "chmod_6755": (1, f"chmod: changing permissions of 'f': {EPERM_TEXT}"),  # seccomp
    "install_m_4755": (1, f"install: cannot change permissions of 'inst': {EPERM_TEXT}"),  # seccomp
    "install_m_2755": (1, f"install: cannot change permissions of 'inst2': {EPERM_TEXT}"),  # seccomp
    "mkfifo_m_4755": (1, "mkfifo: mode must specify only file permission bits"),  # the program itself
    "mknod_m_4755_fifo": (1, "mknod: mode must specify only file permission bits"),  # the program itself
    "setcap_cap_setuid": (1, f"unable to set CAP_SETFCAP effective capability: {EPERM_TEXT}"),  # no capabilities
    "ln_passwd": (1, "Invalid cross-device link"),  # the mounts
    "perl_chmod": (1, f"chmod: {EPERM_TEXT}"),  # seccomp
}
# In the demo policy's workspace: what the policy refuses before anything runs.
POLICY_REFUSED = (
    "chmod u+s README.md",
    "chmod 6755 README.md",
    "install -m 4755 /usr/bin/true inst",
    "mknod -m 4755 np p",
    "mkfifo -m 4755 ff",
    "setcap cap_setuid+ep README.md",
    "ln /usr/bin/passwd lp",
    "perl -e 'chmod 04755, q(README.md)'",
    "python3 -c 'import os'",
    "sh -c 'chmod u+s README.md'",
    "env chmod u+s README.md",
    "unzip -K x.zip",
)


def check_mode_probe(where: str, results: dict[str, list[Any]]) -> None:
    """Each attempt individually: its outcome, and nothing it touched has S_ISUID or S_ISGID."""
    assert set(results) == set(MODE_PROBE_EXPECTED), (where, set(results) ^ set(MODE_PROBE_EXPECTED))
    for name, (outcome, mode) in results.items():
        assert outcome == MODE_PROBE_EXPECTED[name], f"{where}: {name} got {outcome} (mode {mode})"
        assert mode is None or mode & SETID == 0, f"{where}: {name} left mode {oct(mode)}"


async def test_every_call_and_program_that_sets_a_setuid_or_setgid_mode_is_refused(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: inside an agent sandbox and every host workspace, each way to give a file or
    folder S_ISUID or S_ISGID fails: chmod, fchmod, fchmodat, fchmodat2 (by path, by fd with
    AT_EMPTY_PATH, through /proc/self/fd, with junk in the mode's high bits), open/openat/creat
    with O_CREAT, O_TMPFILE then linkat, openat2, mkdir/mkdirat, mknod/mknodat of a regular
    file or a FIFO, the same calls through the 32-bit x86 ABI (int 0x80) and the x32 ABI,
    io_uring (whose requests pass no filter), security.capability and ACLs by setxattr (and
    setxattrat), a hard link to the host's setuid passwd, and the programs chmod, install -m,
    mkdir -m, mkfifo -m, mknod -m, setcap, ln and perl. Each refusal is the expected errno,
    which names the layer (see MODE_PROBE_EXPECTED); the same probe, run on the host as an
    unprivileged user without the sandbox, makes setuid files, so the refusals are not the
    probe's. In the demo policy's workspace the policy refuses those programs, mkdir -m 6777
    runs and gets EPERM, and the probe itself, run through git's core.fsmonitor hook (git is
    allowed, and reads its config from the workspace), gets the same answers as elsewhere.
    Does not prove that no other syscall sets a mode: these are the ones Linux 6.18 has."""
    numbers = json.dumps(syscall_numbers())

    # Calibration: the probe, on the host as an ordinary user (no seccomp, no namespaces).
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    os.chown(calibration, ORDINARY, ORDINARY)
    (calibration / "nr.json").write_text(numbers)
    unconfined = await anyio.run_process(
        [
            "setpriv",
            f"--reuid={ORDINARY}",
            f"--regid={ORDINARY}",
            "--clear-groups",
            "/usr/bin/python3",
            "-I",
            "-S",
            "-c",
            MODE_PROBE,
            "nr.json",
            "probe",
        ],
        cwd=calibration,
    )
    made = json.loads(unconfined.stdout)
    for name in SETID_MAKERS:
        outcome, mode = made[name]
        assert (outcome, bool(mode and mode & SETID)) == ("OK", True), f"calibration: {name} gave {outcome} {mode}"
    shutil.rmtree(calibration)

    box = await create(client)
    places = (DEFAULT, OPEN, USER, box)
    for where in places:
        written = await call(client, "write_file", path="nr.json", content=numbers, sandbox_id=where)
        assert written["ok"], written
        written = await call(client, "write_file", path="probe.py", content=MODE_PROBE, sandbox_id=where)
        assert written["ok"], written

    for where in (OPEN, USER, box):
        out = ran(await sh(client, where, "python3 -I -S probe.py nr.json probe"))
        assert out["exit_status"] == 0, out
        check_mode_probe(where, json.loads(out["stdout"]))
        tools = await run_script(client, where, "tools.sh", TOOLS_SCRIPT)
        statuses = dict(line.split() for line in tools["stdout"].splitlines())
        assert statuses.keys() == TOOLS_EXPECTED.keys(), tools
        for name, (status, says) in TOOLS_EXPECTED.items():
            error = (host_folder(demo_config, where) / f"tools.{name}.err").read_text()
            assert (int(statuses[name]), says in error) == (status, True), (where, name, statuses[name], error)

    # The demo policy's workspace.
    for command in POLICY_REFUSED:
        refused = await sh(client, DEFAULT, command)
        assert refused["code"] == "POLICY_DENIED", (command, refused)
    out = ran(await sh(client, DEFAULT, "mkdir -m 6777 md"))
    assert (out["exit_status"], EPERM_TEXT in out["stderr"]) == (1, True), out
    # git runs core.fsmonitor through sh whenever it reads the index: the probe runs after all. The repository is
    # one the agent makes after the start, in a folder of another name (`.git` is refused to the file tools).
    ran(await sh(client, DEFAULT, "git init -q --separate-git-dir=meta"))
    ran(await sh(client, DEFAULT, "git add README.md"))
    hook = "test -e probe || python3 -I -S probe.py nr.json probe >fsmonitor.out 2>&1; exit 1"  # git may ask twice
    config = f"[core]\n\trepositoryformatversion = 0\n\tbare = false\n\tfsmonitor = {json.dumps(hook)}\n"
    written = await call(client, "write_file", path="meta/config", content=config, sandbox_id=DEFAULT)
    assert written["ok"], written
    ran(await sh(client, DEFAULT, "git status --short"))
    check_mode_probe(
        "default via git fsmonitor", json.loads((host_folder(demo_config, DEFAULT) / "fsmonitor.out").read_text())
    )

    assert_host_intact(demo_config, tmp_path, dev_before)


# -- 4. the host's /dev nodes ----------------------------------------------------------------------

DEV_PROBE = r"""
import errno, json, os
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "OK"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))

def fchmod_open(path, mode):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)

attempt("chmod_full_0640", lambda: os.chmod("/dev/full", 0o640))
attempt("chmod_null_000", lambda: os.chmod("/dev/null", 0))
attempt("fchmod_zero_0600", lambda: fchmod_open("/dev/zero", 0o600))
attempt("chown_null_to_self", lambda: os.chown("/dev/null", os.getuid(), os.getgid()))
attempt("lchown_random_to_self", lambda: os.lchown("/dev/random", os.getuid(), -1))
attempt("utime_full_2001", lambda: os.utime("/dev/full", (1_000_000_000, 1_000_000_000)))
attempt("utime_urandom_ns", lambda: os.utime("/dev/urandom", ns=(1, 1)))
attempt("setxattr_null_user", lambda: os.setxattr("/dev/null", "user.x", b"1"))
attempt("setxattr_zero_security_capability", lambda: os.setxattr("/dev/zero", "security.capability", b"\0" * 20))
attempt("removexattr_null", lambda: os.removexattr("/dev/null", "user.x"))
print(json.dumps(out))
"""
DEV_SCRIPT = """
try() { name=$1; shift; "$@" 2>"dev.$name.err"; echo "$name $?"; }
try chmod_0640_full chmod 0640 /dev/full
try chmod_000_null chmod 000 /dev/null
try touch_d_full touch -d @1000000000 /dev/full
try touch_m_d_random touch -m -d @1 /dev/random
try chown_null chown sandbox /dev/null
try chgrp_zero chgrp sandbox /dev/zero
"""


# The kernel refuses each: the identity owns no /dev node (EPERM), except the extended
# attributes, refused by the seccomp filter first (every setxattr) or by the kernel (removing).
DEV_PROBE_EXPECTED = {
    "chmod_full_0640": "EPERM",
    "chmod_null_000": "EPERM",
    "fchmod_zero_0600": "EPERM",
    "chown_null_to_self": "EPERM",
    "lchown_random_to_self": "EPERM",
    "utime_full_2001": "EPERM",
    "utime_urandom_ns": "EPERM",
    "setxattr_null_user": NOT_SUPPORTED,
    "setxattr_zero_security_capability": NOT_SUPPORTED,
    "removexattr_null": "EPERM",
}
DEV_TOOLS_EXPECTED = {
    "chmod_0640_full": f"chmod: changing permissions of '/dev/full': {EPERM_TEXT}",
    "chmod_000_null": f"chmod: changing permissions of '/dev/null': {EPERM_TEXT}",
    "touch_d_full": f"touch: setting times of '/dev/full': {EPERM_TEXT}",
    "touch_m_d_random": f"touch: setting times of '/dev/random': {EPERM_TEXT}",
    "chown_null": f"chown: changing ownership of '/dev/null': {EPERM_TEXT}",
    "chgrp_zero": f"chgrp: changing group of '/dev/zero': {EPERM_TEXT}",
}


async def test_host_dev_nodes_mode_owner_times_and_xattrs_cannot_be_changed(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: chmod, fchmod, chown, lchown, chgrp, utime to a chosen time, and setting or
    removing extended attributes of the host's /dev/null, zero, full, random and urandom (bound
    into every sandbox) fail, in every host workspace and in an agent sandbox, and the host's
    nodes keep their mode, owner, group, mtime, ctime and attributes. chmod 0640 has no setid bit:
    it is the unprivileged identity the kernel refuses, not the mode filter. In the demo policy's
    workspace chmod, chown and chgrp are refused by the policy, and touch -d runs and gets EPERM.
    Does not cover setting the times to now (the next test)."""
    box = await create(client)
    for where in (OPEN, USER, box):
        out = await run_python(client, where, "dev_probe.py", DEV_PROBE)
        assert json.loads(out["stdout"]) == DEV_PROBE_EXPECTED, (where, out)
        tools = await run_script(client, where, "dev.sh", DEV_SCRIPT)
        statuses = dict(line.split() for line in tools["stdout"].splitlines())
        assert statuses == dict.fromkeys(DEV_TOOLS_EXPECTED, "1"), (where, tools)
        for name, says in DEV_TOOLS_EXPECTED.items():
            error = (host_folder(demo_config, where) / f"dev.{name}.err").read_text()
            assert says in error, (where, name, error)
        assert dev_state() == dev_before, where

    for command in ("chmod 0640 /dev/full", "chmod 000 /dev/null", "chown 0 /dev/null", "chgrp 0 /dev/zero"):
        refused = await sh(client, DEFAULT, command)
        assert refused["code"] == "POLICY_DENIED", (command, refused)
    for command, node in (
        ("touch -d @1000000000 /dev/full", "/dev/full"),
        ("touch -m -d @1 /dev/random", "/dev/random"),
    ):
        out = ran(await sh(client, DEFAULT, command))
        assert out["exit_status"] == 1, out
        assert f"touch: setting times of '{node}': {EPERM_TEXT}" in out["stderr"], out

    assert_host_intact(demo_config, tmp_path, dev_before)


async def test_host_dev_node_times_cannot_be_set_to_now(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: `touch /dev/null` in the demo's host workspace (touch is allowed by the demo
    policy) and utime(/dev/tty) in an agent sandbox, which need only write access to a 0666
    node, succeed but leave the host's nodes' mtime and ctime as they were: the nodes a
    sandbox sees are its own (the same devices on inodes of the server's). Does not prove
    anything about an unprivileged server, whose sandboxes keep the host's nodes."""
    box = await create(client)
    touched = ran(await sh(client, DEFAULT, "touch /dev/null"))
    utime = await run_python(client, box, "utime.py", "import os\nos.utime('/dev/tty')\nprint('done')\n")
    assert (touched["exit_status"], utime["stdout"]) == (0, "done\n"), (touched, utime)  # the calls succeeded
    assert_host_intact(demo_config, tmp_path, dev_before)


# -- 5..10. identities: who a sandbox is on the host -------------------------------------------------

_MARKS = itertools.count(1)


def host_pids_running(argv: tuple[str, ...]) -> list[int]:
    """Host pids whose command line is exactly `argv` (the host's /proc)."""
    wanted = b"\0".join(arg.encode() for arg in argv) + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    found.append(int(entry.name))
            except OSError:
                continue  # exited meanwhile
    return found


async def wait_for(predicate: Any, timeout_s: float) -> Any:
    """Poll `predicate` until it returns something truthy (or the time is up)."""
    deadline = anyio.current_time() + timeout_s
    while not (found := predicate()) and anyio.current_time() < deadline:
        await anyio.sleep(0.02)
    return found


async def command_identity(client: Client, where: str) -> int:
    """The host uid a command of `where` runs as, read from the host's /proc while it runs
    (a `sleep` with a marker argument, killed from the host once read). Its real, effective,
    saved and file-system uids and gids are all that one id."""
    argv = ("sleep", f"29.{next(_MARKS):04d}{os.getpid()}")
    result: dict[str, object] = {}

    async def run() -> None:
        result.update(await sh(client, where, shlex.join(argv)))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        pids = await wait_for(lambda: host_pids_running(argv), 10.0)
        assert len(pids) == 1, f"{where}: the marked sleep never showed in the host's /proc"
        status = Path(f"/proc/{pids[0]}/status").read_text().splitlines()
        ids = {line.split()[0]: set(line.split()[1:]) for line in status if line.startswith(("Uid:", "Gid:"))}
        os.kill(pids[0], 9)
    assert len(ids["Uid:"]) == 1, (where, ids)
    assert ids["Uid:"] == ids["Gid:"], (where, ids)
    assert result["ok"], result
    return int(ids["Uid:"].pop())


def owners_under(folder: Path) -> set[tuple[int, int]]:
    """(uid, gid) of every entry under `folder` (not the folder itself)."""
    found = set()
    for parent, dirs, files in os.walk(folder, onerror=_raise):
        for name in (*dirs, *files):
            info = os.lstat(os.path.join(parent, name))
            found.add((info.st_uid, info.st_gid))
    return found


def in_host_id_range(config: Config, uid: int) -> bool:
    first, count = config.sandboxes.host_ids
    return first <= uid < first + count


MAKE_FILES = """
set -e
mkdir -p dir/sub
echo made > dir/sub/file
cp /usr/bin/true exe
mkdir shared_tmp && chmod 1777 shared_tmp
umask 077 && echo private > private
ln -s exe link
"""


async def test_restored_sandbox_files_belong_to_the_new_sandbox_identity(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: restore_sandbox writes every file, folder, link and FIFO of the snapshot as the
    NEW sandbox's host identity (not root, not the sandbox it was taken from), keeps their
    permission bits (0755, 0600, sticky 1777) and gives none S_ISUID or S_ISGID; inside, they are
    the sandbox user's and usable. Does not prove anything about a snapshot archive changed on
    disk (its sha256 is checked on restore; not tried here)."""
    source = await create(client)
    assert (await run_script(client, source, "make.sh", MAKE_FILES))["exit_status"] == 0
    written = await call(client, "write_file", path="tool/made.txt", content="by the tool\n", sandbox_id=source)
    assert written["ok"], written
    snapshot = detail(await call(client, "snapshot_sandbox", sandbox_id=source))
    restored = await call(client, "restore_sandbox", snapshot_id=snapshot["snapshot_id"])
    box = detail(restored)["sandbox_id"]

    old, new = await command_identity(client, source), await command_identity(client, box)
    assert len({old, new, 0}) == 3, (old, new)
    assert in_host_id_range(demo_config, new), new
    folder = host_folder(demo_config, box)
    assert owners_under(folder) == {(new, new)}
    assert {name: oct(mode_of(folder / name)) for name in ("exe", "private", "shared_tmp", "dir/sub/file")} == {
        "exe": "0o755",
        "private": "0o600",
        "shared_tmp": "0o1777",
        "dir/sub/file": "0o644",
    }
    inside = ran(await sh(client, box, "cat dir/sub/file private tool/made.txt && ./exe && stat -c '%U %n' exe link"))
    assert inside["stdout"] == "made\nprivate\nby the tool\nsandbox exe\nsandbox link\n", inside
    assert_host_intact(demo_config, tmp_path, dev_before)


async def test_files_are_owned_by_the_workspace_folder_owner_or_the_sandbox_identity(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: in a host workspace folder owned by an ordinary user (12345), files and folders
    that commands make, and those write_file and upload_file make (missing folders included), are
    12345's on the host; in the demo's root-owned workspace they are root's (the idmapped mount
    maps the workspace's own id to the folder's owner), although the commands run as an id of the
    range; in an agent sandbox they are the sandbox identity's. Inside, they all show as the
    sandbox user. Does not prove anything about a folder whose files have several owners (only
    the folder's owner is mapped)."""
    box = await create(client)
    expected = {DEFAULT: 0, USER: ORDINARY, box: await command_identity(client, box)}
    for where, owner in expected.items():
        for command in (
            "mkdir cmd_dir",
            "touch cmd_dir/cmd_file",
            "cp README.md copied.md" if where != box else "true",
        ):
            ran(await sh(client, where, command))
        assert (await call(client, "write_file", path="w1/w2/written.txt", content="x", sandbox_id=where))["ok"]
        await put(client, where, "u1/uploaded.bin", b"\0\1")
        folder = host_folder(demo_config, where)
        made = [
            Path(p)
            for p in ("cmd_dir", "cmd_dir/cmd_file", "w1", "w1/w2", "w1/w2/written.txt", "u1", "u1/uploaded.bin")
        ]
        for path in made:
            info = os.lstat(folder / path)
            assert (info.st_uid, info.st_gid) == (owner, owner), (where, str(path), info.st_uid, info.st_gid)
        inside = ran(await sh(client, where, "stat -c %u:%g cmd_dir/cmd_file w1/w2/written.txt u1/uploaded.bin"))
        assert inside["stdout"].split() == ["1000:1000"] * 3, (where, inside)
        workspace_id = await command_identity(client, where)
        assert workspace_id not in (0, ORDINARY), (where, workspace_id)
        assert in_host_id_range(demo_config, workspace_id), (where, workspace_id)
    assert_host_intact(demo_config, tmp_path, dev_before)


async def test_each_sandbox_and_host_workspace_runs_as_a_host_id_of_its_own(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: the commands of two sandboxes and of the three host workspaces run on the host
    as five different uids (and gids), none 0, none the ordinary owner 12345, all inside
    host_id_range; the files each sandbox makes are its own id's on the host. Does not prove the
    ids stay distinct past the range's 65536 (a full range refuses a new sandbox)."""
    a, b = await create(client), await create(client)
    ids = {where: await command_identity(client, where) for where in (a, b, DEFAULT, OPEN, USER)}
    assert len(set(ids.values())) == len(ids), ids
    assert all(uid not in (0, ORDINARY) and in_host_id_range(demo_config, uid) for uid in ids.values()), ids
    for box in (a, b):
        ran(await sh(client, box, "echo mine > mine"))
        info = os.lstat(host_folder(demo_config, box) / "mine")
        assert (info.st_uid, info.st_gid) == (ids[box], ids[box]), box
    assert_host_intact(demo_config, tmp_path, dev_before)


READ_PROBE = f"""
import errno
for name in ("public", "secret"):
    try:
        open("{SHARED_DEST}/" + name).read()
    except OSError as exc:
        print(errno.errorcode[exc.errno])
    else:
        print(name, end=" ")
"""


async def test_a_0600_file_of_one_sandbox_is_unreadable_from_another_through_a_shared_folder(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: with a folder bound read-only into two sandboxes on purpose (the `shared`
    template), a file sandbox A made mode 0600, placed there by the host with A's owner and mode,
    is readable by A and not by B (EACCES), while B reads a 0644 file beside it: what keeps
    them apart is their distinct host ids, not only their mount namespaces. Does not prove
    anything about group-readable files (each sandbox has a group of its own too; not tried)."""
    a = await create(client, template="shared")
    b = await create(client, template="shared")
    ran(await sh(client, a, "umask 077 && echo secret-of-a > secret && echo public-of-a > public && chmod 644 public"))
    shared = tmp_path / "shared"
    for name in ("secret", "public"):
        source = host_folder(demo_config, a) / name
        shutil.copy2(source, shared / name)
        os.chown(shared / name, os.stat(source).st_uid, os.stat(source).st_gid)
    assert mode_of(shared / "secret") == 0o600
    uid_a = await command_identity(client, a)
    assert os.stat(shared / "secret").st_uid == uid_a

    own = ran(await sh(client, a, f"cat {SHARED_DEST}/secret"))
    assert own["stdout"] == "secret-of-a\n", own
    other = ran(await sh(client, b, f"cat {SHARED_DEST}/public; cat {SHARED_DEST}/secret; echo rc=$?"))
    assert other["stdout"] == "public-of-a\nrc=1\n", other
    assert other["stderr"].endswith(" denied\n"), other  # "Permission" is redacted as a credential word
    errno_seen = await run_python(client, b, "read.py", READ_PROBE)
    assert errno_seen["stdout"] == "public EACCES\n", errno_seen
    assert_host_intact(demo_config, tmp_path, dev_before)


async def test_mountinfo_names_neither_the_state_folder_nor_any_sandbox_folder(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: /proc/self/mountinfo inside an agent sandbox names neither the state folder,
    nor its own or another sandbox's host folder, nor `sandboxes`, nor another sandbox's id; nor,
    inside a host workspace, any of those (its idmapped mount lives in the state folder). What
    may appear (a template's python_env, a host workspace's own folder, a sandbox's own id as
    the name of its sockets' folder) is not checked."""
    a, b = await create(client), await create(client)
    forbidden = [
        str(demo_config.state_dir),
        "sandboxes",
        str(host_folder(demo_config, a)),
        str(host_folder(demo_config, b)),
    ]
    for where, other in ((a, b), (b, a)):
        info = ran(await sh(client, where, "cat /proc/self/mountinfo"))["stdout"]
        assert " /workspace " in info, info  # it is the real table
        # Its own id may appear (its sockets' folder, /run/bastion, is named by it); another's not.
        assert [word for word in (*forbidden, other) if word in info] == [], (where, info)
    for where in (DEFAULT, OPEN, USER):
        info = ran(await sh(client, where, "cat /proc/self/mountinfo"))["stdout"]
        assert " /workspace " in info, info
        assert [word for word in (*forbidden, a, b) if word in info] == [], (where, info)
    assert_host_intact(demo_config, tmp_path, dev_before)


async def test_a_closed_sandbox_leaves_nothing_owned_by_its_id(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Invariant: after close_sandbox (and of one made by restore_sandbox), no file, folder,
    socket or mount under the state folder is owned by that sandbox's uid or gid, and no host
    process runs as it (a zombie, exited and waiting for the host's init to reap it, runs
    nothing and is not counted). Does not cover a server killed without closing (recover's tests)."""
    box = await create(client)
    assert (await run_script(client, box, "make.sh", MAKE_FILES))["exit_status"] == 0
    started = await sh(client, box, "sleep 600", background=True)
    assert started["ok"], started
    snapshot = detail(await call(client, "snapshot_sandbox", sandbox_id=box))
    restored = detail(await call(client, "restore_sandbox", snapshot_id=snapshot["snapshot_id"]))["sandbox_id"]
    for where in (box, restored):
        uid = await command_identity(client, where)
        assert any(uid in pair for pair in owners_under(demo_config.state_dir)), "the walk sees the sandbox's files"
        closed = await call(client, "close_sandbox", sandbox_id=where)
        assert closed["ok"], closed
        left = {pair for pair in owners_under(demo_config.state_dir) if uid in pair}
        assert left == set(), (where, uid, left)
        running = [pid for pid in os.listdir("/proc") if pid.isdigit() and _uid_of(pid) == uid and not _zombie(pid)]
        assert running == [], (where, uid, [(pid, _describe(pid)) for pid in running])
    assert_host_intact(demo_config, tmp_path, dev_before)


def _describe(pid: str) -> str:
    """pid: command line <- its parent's <- ... (for a failure message)."""
    chain = []
    try:
        while pid not in ("0", "1"):
            chain.append(pid + ": " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
            pid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError as exc:
        chain.append(str(exc))
    return " <- ".join(chain)


def _zombie(pid: str) -> bool:
    """An exited process not yet reaped (a sandbox's inner bwrap, reparented to the host's init, shows
    so for a moment after close): it runs nothing and holds no file."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


async def test_sandboxes_of_two_servers_on_one_host_do_not_share_an_id(
    client: Client, demo_config: Config, tmp_path: Path
) -> None:
    """Invariant: two servers on one host with the same config's host_id_range (each MCP client
    that speaks stdio starts a server of its own) never run a sandbox or host workspace as the
    same host id at once: the second server's sandboxes, created until past where the first
    server's sandbox sits in the range, each get an id none of the first server's commands run
    as, and none reads the first server's sandbox's 0600 file through a shared folder (each
    reads the 0644 one beside it). Does not prove anything about servers given different but
    overlapping ranges (the ranges are one config's here)."""
    second_path = demo_config_at(tmp_path / "second", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)
    with_range(second_path)
    shared = tmp_path / "shared"
    template = (
        f'[[template]]\nname = "shared"\nread_only = [{{ source = {json.dumps(str(shared))}, dest = "{SHARED_DEST}" }}]'
    )
    second_path.write_text(second_path.read_text(encoding="utf-8") + f"\n{template}\n", encoding="utf-8")
    a = await create(client, template="shared")
    ran(await sh(client, a, "umask 077 && echo secret-of-a > secret"))
    source = host_folder(demo_config, a) / "secret"
    shutil.copy2(source, shared / "secret")
    os.chown(shared / "secret", os.stat(source).st_uid, os.stat(source).st_gid)
    (shared / "public").write_text("public\n")
    first_ids = {where: await command_identity(client, where) for where in (a, DEFAULT, OPEN, USER)}

    services = build_services(load_config(second_path))
    try:
        async with Client(build_server(services, caller="second-server")) as other_client:
            # The first server has three host workspaces, the second one: without coordination its
            # third sandbox would get A's place in the range (it did, before ids were locked host-wide).
            seen = {}
            for _ in range(4):
                b = await create(other_client, template="shared")
                uid_b = await command_identity(other_client, b)
                seen[uid_b] = (await run_python(other_client, b, "read.py", READ_PROBE))["stdout"]
    finally:
        services.close()
    assert len(seen) == 4, seen
    assert set(seen).isdisjoint(first_ids.values()), (first_ids, seen)
    assert seen == dict.fromkeys(seen, "public EACCES\n"), (first_ids, seen)


# -- 11. lasting marks on host files: inode flags, device nodes, core dumps ------------------------

# Runs inside (or on the host, unconfined, for the calibration): argv[1] is a JSON list of targets
# (files and folders to mark), argv[2] a fresh folder to make nodes in. Prints {attempt: outcome}.
INODE_PROBE = r"""
import ctypes, errno, fcntl, json, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall.argtypes = (ctypes.c_long,) * 6
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "OK"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))

def raw(number, *args):
    kept = [ctypes.create_string_buffer(a) if isinstance(a, bytes) else a for a in args]  # alive until the call ends
    words = [ctypes.addressof(a) if isinstance(a, ctypes.Array) else a for a in kept]
    if libc.syscall(number, *(words + [0] * 5)[:5]) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def on(path, request, arg):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, request, arg)
    finally:
        os.close(fd)

def flags_of(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return struct.unpack("l", fcntl.ioctl(fd, 0x80086601, bytes(8)))[0]
    finally:
        os.close(fd)

def xattr_of(path):  # struct fsxattr (FS_IOC_FSGETXATTR)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return bytearray(fcntl.ioctl(fd, 0x801C581F, bytes(28)))
    finally:
        os.close(fd)

def high_bits(path):  # the request with junk above bit 31, which the kernel ignores
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = ctypes.c_long(flags_of(path) | 0x40)
        raw(16, fd, (1 << 32) | 0x40086602, ctypes.addressof(flags))
    finally:
        os.close(fd)

def with_nodump(path):
    found = xattr_of(path)
    struct.pack_into("I", found, 0, struct.unpack_from("I", found)[0] | 0x80)  # FS_XFLAG_NODUMP
    return bytes(found)

for target in json.loads(sys.argv[1]):
    attempt(f"getflags {target}", lambda: flags_of(target))
    attempt(f"setflags nodump {target}", lambda: on(target, 0x40086602, struct.pack("l", flags_of(target) | 0x40)))
    attempt(f"setflags32 nodump {target}", lambda: on(target, 0x40046602, struct.pack("i", flags_of(target) | 0x40)))
    attempt(f"setflags high bits {target}", lambda: high_bits(target))
    attempt(f"fssetxattr nodump {target}", lambda: on(target, 0x401C5820, with_nodump(target)))
    attempt(f"setversion {target}", lambda: on(target, 0x40087602, struct.pack("l", 7)))
os.mkdir(sys.argv[2])
os.chdir(sys.argv[2])
open("own", "w").close()
os.mkdir("empty")
attempt("enable_verity", lambda: on("own", 0x40806685, struct.pack("II", 1, 1) + bytes(120)))
attempt("set_encryption_policy", lambda: on("empty", 0x800C6613, bytes([0, 1, 4, 0]) + b"k" * 8))
attempt("mkfifo", lambda: os.mkfifo("fifo"))
attempt("mknod_char_0_0", lambda: os.mknod("whiteout", 0o20600, os.makedev(0, 0)))
attempt("mknod_char_1_3", lambda: os.mknod("null", 0o20666, os.makedev(1, 3)))
attempt("mknod_block_7_0", lambda: os.mknod("loop", 0o60600, os.makedev(7, 0)))
attempt("mknodat_char_0_0", lambda: raw(259, -100, b"whiteout2", 0o20600, 0))
open("moved", "w").close()
attempt("renameat2_whiteout", lambda: raw(316, -100, b"moved", -100, b"gone", 4))
print(json.dumps(out))
"""
MARKS = ("setflags nodump", "setflags32 nodump", "setflags high bits", "fssetxattr nodump", "setversion")
NODES = ("mknod_char_0_0", "mknodat_char_0_0", "renameat2_whiteout")


def inode_flags(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder)
    finally:
        os.close(fd)


def device_nodes(root: Path) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root, onerror=_raise, followlinks=False):
        for name in (*dirs, *files):
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                found.append(os.path.join(folder, name))
    return found


async def test_a_command_sets_no_inode_flag_and_makes_no_device_node_on_host_files(
    client: Client, demo_config: Config, tmp_path: Path, dev_before: dict[str, tuple[object, ...]]
) -> None:
    """Attack: a command in a workspace sets ioctl_iflags(2) on the host's files and on the workspace
    folder (no-dump hides them from backups; sync, noatime...), through FS_IOC_SETFLAGS (both sizes of
    long, junk above bit 31), FS_IOC_FSSETXATTR or FS_IOC_SETVERSION, enables fs-verity or an
    encryption policy, and makes device nodes: a 0:0 character device (overlayfs's whiteout, which
    needs no capability) by mknod, mknodat or renameat2's RENAME_WHITEOUT. Invariant: every one fails
    with EPERM in each host workspace and in an agent sandbox, reading the flags and making a FIFO
    still work, and the host's files keep their flags; the same probe unconfined, as an ordinary user
    on a folder of its own, sets the flag and makes the whiteouts (the refusals are the filter's).
    Does not cover the 32-bit x86 ABI (the filter's rules are the same for it: the setuid test)."""
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "mine").write_text("x")
    for path in (calibration, calibration / "mine"):
        os.chown(path, ORDINARY, ORDINARY)
    as_ordinary = ("setpriv", f"--reuid={ORDINARY}", f"--regid={ORDINARY}", "--clear-groups")
    unconfined = await anyio.run_process(
        [*as_ordinary, "/usr/bin/python3", "-I", "-S", "-c", INODE_PROBE, json.dumps(["mine"]), "nodes"],
        cwd=calibration,
    )
    made = json.loads(unconfined.stdout)
    # FS_IOC32_SETFLAGS is a 32-bit program's: ENOTTY from a 64-bit one, filter or not.
    marked = [f"{mark} mine" for mark in MARKS if mark != "setflags32 nodump"]
    assert {name: made[name] for name in (*marked, "mkfifo", *NODES)} == dict.fromkeys(
        (*marked, "mkfifo", *NODES), "OK"
    )
    shutil.rmtree(calibration)

    box = await create(client)
    for where in (OPEN, USER, box):
        folder = host_folder(demo_config, where)
        (folder / "admin.txt").write_text("the host's file\n")
        os.chown(folder / "admin.txt", *((ORDINARY, ORDINARY) if where == USER else (os.lstat(folder).st_uid,) * 2))
        before = {path: inode_flags(path) for path in (folder, folder / "admin.txt")}
        written = await call(client, "write_file", path="inode.py", content=INODE_PROBE, sandbox_id=where)
        assert written["ok"], written
        argv = ("python3", "-I", "-S", "inode.py", json.dumps([".", "admin.txt"]), "nodes")
        found = json.loads(ran(await sh(client, where, shlex.join(argv)))["stdout"])
        for target in (".", "admin.txt"):
            assert found[f"getflags {target}"] == "OK", (where, found)
            for mark in MARKS:
                assert found[f"{mark} {target}"] == "EPERM", (where, mark, target, found)
        for name in ("enable_verity", "set_encryption_policy", "mknod_char_1_3", "mknod_block_7_0", *NODES):
            assert found[name] == "EPERM", (where, name, found)
        assert found["mkfifo"] == "OK", (where, found)
        assert {path: inode_flags(path) for path in before} == before, where
        assert device_nodes(folder) == [], where
    assert_host_intact(demo_config, tmp_path, dev_before)


CORE_PROBE = r"""
import os, resource, signal
print(resource.getrlimit(resource.RLIMIT_CORE))
for wanted in ((resource.RLIM_INFINITY, resource.RLIM_INFINITY), (0, 0), (1, 1)):
    try:
        resource.setrlimit(resource.RLIMIT_CORE, wanted)
        print("set", wanted)
    except (ValueError, OSError) as exc:
        print("refused", wanted, type(exc).__name__)
print(resource.getrlimit(resource.RLIMIT_CORE), flush=True)
os.kill(os.getpid(), signal.SIGSEGV)
"""


async def test_a_crashing_command_cannot_raise_its_core_limit_and_leaves_no_core(
    client: Client, demo_config: Config, tmp_path: Path
) -> None:
    """Attack: a command raises its core-size limit and crashes, so the kernel writes a core into the
    workspace (past the sandbox's disk quota in a host workspace) or, on a host whose core_pattern is
    a pipe (systemd-coredump, apport), hands the crash to a root helper on the host. Invariant: in the
    host workspaces that run python3 and an agent sandbox the limit is (1, 1), it cannot be raised (it may
    be lowered, to 0), the crash leaves no core file, and the kernel would skip a pipe helper (it does for
    exactly 1).
    Does not run a pipe helper: core_pattern is the host's, and a test must not change it."""
    box = await create(client)
    for where in (OPEN, USER, box):  # the demo's own workspace runs no python3; its sandbox is alike
        name = "crash.py"
        written = await call(client, "write_file", path=name, content=CORE_PROBE, sandbox_id=where)
        assert written["ok"], written
        crashed = await sh(client, where, shlex.join(("python3", "-I", "-S", name)))
        lines = detail(crashed)["stdout"].splitlines()
        assert lines == [
            "(1, 1)",
            "refused (-1, -1) ValueError",
            "set (0, 0)",
            "refused (1, 1) ValueError",
            "(0, 0)",
        ], (where, crashed)
        assert detail(crashed)["exit_status"] != 0, crashed
        assert not [p for p in host_folder(demo_config, where).iterdir() if p.name.startswith("core")], where
