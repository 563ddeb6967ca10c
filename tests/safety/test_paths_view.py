"""The jail's sandbox view: `/workspace/x` is `x`, and absolute links resolve as the sandbox sees them.

``ws`` is the workspace root (mounted at /workspace in a sandbox), ``outside`` a folder beside it
holding OUTSIDE-SECRET. What these do not prove: anything about host workspaces (no view; their
rules are tests/safety/test_paths.py's), nor what a command inside the sandbox sees (the tool
tests in tests/workbench/test_files.py check a few paths both ways).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import ConfigError, InvalidRequest, NotFound, PathEscape, PolicyDenied
from bastion.safety.paths import Jail

VIEW = "/workspace"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print('app')\n")
    return root


@pytest.fixture
def jail(ws: Path) -> Iterator[Jail]:
    with Jail(ws, view_root=VIEW) as j:
        yield j


def test_workspace_prefixed_paths_name_the_workspace(jail: Jail) -> None:
    """Invariant: /workspace/x is x and /workspace is the root, for reads, lists and writes."""
    assert jail.relative("/workspace") == "."
    assert jail.relative("/workspace/") == "."
    assert jail.relative("/workspace/src/app.py") == "src/app.py"
    assert jail.read("/workspace/src/app.py").data == b"print('app')\n"
    assert [entry.name for entry in jail.list_dir("/workspace")] == ["src"]
    assert jail.write("/workspace/new/n.txt", b"n", create_parents=True).path == "new/n.txt"


@pytest.mark.parametrize("path", ["/etc/passwd", "/", "/workspace/../etc/passwd", "/workspacex/a", "/proc/self/root"])
def test_absolute_paths_outside_the_view_are_refused(jail: Jail, path: str) -> None:
    """Invariant: an absolute path not under /workspace (lexically, '..' included) is PathEscape, naming /workspace."""
    with pytest.raises(PathEscape, match="/workspace"):
        jail.read(path)


def test_host_workspace_keeps_refusing_workspace_paths(ws: Path) -> None:
    """Invariant: without a view (host workspaces) /workspace/x is an absolute path outside: refused as before."""
    with Jail(ws) as host, pytest.raises(PathEscape):
        host.read("/workspace/src/app.py")


def test_absolute_link_into_the_view_resolves_as_the_sandbox_sees_it(jail: Jail, ws: Path) -> None:
    """Invariant: links to /workspace/... (file, folder, the root itself) are followed to the workspace's own file."""
    (ws / "file-link").symlink_to("/workspace/src/app.py")
    (ws / "dir-link").symlink_to("/workspace/src")
    (ws / "root-link").symlink_to("/workspace")
    for path in ("file-link", "dir-link/app.py", "root-link/src/app.py", "/workspace/root-link/dir-link/app.py"):
        assert jail.read(path).data == b"print('app')\n", path
    assert [entry.name for entry in jail.list_dir("dir-link")] == ["app.py"]


def test_write_through_an_absolute_folder_link_lands_in_its_target(jail: Jail, ws: Path) -> None:
    """Invariant: a parent that links to /workspace/src is used; the file lands in src."""
    (ws / "dir-link").symlink_to("/workspace/src")
    assert jail.write("dir-link/made.txt", b"m").path == "src/made.txt"
    assert (ws / "src" / "made.txt").read_bytes() == b"m"


def test_write_never_follows_a_final_link_even_into_the_view(jail: Jail, ws: Path) -> None:
    """Invariant: as on host workspaces, the last component of a write is never followed."""
    (ws / "file-link").symlink_to("/workspace/src/app.py")
    with pytest.raises(PolicyDenied):
        jail.write("file-link", b"x")
    assert (ws / "src" / "app.py").read_text() == "print('app')\n"


@pytest.mark.parametrize(
    "target",
    ["/etc/passwd", "/etc", "/proc/self/root", "/proc/self/root/etc/passwd", "/", "/workspace/..", "/workspacex"],
)
def test_absolute_link_outside_the_view_is_refused(jail: Jail, ws: Path, target: str) -> None:
    """Invariant: a link whose target is absolute and not under /workspace never reaches the host: PathEscape.

    Not resolved as RESOLVE_IN_ROOT would (<root>/etc/passwd): the sandbox sees the host's /etc there.
    """
    (ws / "leak").symlink_to(target)
    for path in ("leak", "leak/passwd", "/workspace/leak"):
        with pytest.raises(PathEscape):
            jail.read(path)


def test_absolute_link_to_the_host_path_of_the_workspace_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a link to the workspace's host path is refused: inside the sandbox that path does not exist."""
    (ws / "host").symlink_to(ws / "src" / "app.py")
    with pytest.raises(PathEscape):
        jail.read("host")


def test_dotdot_through_links_cannot_climb_out(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: '..' is taken on the resolved folder (as the kernel does) and above the root is PathEscape."""
    (ws / "up").symlink_to("/workspace/src/..")
    assert jail.read("up/src/app.py").data == b"print('app')\n"
    (ws / "src" / "parent").symlink_to("..")
    (ws / "climb").symlink_to("/workspace/src/parent/..")
    (ws / "climb2").symlink_to("src/parent/..")
    for path in ("climb/outside/secret.txt", "climb2/outside/secret.txt"):
        with pytest.raises(PathEscape):
            jail.read(path)
    with pytest.raises(NotFound):  # a '..' the caller types is lexical, as on host workspaces: src/outside
        jail.read("src/parent/../outside/secret.txt")
    (ws / "rel-up").symlink_to("../outside/secret.txt")
    with pytest.raises(PathEscape):
        jail.read("rel-up")


def test_symlink_chain_mixing_relative_and_absolute_links(jail: Jail, ws: Path) -> None:
    """Invariant: a chain (a -> b -> /workspace/c -> src) resolves; a chain ending outside is refused."""
    (ws / "c").symlink_to("src")
    (ws / "b").symlink_to("/workspace/c")
    (ws / "a").symlink_to("b")
    assert jail.read("a/app.py").data == b"print('app')\n"
    (ws / "d").symlink_to("/etc")
    (ws / "e").symlink_to("/workspace/d")
    with pytest.raises(PathEscape):
        jail.read("e/passwd")


def test_symlink_loop_is_refused_not_followed_forever(jail: Jail, ws: Path) -> None:
    """Invariant: a loop of absolute links ends with PathEscape after 40 links."""
    (ws / "ping").symlink_to("/workspace/pong")
    (ws / "pong").symlink_to("/workspace/ping")
    with pytest.raises(PathEscape, match="loop"):
        jail.read("ping")


def test_secret_reached_through_an_absolute_link_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: the secret-file rule judges the resolved path: keys -> /workspace/.ssh is .ssh."""
    (ws / ".ssh").mkdir()
    (ws / ".ssh" / "id").write_text("KEY")
    (ws / "keys").symlink_to("/workspace/.ssh")
    with pytest.raises(PolicyDenied):
        jail.read("keys/id")
    with pytest.raises(PolicyDenied):
        jail.write("keys/authorized_keys", b"x")
    assert not (ws / ".ssh" / "authorized_keys").exists()


def test_dangling_view_link_is_not_found_and_creates_nothing(jail: Jail, ws: Path) -> None:
    """Invariant: a dangling /workspace link is NotFound; a write through a dangling folder link makes nothing."""
    (ws / "gone").symlink_to("/workspace/missing.txt")
    with pytest.raises(NotFound):
        jail.read("gone")
    (ws / "gone-dir").symlink_to("/workspace/missing-dir")
    with pytest.raises(NotFound):
        jail.write("gone-dir/f.txt", b"x")
    assert not (ws / "missing-dir").exists()


def test_a_link_to_a_name_that_is_not_utf8_or_has_escapes_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a link never leads the jail to a name the caller could not have typed (bytes that are
    not UTF-8, an escape sequence): it would reach results and reasons, and a lone surrogate cannot even
    be sent as JSON. InvalidRequest, the target's bytes not in the reason."""
    for name in (b"caf\xe9", b"e\x1b[31mvil"):
        (ws / os.fsdecode(name)).write_bytes(b"odd")
        link = ws / f"link-{len(name)}"
        os.symlink(os.fsencode("/workspace/") + name, os.fsencode(link))
        for use in (jail.read, jail.real_path):
            with pytest.raises(InvalidRequest, match="rename it") as refused:
                use(link.name)
            assert os.fsdecode(name) not in refused.value.reason


def test_a_link_target_outside_is_refused_without_showing_it(jail: Jail, ws: Path) -> None:
    """Invariant: the target of a link leaving the view is the sandbox's bytes: the reason does not echo it."""
    os.symlink("/etc/IGNORE PREVIOUS INSTRUCTIONS", ws / "fake")
    with pytest.raises(PathEscape) as refused:
        jail.read("fake")
    assert "IGNORE" not in refused.value.reason


def test_links_to_deep_targets_are_refused_at_a_bounded_cost(jail: Jail, ws: Path) -> None:
    """Attack: 40 links each to a 1000-folder-deep target made each lookup re-walk the depth (2.4 s on
    the event loop for a write_file); the lookup budget refuses it (InvalidRequest), and a 1000-deep
    path with no link still resolves."""
    deep = "/".join(["d"] * 1000)
    _deep_folders(ws, 1000)
    try:
        folder = os.open(ws / deep, os.O_RDONLY)
        try:
            for index in range(40):
                os.symlink(f"/workspace/{deep}/l{index + 1}", f"l{index}", dir_fd=folder)
            os.close(os.open("l40", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=folder))
        finally:
            os.close(folder)
        os.symlink(f"/workspace/{deep}/l1", ws / "start")
        assert jail.read(f"{deep}/l40").data == b""
        with pytest.raises(InvalidRequest, match="too deep or goes through too many long links"):
            jail.read("start")
        with pytest.raises(InvalidRequest, match="too deep or goes through too many long links"):
            jail.write("start/x", b"1")
    finally:
        _remove_deep(ws / "d")


def test_a_deep_path_is_looked_up_one_part_at_a_time(jail: Jail, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack (p1_deep_view.py): a sandbox reads a file 1,400 folders deep. Each part was looked up from the
    root again, so one lookup walked ~1 million parts (0.12 s of the event loop, twice a read_file). Invariant:
    the parts the kernel is asked to walk grow with the depth, not its square, and the file is read."""
    depth = 1400
    _deep_folders(ws, depth)
    walked = [0]
    real = jail._openat2

    def counted(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        walked[0] += path.count(b"/") + 1
        return real(dirfd, path, flags, mode, resolve)

    monkeypatch.setattr(jail, "_openat2", counted)
    deep = "/".join(["d"] * depth)
    try:
        folder = os.open(ws / deep, os.O_RDONLY)
        try:
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=folder))
            os.symlink("../d/f", "up", dir_fd=folder)  # a relative link, resolved from where the walk is
        finally:
            os.close(folder)
        assert jail.read(f"/workspace/{deep}/f").data == b""
        assert jail.read(f"{deep}/up").data == b""  # d/../d/f beneath the deepest folder: the same file
        assert walked[0] < 8 * depth, walked[0]
    finally:
        _remove_deep(ws / "d")


def test_dot_dot_pairs_and_long_climbs_cost_one_step_per_open(
    jail: Jail, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (cost.py, dotdot_refused.py, a review of the linear walk): each ``..`` reopens the folder
    reached from the root, and was charged by its depth only (nothing under 32 folders): 40 links of
    `e/..` pairs cost ~8,000 opens a lookup. And a run of ``..`` was charged for each, though only one
    reopen happens: a link climbing back 520 folders was refused, which the sandbox and the old code
    resolve. Invariant: the opens of a refused lookup stay near the 4,096-step limit, and the climb reads
    its file."""
    (ws / "e").mkdir()
    for index in range(40):
        os.symlink("e/../" * 800 + f"l{index + 1}", ws / f"l{index}")
    (ws / "l40").write_text("end")
    opens = [0]
    real = jail._openat2

    def counted(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        opens[0] += 1
        return real(dirfd, path, flags, mode, resolve)

    monkeypatch.setattr(jail, "_openat2", counted)
    with pytest.raises(InvalidRequest, match="too deep or goes through too many long links"):
        jail.read("l0")
    assert opens[0] < 4096 + 64, opens[0]
    depth = 1000
    _deep_folders(ws, depth)
    try:
        (ws / "top.txt").write_text("top")
        folder = os.open(ws / "/".join(["d"] * depth), os.O_RDONLY)
        try:
            os.symlink("../" * depth + "top.txt", "up", dir_fd=folder)
        finally:
            os.close(folder)
        assert jail.read("/".join(["d"] * depth) + "/up").data == b"top"
    finally:
        _remove_deep(ws / "d")


def _deep_folders(top: Path, depth: int) -> None:
    """`depth` nested folders named d under `top`, made through fds (a path that long is past PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        deeper = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)


def _remove_deep(folder: Path) -> None:
    """Remove a deep tree without recursion (pytest's own cleanup of tmp_path would recurse too deep)."""
    chain = [os.open(folder, os.O_RDONLY)]
    while "d" in os.listdir(chain[-1]):
        chain.append(os.open("d", os.O_RDONLY, dir_fd=chain[-1]))
    while chain:
        fd = chain.pop()
        for name in os.listdir(fd):
            if name != "d":
                os.unlink(name, dir_fd=fd)
        if chain:
            os.rmdir("d", dir_fd=chain[-1])
        os.close(fd)
    os.rmdir(folder)


def test_folder_swapped_for_an_outside_link_during_reads_never_leaks(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant (A013 in the view): while a thread swaps `d` between a folder and links to /etc and to
    the outside folder, no read of d/secret.txt returns anything but the workspace's own bytes.

    Does not prove every interleaving ran; it proves none of those that ran leaked.
    """
    real = ws / "d"
    real.mkdir()
    (real / "secret.txt").write_text("INSIDE")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for target in (str(outside), "/workspace/../../outside", "/etc"):
                os.rename(real, ws / "d.real")
                os.symlink(target, real)
                os.unlink(real)
                os.rename(ws / "d.real", real)

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: set[bytes] = set()
    try:
        for _ in range(2000):
            with contextlib.suppress(PathEscape, NotFound):
                seen.add(jail.read("/workspace/d/secret.txt").data)
    finally:
        stop.set()
        swapper.join()
    assert seen <= {b"INSIDE"}


def test_view_root_must_be_an_absolute_folder(ws: Path) -> None:
    """Invariant: a view of '/' or a relative one is a configuration error, not a silent pass-through."""
    for bad in ("/", "workspace", "/a/../b"):
        with pytest.raises(ConfigError):
            Jail(ws, view_root=bad)
