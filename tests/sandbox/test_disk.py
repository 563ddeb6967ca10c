"""A sandbox's workspace disk on the real kernel: one mkfs per size, copies attached to loop devices.

Every test runs as root, mounts only under its own tmp_path, and leaves no mount and no loop device
behind (the autouse fixture drops what was mounted, then waits until no loop device is backed by a
file under tmp_path: the kernel detaches an autoclear device once its last user is gone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import Unavailable
from bastion.sandbox import _disk
from bastion.sandbox._disk import FormattedImage, ImageFormats, drop_disk, format_image, make_disk, mount_disk

pytestmark = pytest.mark.root

SIZE = 32 * 1024 * 1024
DETACH_WAIT_S = 10.0


def _loop_backings() -> list[str]:
    found = []
    for device in Path("/sys/block").glob("loop*"):
        try:
            found.append((device / "loop" / "backing_file").read_text().strip())
        except OSError:
            continue  # not attached
    return found


def _mount_options(target: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        lines = [line.split() for line in info if line.split()[4] == str(target)]
    assert len(lines) == 1, lines
    return lines[0][5].split(",")


@pytest.fixture(autouse=True)
def mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """Mount points to drop at teardown; then no mount and, soon, no loop device under tmp_path."""
    if os.geteuid() != 0:
        pytest.skip("needs root: loop devices and mounts")
    made: list[Path] = []
    yield made
    for target in reversed(made):
        drop_disk(target)
    deadline = time.monotonic() + DETACH_WAIT_S
    while any(path.startswith(str(tmp_path)) for path in _loop_backings()):
        assert time.monotonic() < deadline, f"loop devices left: {_loop_backings()}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def formatted(tmp_path_factory: pytest.TempPathFactory) -> FormattedImage:
    return format_image(tmp_path_factory.mktemp("format"), SIZE)


def _new_disk(tmp_path: Path, formatted: FormattedImage, mounts: list[Path], name: str) -> Path:
    target = tmp_path / name
    target.mkdir()
    make_disk(tmp_path / f"{name}.img", target, formatted)
    mounts.append(target)
    return target


def test_format_keeps_only_what_mkfs_wrote_and_leaves_no_file(tmp_path: Path, formatted: FormattedImage) -> None:
    """Invariant: the template is a few extents (not SIZE bytes), and formatting leaves no file behind
    (an O_TMPFILE, so a crash mid-mkfs leaves nothing either)."""
    assert formatted.size_bytes == SIZE
    assert 0 < sum(len(data) for _, data in formatted.extents) < SIZE // 16
    assert formatted.extents[0][0] == 0
    again = ImageFormats(tmp_path)
    assert again.get(SIZE) is again.get(SIZE)  # once per size
    assert list(tmp_path.iterdir()) == []


def test_a_client_asking_a_new_disk_size_each_time_keeps_few_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: create sandboxes each with a disk size of its own (any byte count in range). Each size's
    mkfs output (70 to 90 KB) was kept for ever. Invariant: at most KEPT_FORMATS sizes are kept, the least
    recently used forgotten first; a size asked again after that is formatted again."""
    monkeypatch.setattr(_disk, "KEPT_FORMATS", 3)
    formats = ImageFormats(tmp_path)
    sizes = [SIZE + n * 4096 for n in range(6)]
    first = formats.get(sizes[0])
    for size in sizes[1:]:
        assert formats.get(size).size_bytes == size
        formats.get(sizes[1])  # used again and again: kept
    assert len(formats._made) == 3
    assert sizes[1] in formats._made
    assert sizes[0] not in formats._made
    again = formats.get(sizes[0])  # formatted again: a new image of the same size (mkfs stamps a new UUID)
    assert again is not first
    assert again.size_bytes == sizes[0]


def test_copy_mounts_as_an_empty_ext4_of_its_size_nosuid_nodev(
    tmp_path: Path, formatted: FormattedImage, mounts: list[Path]
) -> None:
    """Invariant: a sandbox's disk is an empty ext4 of the asked size (no lost+found, mode 0700),
    mounted nosuid, nodev, noatime on a loop device backed by its own image, which stays sparse."""
    target = _new_disk(tmp_path, formatted, mounts, "one")
    assert list(target.iterdir()) == []
    assert target.stat().st_mode & 0o777 == 0o700
    st = os.statvfs(target)
    assert SIZE * 0.9 < st.f_blocks * st.f_frsize <= SIZE
    assert {"nosuid", "nodev", "noatime"} <= set(_mount_options(target))
    assert str(tmp_path / "one.img") in _loop_backings()
    assert (tmp_path / "one.img").stat().st_blocks * 512 < SIZE // 16


def test_copies_of_one_format_are_separate_filesystems(
    tmp_path: Path, formatted: FormattedImage, mounts: list[Path]
) -> None:
    """Attack: two sandboxes whose disks come from the same template. Invariant: a file written in
    one is not in the other, and filling one leaves the other's space untouched."""
    first = _new_disk(tmp_path, formatted, mounts, "first")
    second = _new_disk(tmp_path, formatted, mounts, "second")
    (first / "secret").write_bytes(b"x" * 4 * 1024 * 1024)
    os.sync()
    assert list(second.iterdir()) == []
    free = os.statvfs(second)
    assert free.f_bfree * free.f_frsize > SIZE * 0.9


def test_dropped_disk_releases_its_loop_device_and_mounts_again(
    tmp_path: Path, formatted: FormattedImage, mounts: list[Path]
) -> None:
    """Invariant: dropping the disk unmounts it and frees its loop device (autoclear); the image
    mounts again with its files (as recovery after a host reboot does)."""
    target = _new_disk(tmp_path, formatted, mounts, "kept")
    (target / "work.txt").write_text("kept\n")
    mounts.remove(target)
    drop_disk(target)
    assert not os.path.ismount(target)
    deadline = time.monotonic() + DETACH_WAIT_S
    while str(tmp_path / "kept.img") in _loop_backings():
        assert time.monotonic() < deadline, "the loop device stayed attached"
        time.sleep(0.01)
    mount_disk(tmp_path / "kept.img", target)
    mounts.append(target)
    assert (target / "work.txt").read_text() == "kept\n"


def test_busy_disk_is_dropped_lazily(tmp_path: Path, formatted: FormattedImage, mounts: list[Path]) -> None:
    """Invariant: a disk still in use (an open folder on it) is detached from the tree anyway, so a
    closing sandbox never keeps its mount point."""
    target = _new_disk(tmp_path, formatted, mounts, "busy")
    held = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mounts.remove(target)
        drop_disk(target)
        assert not os.path.ismount(target)
    finally:
        os.close(held)


def test_image_name_that_is_a_symlink_is_refused(tmp_path: Path, formatted: FormattedImage) -> None:
    """Attack: the image's name already exists as a symlink to a host file. Invariant: make_disk
    refuses it (O_EXCL | O_NOFOLLOW) and never writes through it."""
    victim = tmp_path / "victim"
    victim.write_text("host file\n")
    (tmp_path / "evil.img").symlink_to(victim)
    (tmp_path / "evil").mkdir()
    with pytest.raises(Unavailable, match="File exists"):
        make_disk(tmp_path / "evil.img", tmp_path / "evil", formatted)
    assert victim.read_text() == "host file\n"


@pytest.mark.skipif(shutil.which("strace") is None, reason="kills the writer at a system call (make test-deps)")
def test_a_disk_image_cut_short_while_written_leaves_nothing_under_its_name(tmp_path: Path) -> None:
    """Found by attack (crash points): a server killed while it copied the formatted image into a new sandbox's
    disk left an image of zeros under its name; every later start failed to mount it and kept the sandbox's
    folder as "left by a crash", with an error line each time. Invariant: killed at its first write, the image
    has no name, and nothing is left in its folder."""
    folder = tmp_path / "sandbox"
    folder.mkdir()
    script = (
        "import sys\nfrom pathlib import Path\nfrom bastion.sandbox._disk import format_image, make_disk\n"
        "folder = Path(sys.argv[1])\nmake_disk(folder / 'disk.img', folder / 'workspace', format_image(folder, "
        f"{SIZE}))\n"
    )
    (folder / "workspace").mkdir()
    # Not -f: mkfs.ext4, a child, writes the format itself; the writer's first pwrite is the copy's.
    cut = subprocess.run(
        [
            *("strace", "-qq", "-o", "/dev/null", "-e", "trace=pwrite64", "-e", "inject=pwrite64:signal=KILL:when=1"),
            *(sys.executable, "-c", script, str(folder)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cut.returncode in (-9, 137), cut.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["workspace"]


def test_devpts_is_made_in_a_mount_namespace_of_its_own_and_attached_here(tmp_path: Path, mounts: list[Path]) -> None:
    """Invariant: a sandbox's devpts is made by a thread in a mount namespace other than the server's (the
    kernel lets only a devpts made from the initial namespace use the terminals kept for the host's own
    logins, kernel.pty.reserve), then attached in the server's: nosuid, noexec, its cap and ptmx 0666."""
    assert _disk.in_own_mount_namespace(lambda: os.readlink("/proc/thread-self/ns/mnt")) != os.readlink(
        "/proc/self/ns/mnt"
    )
    target = tmp_path / "pts"
    target.mkdir()
    _disk.mount_devpts(target, 7)
    mounts.append(target)
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        (line,) = (line.split() for line in info if line.split()[4] == str(target))
    assert {"nosuid", "noexec"} <= set(line[5].split(","))
    assert line[line.index("-") + 1] == "devpts"
    assert {"mode=620", "ptmxmode=666", "max=7"} <= set(line[-1].split(","))
    assert (target / "ptmx").stat().st_mode & 0o777 == 0o666


def test_an_image_is_formatted_by_a_server_that_is_not_dumpable_and_has_no_ptrace(tmp_path: Path) -> None:
    """Attack (found by review): a host workspace's file tools change their thread's file ids, which makes the
    kernel mark the server not dumpable; under the shipped unit (no CAP_SYS_PTRACE) mkfs could then no longer
    open the image as /proc/<server>/fd/N, and every sandbox failed to get a disk. mkfs gets the fd itself."""
    script = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE 0, as after a file-id change\n"
        "from bastion.sandbox._disk import format_image\n"
        "print(len(format_image(Path(sys.argv[1]), int(sys.argv[2])).extents))\n"
    )
    done = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_ptrace", sys.executable, "-c", script, str(tmp_path), str(SIZE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0
