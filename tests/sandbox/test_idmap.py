"""Idmapped mounts on the real kernel: what a sandbox uid X creates lands on disk as the folder's owner.

Every test runs as root, mounts only under its own tmp_path, and leaves no mount behind
(the autouse fixture unmounts what was made, then checks /proc/self/mountinfo). The
processes that use a mount run as X through setpriv, from the mount as their working
folder (X cannot traverse pytest's 0700 temp root), and the end-to-end test through
real bubblewrap.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import Unavailable
from bastion.sandbox import _idmap
from bastion.sandbox._idmap import idmap_supported, idmapped_mount, is_mounted, unmount, user_namespace

pytestmark = pytest.mark.root

X = 1879048192 + 4242  # a reserved range: no real user has these ids
OWNER = 12345
THIRD = 23456
OVERFLOW = 65534
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

Mount = Callable[..., Path]


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo", "rb") as info:
        return [_idmap.mount_point(line) for line in info]


def _mountinfo_line(target: Path) -> str:
    with open("/proc/self/mountinfo", "rb") as info:
        lines = [line.decode() for line in info if _idmap.mount_point(line) == str(target)]
    assert len(lines) == 1, lines
    return lines[0]


def _children() -> set[int]:
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


@pytest.fixture(autouse=True)
def made(tmp_path: Path) -> Iterator[list[Path]]:
    """Mount points to unmount at teardown (last made first); then nothing under tmp_path may be mounted."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes user namespaces and mounts")
    targets: list[Path] = []
    yield targets
    for target in reversed(targets):
        unmount(target)
    assert [point for point in _mount_points() if point.startswith(str(tmp_path))] == []


@pytest.fixture
def mount(tmp_path: Path, made: list[Path]) -> Mount:
    """Mount tmp_path/src (owned by `owner`) idmapped at a new tmp_path/stage; return the stage."""

    def make(owner: int = OWNER, source: Path | None = None) -> Path:
        source = source or tmp_path / "src"
        source.mkdir(exist_ok=True)
        os.chown(source, owner, owner)
        target = tmp_path / "stage"
        target.mkdir()
        made.append(target)
        idmapped_mount(source, target, owner=(owner, owner), identity=(X, X))
        return target

    return make


def as_x(cwd: Path, script: str) -> subprocess.CompletedProcess[str]:
    argv = ["setpriv", f"--reuid={X}", f"--regid={X}", "--clear-groups", "--", "sh", "-c", script]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=30, env=ENV, check=False)


@pytest.mark.parametrize("owner", [OWNER, 0])
def test_files_made_by_sandbox_uid_are_the_owners_on_disk(mount: Mount, tmp_path: Path, owner: int) -> None:
    """A file, a folder and a file in it, made through the mount by X, are `owner`'s on disk (not X's)."""
    stage = mount(owner)
    done = as_x(stage, "touch new && mkdir dir && touch dir/inner && id -u")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(X)
    for name in ("new", "dir", "dir/inner"):
        on_disk = os.lstat(tmp_path / "src" / name)
        assert (on_disk.st_uid, on_disk.st_gid) == (owner, owner), name
        through = os.lstat(stage / name)
        assert (through.st_uid, through.st_gid) == (X, X), name


def test_owner_files_show_as_sandbox_uid_and_others_as_overflow(mount: Mount, tmp_path: Path) -> None:
    """Through the mount the owner's file is X's and writable by X; a third uid's is 65534's and is not."""
    source = tmp_path / "src"
    source.mkdir()
    for name, uid in (("mine", OWNER), ("theirs", THIRD)):
        (source / name).write_text("before\n")
        os.chown(source / name, uid, uid)
        (source / name).chmod(0o644)
    stage = mount()
    assert (os.lstat(stage / "mine").st_uid, os.lstat(stage / "mine").st_gid) == (X, X)
    assert (os.lstat(stage / "theirs").st_uid, os.lstat(stage / "theirs").st_gid) == (OVERFLOW, OVERFLOW)
    assert as_x(stage, "echo after >> mine").returncode == 0
    refused = as_x(stage, "echo after >> theirs")
    assert refused.returncode != 0
    assert "Permission denied" in refused.stderr
    assert (source / "mine").read_text() == "before\nafter\n"
    assert (source / "theirs").read_text() == "before\n"
    assert os.lstat(source / "mine").st_uid == OWNER


def test_mount_is_nosuid_nodev_idmapped_and_private(mount: Mount, tmp_path: Path, made: list[Path]) -> None:
    """Even with a source on a shared mount, the clone is in no peer group (no shared:/master: tag).

    Does not show what happens to the attach under a shared parent: that follows the parent's propagation.
    """
    shared = tmp_path / "shared"
    shared.mkdir()
    made.append(shared)
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True, env=ENV)
    subprocess.run(["mount", "--make-shared", str(shared)], check=True, env=ENV)
    assert "shared:" in _mountinfo_line(shared)
    stage = mount(source=shared / "src")
    line = _mountinfo_line(stage)
    options = set(line.split()[5].split(","))
    assert {"nosuid", "nodev", "idmapped"} <= options
    assert "shared:" not in line
    assert "master:" not in line
    flags = os.statvfs(stage).f_flag
    assert flags & os.ST_NOSUID
    assert flags & os.ST_NODEV


def test_mount_does_not_strip_setuid_bits_so_the_sandbox_must(mount: Mount, tmp_path: Path) -> None:
    """Pins the module's "What it is NOT": a setuid file X makes is a setuid file of the owner on disk.

    nosuid only holds on this mount; keeping such files out is the sandbox's job (seccomp), not the mount's.
    """
    stage = mount()
    assert as_x(stage, "touch tool && chmod 4755 tool").returncode == 0
    on_disk = os.lstat(tmp_path / "src" / "tool")
    assert on_disk.st_uid == OWNER
    assert on_disk.st_mode & stat.S_ISUID


def test_symlink_source_is_refused(tmp_path: Path, made: list[Path]) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "stage").mkdir()
    made.append(tmp_path / "stage")
    with pytest.raises(Unavailable, match="is a symbolic link"):
        idmapped_mount(tmp_path / "link", tmp_path / "stage", owner=(OWNER, OWNER), identity=(X, X))
    assert not is_mounted(tmp_path / "stage")


def test_file_source_is_refused(tmp_path: Path, made: list[Path]) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "stage").mkdir()
    made.append(tmp_path / "stage")
    with pytest.raises(Unavailable, match="is not a directory"):
        idmapped_mount(tmp_path / "file", tmp_path / "stage", owner=(OWNER, OWNER), identity=(X, X))


def test_non_empty_target_is_refused(tmp_path: Path, made: list[Path]) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "left-over").write_text("")
    made.append(tmp_path / "stage")
    with pytest.raises(Unavailable, match="is not empty"):
        idmapped_mount(tmp_path / "src", tmp_path / "stage", owner=(OWNER, OWNER), identity=(X, X))
    assert not is_mounted(tmp_path / "stage")


def test_symlink_target_is_refused(tmp_path: Path, made: list[Path]) -> None:
    """A link to an empty folder is still refused: the mount would land on whatever the link names."""
    (tmp_path / "src").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "stage").symlink_to(tmp_path / "elsewhere")
    made.append(tmp_path / "elsewhere")
    with pytest.raises(Unavailable, match="is a symbolic link"):
        idmapped_mount(tmp_path / "src", tmp_path / "stage", owner=(OWNER, OWNER), identity=(X, X))
    assert not is_mounted(tmp_path / "elsewhere")


def test_target_already_mounted_is_refused(mount: Mount, tmp_path: Path) -> None:
    stage = mount()
    with pytest.raises(Unavailable, match="already a mount point"):
        idmapped_mount(tmp_path / "src", stage, owner=(OWNER, OWNER), identity=(X, X))


def test_unmount_is_quiet_when_nothing_is_mounted(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    unmount(tmp_path / "plain")
    unmount(tmp_path / "missing")
    assert not is_mounted(tmp_path / "plain")


def test_unmount_detaches(mount: Mount, tmp_path: Path) -> None:
    stage = mount()
    assert is_mounted(stage)
    unmount(stage)
    assert not is_mounted(stage)
    assert not (stage / ".").samefile(tmp_path / "src")


# bwrap (as X) resolves its --bind-fd path again by name, which X cannot traverse under pytest's
# 0700 temp root: a private mount namespace shows the stage at /mnt, and the shell opens it as fd 9.
_SHOW_AT_MNT = 'mount --bind "$0" /mnt && exec 9</mnt && exec "$@"'


@pytest.mark.bwrap
def test_bwrap_bind_fd_end_to_end(mount: Mount, tmp_path: Path) -> None:
    """Real bubblewrap as X, uid 1000 inside: a file made in /workspace is 1000's inside and OWNER's on disk."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "existing").write_text("")
    os.chown(tmp_path / "src" / "existing", OWNER, OWNER)
    stage = mount()
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SHOW_AT_MNT, str(stage)]
    argv += ["setpriv", f"--reuid={X}", f"--regid={X}", "--clear-groups", "--", bwrap]
    argv += ["--unshare-all", "--uid", "1000", "--gid", "1000", "--die-with-parent"]
    argv += ["--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    argv += ["--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev"]
    argv += ["--bind-fd", "9", "/workspace", "--chdir", "/workspace"]
    argv += ["--", "sh", "-c", "touch x && stat -c '%n %u %g' x existing"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=ENV, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["x 1000 1000", "existing 1000 1000"]
    on_disk = os.lstat(tmp_path / "src" / "x")
    assert (on_disk.st_uid, on_disk.st_gid) == (OWNER, OWNER)


def test_idmap_supported_here(tmp_path: Path) -> None:
    """The probe succeeds on tmp_path's filesystem, attaches nothing and leaves no child process."""
    before = _children()
    assert idmap_supported(tmp_path) is None
    assert _children() == before


def test_idmap_supported_names_a_filesystem_without_idmap() -> None:
    """procfs has no idmap support (no FS_ALLOW_IDMAP): mount_setattr says EINVAL."""
    why = idmap_supported("/proc")
    assert why is not None
    assert "does not support idmapped mounts" in why


def test_user_namespace_is_new_and_leaves_no_child() -> None:
    before = _children()
    fd = user_namespace((OWNER, X, 1), (OWNER, X, 1))
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") != os.readlink("/proc/self/ns/user")
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("user:[")
    finally:
        os.close(fd)
    assert _children() == before


def test_user_namespace_refuses_a_bad_range() -> None:
    with pytest.raises(ValueError, match="invalid id range"):
        user_namespace((0, 2**32 - 1, 1), (0, 0, 1))


def _fake_unshare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Put a fake `unshare` first on the PATH that user_namespace() searches."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "unshare").write_text("#!/bin/sh\n" + body)
    (bin_dir / "unshare").chmod(0o755)
    monkeypatch.setitem(_idmap.UNSHARE_ENV, "PATH", f"{bin_dir}:/usr/bin:/bin")


def test_user_namespace_reports_unshare_failing_and_leaves_no_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_unshare(tmp_path, monkeypatch, "echo 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    before = _children()
    with pytest.raises(Unavailable, match="cannot make a user namespace: unshare: unshare failed"):
        user_namespace((OWNER, X, 1), (OWNER, X, 1))
    assert _children() == before


def test_user_namespace_wait_is_bounded_and_kills_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that never leaves our user namespace is killed and reaped once the wait runs out."""
    _fake_unshare(tmp_path, monkeypatch, "exec sleep infinity\n")
    monkeypatch.setattr(_idmap, "_NAMESPACE_WAIT_S", 0.05)
    before = _children()
    with pytest.raises(Unavailable, match="made no user namespace within"):
        user_namespace((OWNER, X, 1), (OWNER, X, 1))
    assert _children() == before
