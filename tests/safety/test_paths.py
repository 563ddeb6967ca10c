"""Regression tests for the jail: one per attack of tests/attacks/attack-corpus.json, named after it.

Each docstring states the invariant and what the test does not prove. Everything happens
under pytest's tmp_path: ``ws`` is the workspace root, ``outside`` a folder beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import json
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bastion.safety import paths as paths_module
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    PathEscape,
    PolicyDenied,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.paths import (
    DEFAULT_SECRET_PATTERNS,
    MAX_LIST_ENTRIES,
    MAX_NAME_BYTES,
    MAX_PATH_CHARS,
    MAX_READ_BYTES,
    MAX_WRITE_BYTES,
    DirEntry,
    Jail,
    file_replaceable_by,
    folder_changeable_by,
    folder_replaceable_by,
    privileged_files,
    replaceable_by,
    secret_file_problem,
)
from tests.helpers import passable_folder

CORPUS_FILE = Path(__file__).resolve().parents[1] / "attacks" / "attack-corpus.json"


def _corpus_cases() -> list[tuple[str, str, str]]:
    if not CORPUS_FILE.exists():
        return []
    cases = json.loads(CORPUS_FILE.read_text())
    return [
        (case["id"], case["input"], case["expect"])
        for case in cases
        if case["tool"] == "files.read" and isinstance(case["input"], str)
    ]


# --- the corpus, as data --------------------------------------------------------------


@pytest.mark.parametrize(("case_id", "path", "expect"), _corpus_cases())
def test_corpus_string_reads_are_refused_or_contained(
    jail: Jail, ws: Path, tmp_path: Path, case_id: str, path: str, expect: str
) -> None:
    """Invariant: every plain-string read attack of the shared corpus raises a BastionError.

    "contained" cases may only fail with NotFound (a literal name inside the jail). Does not
    prove anything about attacks needing setup; those have their own tests below.
    """
    sibling = Path(str(ws) + "_sensitive_credentials")
    sibling.mkdir()
    (sibling / "secret.txt").write_text("SIBLING")
    (ws / "README.md").write_text("readme")
    (ws / ".env").write_text("TOKEN=1")
    path = path.replace("{WORKSPACE}", str(ws))
    with pytest.raises(BastionError) as info:
        jail.read(path)
    if expect == "contained":
        assert isinstance(info.value, NotFound), case_id


# --- path traversal -------------------------------------------------------------------


def test_a001_dotdot_traversal_is_refused(jail: Jail) -> None:
    """Invariant: '..' above the root is refused lexically, before any syscall.

    Does not prove symlink-based escapes are refused (see the symlink tests).
    """
    with pytest.raises(PathEscape):
        jail.read("../../../../etc/passwd")
    with pytest.raises(PathEscape):
        jail.relative("a/../../b")


def test_dotdot_inside_the_root_is_normalized(jail: Jail, ws: Path) -> None:
    """Invariant: '..' that stays inside is normalized lexically. Does not prove kernel '..' semantics."""
    (ws / "b").write_text("bee")
    assert jail.relative("a/../b") == "b"
    assert jail.relative("./x//y/./") == "x/y"
    assert jail.relative(".") == "."
    assert jail.read("a/../b").data == b"bee"


def test_a002_absolute_path_outside_is_refused(jail: Jail) -> None:
    """Invariant: an absolute path outside the root is PathEscape. Does not test every prefix."""
    with pytest.raises(PathEscape):
        jail.read("/etc/passwd")
    with pytest.raises(PathEscape):
        jail.read("/")


def test_absolute_path_inside_is_made_relative(jail: Jail, ws: Path) -> None:
    """Invariant: an absolute path lexically under the root names the same file, relatively."""
    (ws / "f.txt").write_text("f")
    assert jail.relative(jail.root) == "."
    assert jail.relative(f"{jail.root}/a/../f.txt") == "f.txt"
    assert jail.read(f"{jail.root}/f.txt").data == b"f"
    with pytest.raises(PathEscape):
        jail.relative(f"{jail.root}/../x")


def test_a004_tilde_is_not_expanded(jail: Jail) -> None:
    """Invariant: a leading '~' is refused as PathEscape, whatever follows."""
    with pytest.raises(PathEscape, match="no home-folder expansion"):
        jail.read("~/.ssh/id_rsa")
    with pytest.raises(PathEscape):
        jail.read("~root/x")
    assert jail.relative("a/~b") == "a/~b"


def test_a005_sibling_sharing_the_root_prefix_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: the root is compared component by component, never as a string prefix.

    The sibling exists and is readable, so a startswith() check would have leaked it.
    """
    sibling = Path(str(ws) + "_sensitive_credentials")
    sibling.mkdir()
    (sibling / "secret.txt").write_text("SIBLING")
    assert (sibling / "secret.txt").read_text() == "SIBLING"
    with pytest.raises(PathEscape):
        jail.read(f"{ws}_sensitive_credentials/secret.txt")


# --- symlinks -------------------------------------------------------------------------


def test_a007_symlink_to_outside_file_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a final symlink leaving the root is refused by openat2 (EXDEV).

    Does not prove links inside the root are refused: they are followed, see below.
    """
    (ws / "leak").symlink_to("/etc/passwd")
    with pytest.raises(PathEscape):
        jail.read("leak")


def test_symlink_inside_the_root_is_followed_for_reads(jail: Jail, ws: Path) -> None:
    """Invariant: symlinks that stay beneath the root work for reads. Does not test writes."""
    (ws / "real").mkdir()
    (ws / "real" / "f.txt").write_text("inner")
    (ws / "alias").symlink_to("real")
    (ws / "flink").symlink_to("real/f.txt")
    assert jail.read("alias/f.txt").data == b"inner"
    assert jail.read("flink").data == b"inner"


def test_a008_relative_symlink_to_ancestors_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a relative link climbing above the root fails in the kernel lookup."""
    (ws / "up").symlink_to("../../..")
    with pytest.raises(PathEscape):
        jail.read("up/etc/passwd")
    with pytest.raises(PathEscape):
        jail.list_dir("up")


def test_a010_dangling_symlink_write_creates_nothing_outside(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: a write never follows a final symlink, so nothing is created at its target.

    Uses tmp_path/outside instead of /tmp/outside so tests do not share state.
    """
    target = outside / "created.txt"
    (ws / "dangling").symlink_to(target)
    with pytest.raises((PathEscape, PolicyDenied)):
        jail.write("dangling", b"x")
    with pytest.raises((PathEscape, PolicyDenied)):
        jail.write("dangling", b"x", append=True)
    assert not target.exists()
    assert (ws / "dangling").is_symlink()


def test_write_through_symlink_to_inside_file_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: even a final link that stays inside is not written through (writes never follow)."""
    (ws / "f.txt").write_text("orig")
    (ws / "lnk").symlink_to("f.txt")
    with pytest.raises(PolicyDenied):
        jail.write("lnk", b"new")
    assert (ws / "f.txt").read_text() == "orig"


def test_a011_symlink_chain_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a chain a -> b -> /etc is refused at the absolute link, whatever the chain length."""
    (ws / "a").symlink_to("b")
    (ws / "b").symlink_to("/etc")
    with pytest.raises(PathEscape):
        jail.read("a/hostname")


def test_symlink_loop_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a loop ends in an error, not a hang."""
    (ws / "x").symlink_to("y")
    (ws / "y").symlink_to("x")
    with pytest.raises(PathEscape):
        jail.read("x")


def test_write_into_symlinked_folder_leaving_root_is_refused(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: an intermediate link leaving the root refuses writes; nothing is created outside."""
    (ws / "out").symlink_to(outside)
    with pytest.raises(PathEscape):
        jail.write("out/new.txt", b"x")
    with pytest.raises(PathEscape):
        jail.write("out/deep/new.txt", b"x", create_parents=True)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_a013_jail_refuses_symlink_swapped_after_check(jail: Jail, ws: Path) -> None:
    """Invariant: while a thread swaps folder ``d`` with a symlink ``d -> /etc``, every read of
    ``d/passwd`` either returns the inside content or raises a BastionError; it never returns
    /etc/passwd.

    Does not prove: that the race window was hit on any given run (scheduling decides), nor
    anything about races on the root itself (the root fd is held, so there is none to win).
    """
    real_passwd = Path("/etc/passwd").read_bytes() if Path("/etc/passwd").exists() else None
    (ws / "d").mkdir()
    (ws / "d" / "passwd").write_text("inside")
    stop = threading.Event()

    def swap() -> None:
        for _ in range(50_000):
            if stop.is_set():
                return
            os.rename(ws / "d", ws / "d.real")
            os.symlink("/etc", ws / "d")
            os.unlink(ws / "d")
            os.rename(ws / "d.real", ws / "d")

    swapper = threading.Thread(target=swap, daemon=True)
    outcomes = {"ok": 0, "refused": 0}
    deadline = time.monotonic() + 0.5
    swapper.start()
    try:
        for _ in range(100_000):
            if time.monotonic() > deadline or not swapper.is_alive():
                break
            try:
                data = jail.read("d/passwd").data
            except BastionError:
                outcomes["refused"] += 1
                continue
            assert data == b"inside"
            assert data != real_passwd
            outcomes["ok"] += 1
    finally:
        stop.set()
        swapper.join(timeout=10)
    assert not swapper.is_alive()
    assert outcomes["ok"] + outcomes["refused"] > 0


# --- special files --------------------------------------------------------------------


def test_a014_proc_self_root_is_refused(jail: Jail) -> None:
    """Invariant: /proc paths are absolute outside the root: PathEscape before any syscall."""
    with pytest.raises(PathEscape):
        jail.read("/proc/self/root/etc/passwd")


def test_proc_magic_link_inside_root_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a symlink into /proc magic links is refused (absolute link: EXDEV)."""
    (ws / "self").symlink_to("/proc/self/root")
    with pytest.raises(PathEscape):
        jail.read("self/etc/passwd")


def test_a016_dev_zero_is_refused(jail: Jail) -> None:
    """Invariant: /dev/zero is outside the root. Device nodes inside are tested separately."""
    with pytest.raises(PathEscape):
        jail.read("/dev/zero")


def test_device_node_inside_root_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a character device inside the workspace is not read or written.

    Skipped when this process may not create device nodes.
    """
    try:
        os.mknod(ws / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("cannot create device nodes here")
    with pytest.raises(PolicyDenied, match="not a regular file"):
        jail.read("zero")
    with pytest.raises(PolicyDenied, match="not a regular file"):
        jail.write("zero", b"x")


def test_fifo_inside_root_is_refused_without_blocking(jail: Jail, ws: Path) -> None:
    """Invariant: reading or writing a FIFO fails at once instead of blocking the server.

    The work runs in a thread joined with a timeout, so a regression fails instead of hanging.
    """
    os.mkfifo(ws / "pipe")
    errors: list[BaseException] = []

    def attempt() -> None:
        for op in (lambda: jail.read("pipe"), lambda: jail.write("pipe", b"x")):
            try:
                op()
            except BaseException as exc:
                errors.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert len(errors) == 2
    assert all(isinstance(exc, PolicyDenied) for exc in errors)


def test_folder_is_not_read_as_a_file(jail: Jail, ws: Path) -> None:
    """Invariant: a folder is InvalidRequest for read and write."""
    (ws / "sub").mkdir()
    with pytest.raises(InvalidRequest):
        jail.read("sub")
    with pytest.raises(InvalidRequest):
        jail.write("sub", b"x")
    with pytest.raises(InvalidRequest):
        jail.write(".", b"x")


# --- characters and lengths -----------------------------------------------------------


def test_a017_nul_byte_is_refused(jail: Jail) -> None:
    """Invariant: NUL never reaches a syscall (which would truncate the path at it)."""
    with pytest.raises(InvalidRequest, match="NUL"):
        jail.read("notes.txt\x00../../etc/passwd")


@pytest.mark.parametrize(
    "path",
    ["a\nb", "a\rb", "a\x1bb", "evil\u202etxt.exe", "zero\u200bwidth", "a\u2028b", "bom\ufeff", "lone\ud800"],
)
def test_control_and_invisible_characters_are_refused(jail: Jail, path: str) -> None:
    """Invariant: Cc, Cf (bidi, zero-width), Cs, Zl and Zp characters are refused lexically."""
    with pytest.raises(InvalidRequest):
        jail.relative(path)


@pytest.mark.parametrize(
    ("case_id", "name"),
    [("a019", "．．／．．／etc／passwd"), ("a020", "a∕..∕..∕etc∕passwd"), ("a023", "%2e%2e%2f%2e%2e%2fetc%2fpasswd")],
)
def test_a019_a020_a023_lookalike_separators_are_literal_names(jail: Jail, ws: Path, case_id: str, name: str) -> None:
    """Invariant: fullwidth, division-slash and percent-encoded names are one literal name inside
    the root: NotFound when absent, the inside file when present.

    Does not prove a later layer never normalizes them; this module never does.
    """
    with pytest.raises(NotFound):
        jail.read(name)
    assert jail.relative(name) == name
    (ws / name).write_text(case_id)
    assert jail.read(name).data == case_id.encode()


def test_a025_overlong_name_write_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant: a 300-character name is refused before touching the disk; nothing is created."""
    with pytest.raises(InvalidRequest):
        jail.write("A" * 300, b"x")
    with pytest.raises(InvalidRequest):
        jail.relative("é" * 128)  # 256 UTF-8 bytes
    assert jail.relative("A" * MAX_NAME_BYTES) == "A" * MAX_NAME_BYTES
    assert list(ws.iterdir()) == []


def test_overlong_path_is_refused(jail: Jail) -> None:
    """Invariant: paths over MAX_PATH_CHARS characters are refused."""
    with pytest.raises(InvalidRequest):
        jail.relative("a/" * (MAX_PATH_CHARS // 2) + "b")


def test_a026_colon_stream_name_is_a_literal_name(jail: Jail, ws: Path) -> None:
    """Invariant: 'README.md:hidden_stream' is a literal name on Linux; it does not reach README.md."""
    (ws / "README.md").write_text("readme")
    with pytest.raises(NotFound):
        jail.read("README.md:hidden_stream")


def test_a028_unc_path_is_refused(jail: Jail) -> None:
    """Invariant: any backslash is refused, so UNC paths never reach the file system."""
    with pytest.raises(InvalidRequest, match="backslash"):
        jail.read("\\\\attacker.example\\share\\x")
    with pytest.raises(InvalidRequest):
        jail.write("a\\b", b"x")


def test_empty_path_is_refused(jail: Jail) -> None:
    """Invariant: an empty path is a malformed request, not the root."""
    with pytest.raises(InvalidRequest):
        jail.relative("")


# --- secrets and hard links -----------------------------------------------------------


@pytest.mark.parametrize(
    "path", [".env", ".ENV", ".env.local", "sub/.env", "key.PEM", "server.key", ".ssh/config", "id_rsa.pub"]
)
def test_a029_secret_files_are_refused(jail: Jail, ws: Path, path: str) -> None:
    """Invariant: a name matching a secret pattern (any component, any case) is refused for read
    and write, whether or not the file exists. Does not inspect content.
    """
    with pytest.raises(PolicyDenied, match="secret-file rule"):
        jail.read(path)
    with pytest.raises(PolicyDenied, match="secret-file rule"):
        jail.write(path, b"x", create_parents=True)
    assert list(ws.iterdir()) == []


def test_secret_reached_through_innocent_symlink_is_refused(jail: Jail, ws: Path) -> None:
    """Invariant (best effort, via /proc): a read through a link to a secret name is refused."""
    (ws / ".env").write_text("TOKEN=1")
    (ws / "innocent.txt").symlink_to(".env")
    with pytest.raises(PolicyDenied):
        jail.read("innocent.txt")


def test_secret_message_names_the_rule(jail: Jail) -> None:
    """Invariant: the refusal says which name matched which rule and what to do."""
    with pytest.raises(PolicyDenied) as info:
        jail.read(".env")
    assert info.value.reason == "'.env' matches the secret-file rule '.env': ask the administrator"


def test_secret_patterns_are_configurable(ws: Path) -> None:
    """Invariant: custom patterns replace the defaults; malformed ones stop the start-up."""
    (ws / ".env").write_text("ok")
    with Jail(ws, secret_patterns=("*.secret",)) as custom:
        assert custom.read(".env").data == b"ok"
        with pytest.raises(PolicyDenied):
            custom.write("a.SECRET", b"x")
    with pytest.raises(ConfigError):
        Jail(ws, secret_patterns="*.secret")
    with pytest.raises(ConfigError):
        Jail(ws, secret_patterns=("a/b",))
    assert ".env" in DEFAULT_SECRET_PATTERNS


def test_hardlink_to_outside_file_is_refused(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: a file with more than one link is neither read nor written (or truncated).

    Does not prove a single-link file was never linked before; nlink is a point-in-time count.
    """
    os.link(outside / "secret.txt", ws / "hl.txt")
    with pytest.raises(PolicyDenied, match="hard links"):
        jail.read("hl.txt")
    with pytest.raises(PolicyDenied, match="hard links"):
        jail.write("hl.txt", b"")
    assert (outside / "secret.txt").read_text() == "OUTSIDE-SECRET"


def test_hardlinks_allowed_when_opted_in(ws: Path, outside: Path) -> None:
    """Invariant: allow_hardlinks (dangerous) lifts only the link-count rule."""
    os.link(outside / "secret.txt", ws / "hl.txt")
    with Jail(ws, allow_hardlinks=True) as permissive:
        assert permissive.read("hl.txt").data == b"OUTSIDE-SECRET"


# --- ordinary behaviour ---------------------------------------------------------------


def test_read_offset_length_and_eof(jail: Jail, ws: Path) -> None:
    """Invariant: offset/length select bytes; eof says whether the end was reached."""
    (ws / "f.txt").write_bytes(b"0123456789")
    head = jail.read("f.txt", length=4)
    assert (head.data, head.size, head.eof, head.path) == (b"0123", 10, False, "f.txt")
    tail = jail.read("f.txt", offset=6)
    assert (tail.data, tail.eof) == (b"6789", True)
    assert jail.read("f.txt", offset=50).data == b""
    with pytest.raises(InvalidRequest):
        jail.read("f.txt", offset=-1)


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63, 2**64, 10**30])
def test_an_offset_past_what_pread_takes_reads_nothing_instead_of_failing(jail: Jail, ws: Path, offset: int) -> None:
    """Attack: read_file(offset=2**64) reached pread(2), which refuses an offset past 2**63 - 1 with Python's
    OverflowError: INTERNAL_ERROR and a traceback in the log. Past the end of a file there is nothing to read."""
    (ws / "f.txt").write_bytes(b"0123456789")
    past = jail.read("f.txt", offset=offset, margin=16)
    assert (past.data, past.eof, past.size, past.before, past.after) == (b"", True, 10, b"", b"")


def test_read_is_capped(jail: Jail, ws: Path) -> None:
    """Invariant: no read returns more than MAX_READ_BYTES, whatever length is asked."""
    (ws / "big").write_bytes(b"x" * (MAX_READ_BYTES + 10))
    result = jail.read("big", length=MAX_READ_BYTES * 4)
    assert len(result.data) == MAX_READ_BYTES
    assert not result.eof


def test_write_create_truncate_append(jail: Jail, ws: Path) -> None:
    """Invariant: write creates, replaces, or appends, and reports which."""
    first = jail.write("f.txt", b"hello world")
    assert (first.created, first.bytes_written, first.path) == (True, 11, "f.txt")
    second = jail.write("f.txt", b"bye")
    assert second.created is False
    assert (ws / "f.txt").read_bytes() == b"bye"
    jail.write("f.txt", b"!", append=True)
    assert (ws / "f.txt").read_bytes() == b"bye!"
    assert stat.S_IMODE((ws / "f.txt").stat().st_mode) & 0o022 == 0


def test_write_limit(jail: Jail, ws: Path) -> None:
    """Invariant: more than MAX_WRITE_BYTES is refused before anything is created."""
    with pytest.raises(ResourceLimit):
        jail.write("big", b"x" * (MAX_WRITE_BYTES + 1))
    assert not (ws / "big").exists()


def test_write_parents(jail: Jail, ws: Path) -> None:
    """Invariant: missing parents are an error unless create_parents, which creates them inside."""
    with pytest.raises(NotFound, match="create_parents"):
        jail.write("a/b/c.txt", b"x")
    jail.write("a/b/c.txt", b"x", create_parents=True)
    assert (ws / "a" / "b" / "c.txt").read_bytes() == b"x"
    (ws / "file").write_text("")
    with pytest.raises(NotFound):
        jail.write("file/x.txt", b"x", create_parents=True)


def test_write_parents_through_inner_symlink(jail: Jail, ws: Path) -> None:
    """Invariant: an inner symlink that stays beneath the root may be a parent."""
    (ws / "real").mkdir()
    (ws / "alias").symlink_to("real")
    jail.write("alias/new/x.txt", b"x", create_parents=True)
    assert (ws / "real" / "new" / "x.txt").read_bytes() == b"x"


def test_write_parents_through_an_inner_link_to_a_secret_folder_is_still_judged(jail: Jail, ws: Path) -> None:
    """Invariant: parents made beneath a link are judged by their real path, as when every part was looked
    up from the root (the walk now looks each part up beneath the last)."""
    (ws / ".ssh").mkdir()
    (ws / "keys").symlink_to(".ssh")
    with pytest.raises(PolicyDenied, match="secret-file rule"):
        jail.write("keys/new/authorized_keys2", b"x", create_parents=True)
    assert list((ws / ".ssh").iterdir()) == []


def test_a_deep_new_path_costs_linear_lookups_not_quadratic(
    jail: Jail, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (found 2026-12-06): write_file to a new path 2,000 folders deep opened every prefix from the
    root again, about d^2/2 lookups of a part: 0.7 s a call. Each part is now looked up beneath the last.
    Counted as the kernel is asked: the parts of every path given to openat2 (the real one, counted)."""
    real, asked = jail._openat2, [0]

    def counted(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        asked[0] += len([part for part in path.split(b"/") if part])
        return real(dirfd, path, flags, mode, resolve)

    monkeypatch.setattr(jail, "_openat2", counted)
    depth = 2_000
    try:
        jail.write("n/" + "d/" * depth + "f", b"x", create_parents=True)
        made = (ws / "n").is_dir()
    finally:
        subprocess.run(["rm", "-rf", str(ws / "n")], check=True)  # deeper than pytest's own cleanup can recurse
    assert made
    assert asked[0] < 5 * depth, f"{asked[0]} parts looked up for a path {depth} deep"


def test_a_path_past_path_max_with_the_workspaces_own_is_refused_in_plain_words(jail: Jail, ws: Path) -> None:
    """Found by the full suite: a file ~2,000 folders deep passed 4,096 characters with the workspace's own
    path, the kernel could not name where it leads, and the refusal said /proc/self/fd was unreadable."""
    rel = "n/" + "d/" * (2_048 - len(str(ws)) // 2) + "f"
    try:
        with pytest.raises(InvalidRequest, match="is too deep to check: with the workspace folder's own path"):
            jail.write(rel, b"x", create_parents=True)
    finally:
        subprocess.run(["rm", "-rf", str(ws / "n")], check=True)  # deeper than pytest's own cleanup can recurse


def test_list_dir(jail: Jail, ws: Path) -> None:
    """Invariant: entries are sorted, typed with lstat, and symlinks are never followed."""
    (ws / "b.txt").write_text("12345")
    (ws / "a").mkdir()
    (ws / "leak").symlink_to("/etc/passwd")
    os.mkfifo(ws / "p")
    assert jail.list_dir() == (
        DirEntry("a", "dir", 0),
        DirEntry("b.txt", "file", 5),
        DirEntry("leak", "symlink", 0),
        DirEntry("p", "other", 0),
    )
    with pytest.raises(InvalidRequest):
        jail.list_dir("b.txt")
    with pytest.raises(PathEscape):
        jail.list_dir("/etc")


def test_list_dir_entry_cap(jail: Jail, ws: Path) -> None:
    """Invariant: listing more than MAX_LIST_ENTRIES entries is a ResourceLimit, not a huge reply."""
    big = ws / "big"
    big.mkdir()
    for index in range(MAX_LIST_ENTRIES + 1):
        os.close(os.open(big / f"{index}", os.O_CREAT | os.O_WRONLY, 0o600))
    with pytest.raises(ResourceLimit):
        jail.list_dir("big")


def test_stat_and_open_dir_fd(jail: Jail, ws: Path) -> None:
    """Invariant: stat refuses a final symlink; open_dir_fd returns a folder fd beneath the root."""
    (ws / "sub").mkdir()
    (ws / "f.txt").write_text("abc")
    (ws / "lnk").symlink_to("f.txt")
    assert jail.stat("f.txt").st_size == 3
    with pytest.raises(PolicyDenied):
        jail.stat("lnk")
    fd = jail.open_dir_fd("sub")
    try:
        assert os.path.samestat(os.fstat(fd), (ws / "sub").stat())
    finally:
        os.close(fd)
    with pytest.raises(InvalidRequest):
        jail.open_dir_fd("f.txt")
    with pytest.raises(PathEscape):
        jail.open_dir_fd("..")


def test_root_validation(tmp_path: Path) -> None:
    """Invariant: the root must be an existing absolute folder."""
    with pytest.raises(InvalidRequest):
        Jail("relative/root")
    with pytest.raises(NotFound):
        Jail(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequest):
        Jail(tmp_path / "file")


def test_a_root_reached_through_a_symlink_is_refused_and_a_closed_jail_refuses(tmp_path: Path) -> None:
    """Attack: a user who owns a component of the configured folder (``code`` in /home/alice/code) turns it into
    a link to /etc; realpath-then-open made the root server's file tools work in /etc. The root is opened with
    no link allowed anywhere in its path, and the refusal names the real path to configure."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PathEscape) as refused:
        Jail(tmp_path / "link")
    assert f"goes through the symbolic link '{tmp_path / 'link'}' (it leads to '{tmp_path / 'real'}')" in (
        refused.value.reason
    )
    (tmp_path / "real" / "sub").mkdir()
    with pytest.raises(PathEscape) as refused:
        Jail(tmp_path / "link" / "sub")  # a link in the middle of the path, not only the last component
    assert f"goes through the symbolic link '{tmp_path / 'link'}'" in refused.value.reason
    jail = Jail(tmp_path / "real")
    assert jail.root == str(tmp_path / "real")
    jail.close()
    jail.close()
    with pytest.raises(Unavailable, match="closed"):
        jail.read("x")


def _fds_open_on(folder: Path) -> int:
    target = str(folder.resolve())
    return sum(1 for fd in os.listdir("/proc/self/fd") if _readlink_or_none(f"/proc/self/fd/{fd}") == target)


def _readlink_or_none(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def test_jail_closed_by_another_thread_keeps_its_root_fd_until_the_running_operation_ends(tmp_path: Path) -> None:
    """Invariant: `close` while an operation runs (a worker thread reading a sandbox's files as
    close_sandbox closes it) leaves the root fd open until that operation ends, so its number is
    never handed to the next `open` of the process (another sandbox's root) beneath which the
    operation would go on resolving paths; an operation starting after `close` is refused with
    UNAVAILABLE (found by the load test: list_directory racing close_sandbox was INTERNAL_ERROR).
    The running operation is held by the lease every public method takes; this does not run one.
    """
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    jail = Jail(tmp_path / "a")
    with jail._lease():  # what each operation holds for its run
        jail.close()
        other = Jail(tmp_path / "b")  # the next open of the process
        assert _fds_open_on(tmp_path / "a") == 1, "the root stays open under the running operation"
        with pytest.raises(Unavailable, match="closed"):
            jail.list_dir(".")
    assert _fds_open_on(tmp_path / "a") == 0, "and is closed when it ends"
    other.close()


def test_root_fd_survives_rename_of_root(tmp_path: Path) -> None:
    """Invariant: the jail keeps using the folder it opened, even if the path is renamed and
    replaced. Does not prove absolute paths still map (they are lexical, by the old name).
    """
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f.txt").write_text("original")
    with Jail(tmp_path / "ws") as jail:
        os.rename(tmp_path / "ws", tmp_path / "moved")
        (tmp_path / "ws").mkdir()
        (tmp_path / "ws" / "f.txt").write_text("impostor")
        assert jail.read("f.txt").data == b"original"


@pytest.mark.parametrize(
    ("path", "refusal", "names"),
    [
        ("missing.txt", NotFound, {"ENOENT"}),
        ("file.txt/x", NotFound, {"ENOTDIR"}),
        ("escape/secret.txt", PathEscape, {"EXDEV", "ELOOP"}),
    ],
)
def test_errno_becomes_a_typed_refusal_naming_it(
    ws: Path, outside: Path, jail: Jail, path: str, refusal: type[BastionError], names: set[str]
) -> None:
    """Invariant: an errno from the kernel becomes the refusal a caller can act on, and its name
    reaches the audit detail. Does not prove every errno of the mapping (ENOSPC, EROFS, ...)."""
    (ws / "file.txt").write_text("x")
    (ws / "escape").symlink_to(outside)
    with pytest.raises(refusal) as refused:
        jail.read(path)
    assert any(name in refused.value.detail for name in names), refused.value.detail


# --- properties -----------------------------------------------------------------------

_SAFE_NAME = st.text(alphabet=st.sampled_from("abcXYZ019_-.é"), min_size=1, max_size=12).filter(
    lambda name: name not in (".", "..")
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.one_of(
        st.text(max_size=200), st.lists(st.sampled_from(["..", ".", "", "a", "~", "\x00", "\\"])).map("/".join)
    )
)
def test_relative_result_is_always_contained(jail: Jail, path: str) -> None:
    """Invariant: relative() raises a BastionError or returns a relative path without '..' or NUL.

    Does not prove the kernel open stays inside; that is openat2's job, tested above.
    """
    try:
        rel = jail.relative(path)
    except BastionError:
        return
    assert not rel.startswith("/")
    assert ".." not in rel.split("/")
    assert "\x00" not in rel
    assert "" not in rel.split("/")


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.just(".."), st.just("."), _SAFE_NAME), min_size=1, max_size=12))
def test_relative_escapes_iff_depth_goes_negative(jail: Jail, parts: list[str]) -> None:
    """Invariant: a relative path escapes exactly when a depth count drops below zero, and
    otherwise equals a reference stack normalization.
    """
    stack: list[str] = []
    escapes = False
    for part in parts:
        if part == "..":
            if not stack:
                escapes = True
                break
            stack.pop()
        elif part != ".":
            stack.append(part)
    path = "/".join(parts)
    if escapes:
        with pytest.raises(PathEscape):
            jail.relative(path)
    else:
        assert jail.relative(path) == ("/".join(stack) or ".")


def _is_secret(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name.lower(), pattern.lower()) for pattern in DEFAULT_SECRET_PATTERNS)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(
        alphabet=st.characters(categories=["L", "N"], include_characters="._- ", exclude_characters="/"),
        min_size=1,
        max_size=40,
    ).filter(lambda name: name not in (".", "..") and not name.startswith("~") and not _is_secret(name)),
    data=st.binary(max_size=4096),
)
def test_write_read_round_trip(jail: Jail, name: str, data: bytes) -> None:
    """Invariant: what is written under a safe name reads back identically. Does not test races."""
    written = jail.write(name, data)
    assert written.bytes_written == len(data)
    result = jail.read(name)
    assert result.data == data
    assert result.eof
    assert result.size == len(data)


def test_privileged_files_finds_setuid_setgid_exec_and_capabilities_but_follows_no_link(tmp_path: Path) -> None:
    """Invariant: the start-time scan of a host workspace names a file that runs with privileges
    (setuid; setgid with group exec; a security.capability attribute), without following symlinks
    or leaving the filesystem, and says when it stopped early."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    plain = tmp_path / "a" / "b" / "plain"
    plain.write_bytes(b"x")
    assert privileged_files(tmp_path) == ([], False)
    marker = tmp_path / "a" / "b" / "marker"
    marker.write_bytes(b"x")
    marker.chmod(0o2644)  # setgid without group exec: a locking marker, not a privilege
    assert privileged_files(tmp_path) == ([], False)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    try:
        (outside / "suid").write_bytes(b"x")
        (outside / "suid").chmod(0o4755)
        (tmp_path / "link").symlink_to(outside)
        assert privileged_files(tmp_path) == ([], False)  # the link is not followed
    finally:
        (outside / "suid").unlink()
        outside.rmdir()
    plain.chmod(0o2755)
    assert privileged_files(tmp_path) == (["a/b/plain"], False)
    plain.chmod(0o4700)
    assert privileged_files(tmp_path) == (["a/b/plain"], False)
    plain.chmod(0o755)
    assert privileged_files(tmp_path, max_entries=2) == ([], True)


def test_privileged_files_names_several_at_once_up_to_its_bound(tmp_path: Path) -> None:
    """Found by attack (an upgrade from a bastion whose agents were root on the host): a workspace held four
    setuid files, and each start named one, so the administrator fixed and restarted four times. Invariant:
    every one is named, up to `most`."""
    names = ("a", "b", "c")
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        (tmp_path / name).chmod(0o4755)
    try:
        found, cut = privileged_files(tmp_path)
        assert sorted(found) == list(names)
        assert not cut
        assert len(privileged_files(tmp_path, most=2)[0]) == 2
    finally:
        for name in names:
            (tmp_path / name).chmod(0o644)


def _deep_folder(root: int, levels: int) -> tuple[int, str]:
    """A chain of `levels` folders of 250-character names in the folder `root` (an fd), made by fd (it may pass
    PATH_MAX); an fd of the last one, and its path relative to `root`."""
    name = "d" * 250
    fd = os.dup(root)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd, "/".join([name] * levels)


def test_privileged_file_scans_a_large_deep_folder_in_little_memory(tmp_path: Path) -> None:
    """Attack (found by attack, twenty-eighth session): an agent left a folder 15 names of 250 characters deep
    holding 100,000 files; the start-time scan listed it whole, each entry with its full path, and every later
    start took 470 MiB more. Invariant: the scan's memory does not grow with the folder (here 20,000 files: 94
    MB before), and a folder past PATH_MAX is scanned too (it was skipped unchecked)."""
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    crowded, crowded_path = _deep_folder(top, 15)  # 3,765 bytes: under PATH_MAX
    deepest, deepest_path = _deep_folder(crowded, 3)  # past it
    try:
        for n in range(20_000):
            os.close(os.open(f"f{n:05}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=crowded))
        os.close(os.open("late", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=deepest))
        tracemalloc.start()
        try:
            assert privileged_files(tmp_path) == ([], False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"the scan held {peak >> 20} MiB"
        os.chmod("late", 0o2755, dir_fd=deepest)  # setgid with group exec; reset below, gone with tmp_path
        assert privileged_files(tmp_path) == ([f"{crowded_path}/{deepest_path}/late"], False)
        os.chmod("late", 0o644, dir_fd=deepest)
    finally:
        for fd in (top, crowded, deepest):
            os.close(fd)


_SCAN = (
    "import json, sys\nfrom bastion.safety.paths import privileged_files\n"
    "print(json.dumps(privileged_files(sys.argv[1])))"
)


def _scan_with_fds(root: Path, soft_limit: int) -> list[object]:
    """`privileged_files(root)` in an interpreter of its own whose soft open-file limit is `soft_limit`."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    done = subprocess.run(
        [sys.executable, "-c", _SCAN, str(root)], preexec_fn=limit, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    found: list[object] = json.loads(done.stdout)
    return found


def test_privileged_files_says_it_stopped_short_when_out_of_fds(tmp_path: Path) -> None:
    """Found by review (twenty-eighth session): the scan by fd holds two fds a level, and under a soft limit of
    400 a setgid program 200 folders deep was skipped as a folder gone, the walk saying all was checked.
    Invariant: found, or the walk says it stopped short (the start then warns)."""
    deep = tmp_path.joinpath(*["d"] * 200)
    deep.mkdir(parents=True)
    (deep / "tool").write_text("x")
    (deep / "tool").chmod(0o2755)  # setgid with group exec; gone with tmp_path
    assert _scan_with_fds(tmp_path, 20_000) == [["/".join(["d"] * 200) + "/tool"], False]
    found, cut = _scan_with_fds(tmp_path, 200)
    assert found or cut is True, "a privileged file was skipped and the walk said all was checked"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="setting security.capability needs CAP_SETFCAP")
def test_privileged_files_finds_file_capabilities(tmp_path: Path) -> None:
    capable = tmp_path / "capable"
    capable.write_bytes(b"x")
    # struct vfs_cap_data, revision 2, CAP_NET_RAW (13) permitted and effective.
    os.setxattr(capable, "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0))
    assert privileged_files(tmp_path) == (["capable"], False)


# --- the secret-file rule on the real path (issue 13, finding 5) ------------------------------


def _secret_folder(ws: Path) -> dict[str, bytes]:
    """A .ssh folder with an authorized_keys, and a snapshot of everything in it."""
    (ws / ".ssh").mkdir()
    (ws / ".ssh" / "sub").mkdir()
    (ws / ".ssh" / "authorized_keys").write_bytes(b"ssh-ed25519 AAAA admin\n")
    return _tree(ws / ".ssh")


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): (path.read_bytes() if path.is_file() else b"<dir>")
        for path in sorted(folder.rglob("*"))
    }


# Each makes `keys` lead into .ssh (or its sub-folder, `keys/sub` then being one level deeper).
_SECRET_LINKS: dict[str, list[tuple[str, str | None]]] = {
    "relative": [("keys", ".ssh")],
    "dot-slash": [("keys", "./.ssh")],
    "through-dotdot": [("plain", None), ("keys", "plain/../.ssh")],
    "chained": [("keys", "k2"), ("k2", "k3"), ("k3", ".ssh")],
    "nested-parent": [("plain", None), ("plain/keys", "../.ssh")],
}


@pytest.mark.parametrize("shape", sorted(_SECRET_LINKS))
def test_secret_folder_through_a_symlinked_parent_is_refused_for_every_operation(
    jail: Jail, ws: Path, shape: str
) -> None:
    """Invariant: with a link leading into .ssh (relative, ./, chained, through '..', or in a
    sub-folder), no jail operation reads, writes, creates, lists, stats or hands out a cwd in
    it: the rule judges the real path the kernel opened. Nothing in .ssh changes.

    Does not prove a rename racing the check is caught (see the module docstring).
    """
    before = _secret_folder(ws)
    for name, target in _SECRET_LINKS[shape]:
        if target is None:
            (ws / name).mkdir()
        else:
            (ws / name).symlink_to(target)
    keys = "plain/keys" if shape == "nested-parent" else "keys"
    refused = (PolicyDenied,)
    with pytest.raises(refused, match="secret-file rule"):
        jail.read(f"{keys}/authorized_keys")
    with pytest.raises(refused, match="secret-file rule"):
        jail.write(f"{keys}/authorized_keys", b"ssh-ed25519 EVIL attacker\n")
    with pytest.raises(refused, match="secret-file rule"):
        jail.write(f"{keys}/authorized_keys", b"ssh-ed25519 EVIL attacker\n", append=True)
    with pytest.raises(refused, match="secret-file rule"):
        jail.write(f"{keys}/new_file", b"x", exclusive=True)
    with pytest.raises(refused, match="secret-file rule"):
        jail.write(f"{keys}/new/deeper/file", b"x", create_parents=True)
    with pytest.raises(refused, match="secret-file rule"):
        jail.write(f"{keys}/sub/file", b"x", create_parents=True)
    with pytest.raises(refused, match="secret-file rule"):
        jail.list_dir(keys)
    with pytest.raises(refused, match="secret-file rule"):
        jail.list_dir(f"{keys}/sub")
    with pytest.raises(refused, match="secret-file rule"):
        jail.stat(f"{keys}/authorized_keys")
    with pytest.raises(refused, match="secret-file rule"):
        jail.open_dir_fd(keys)
    with pytest.raises(refused, match="secret-file rule"):
        jail.kind(f"{keys}/authorized_keys")
    assert _tree(ws / ".ssh") == before


def test_secret_file_through_an_innocent_link_is_refused_for_every_operation(jail: Jail, ws: Path) -> None:
    """Invariant: a link with an innocent name to a secret file (``notes -> .env``) or into a
    folder holding one is refused on read, stat and kind, and is never written through.
    """
    (ws / ".env").write_text("TOKEN=1")
    (ws / "notes").symlink_to(".env")
    (ws / "docs").mkdir()
    (ws / "docs" / "up").symlink_to("..")
    with pytest.raises(PolicyDenied, match="secret-file rule"):
        jail.read("notes")
    with pytest.raises(PolicyDenied, match="secret-file rule"):
        jail.read("docs/up/notes")
    with pytest.raises(PolicyDenied):
        jail.write("notes", b"TOKEN=2")
    assert jail.kind("notes") == "symlink"  # the link itself: its name is innocent and it is not followed
    with pytest.raises(PolicyDenied):
        jail.stat("notes")  # stat refuses a final link, whatever its target
    assert (ws / ".env").read_text() == "TOKEN=1"


def test_innocent_folders_behind_symlinks_still_work(jail: Jail, ws: Path) -> None:
    """Invariant: judging real paths refuses only secret ones: a link to an ordinary folder
    inside the workspace reads, writes, lists and stats as before (no false refusals).
    """
    (ws / "real").mkdir()
    (ws / "alias").symlink_to("real")
    (ws / "via").symlink_to("alias/../real")
    jail.write("alias/f.txt", b"one")
    jail.write("via/new/g.txt", b"two", create_parents=True)
    assert (ws / "real" / "f.txt").read_bytes() == b"one"
    assert (ws / "real" / "new" / "g.txt").read_bytes() == b"two"
    assert jail.read("via/f.txt").data == b"one"
    assert [entry.name for entry in jail.list_dir("alias")] == ["f.txt", "new"]
    assert jail.stat("alias/f.txt").st_size == 3
    assert jail.kind("alias/new") == "dir"
    os.close(jail.open_dir_fd("via/new"))


def test_a_jail_without_secret_patterns_never_reads_proc(ws: Path) -> None:
    """Invariant: the real-path check is skipped when there is nothing to judge (the organizer's
    jail), so it costs nothing there; a secret-looking name is then just a name."""
    (ws / ".ssh").mkdir()
    (ws / "keys").symlink_to(".ssh")
    with Jail(ws, secret_patterns=()) as plain:
        plain.write("keys/x", b"x")
        assert [entry.name for entry in plain.list_dir("keys")] == ["x"]


@pytest.mark.parametrize("venv", ["/etc", "/nonexistent-bastion-dir", "../../../../../../etc"])
def test_kind_answers_the_same_whether_a_host_path_exists(jail: Jail, ws: Path, venv: str) -> None:
    """Invariant: a link leaving the workspace is PathEscape with the same reason whether its host
    target exists or not (no oracle on the host's tree); a final link is reported, not followed.
    """
    (ws / ".venv").symlink_to(venv)
    with pytest.raises(PathEscape) as info:
        jail.kind(".venv/bin/python")
    assert info.value.reason == (
        "'.venv/bin/python' goes through a symbolic link that leaves the workspace, loops or is a /proc link: "
        "use a path inside the workspace"
    )


@pytest.mark.parametrize("target", ["/usr/bin/python3", "/nonexistent-bastion/python"])
def test_kind_reports_a_final_link_without_following_it(jail: Jail, ws: Path, target: str) -> None:
    """Invariant: ``kind`` of a final link is 'symlink' whatever its target; missing is None."""
    (ws / ".venv" / "bin").mkdir(parents=True)
    (ws / ".venv" / "bin" / "python").symlink_to(target)
    assert jail.kind(".venv/bin/python") == "symlink"
    assert jail.kind(".venv/bin/pip") is None
    with pytest.raises(PathEscape):
        jail.kind(".venv/bin/python/x")  # an absolute link is never followed as a parent


def test_read_with_a_margin_returns_the_bytes_around_the_range(jail: Jail, ws: Path) -> None:
    """Invariant: ``margin`` adds context on each side, read in the same open; ``data``, ``eof``
    and ``size`` are those of the range asked for, and the margin stops at the file's ends."""
    (ws / "f.txt").write_bytes(b"0123456789")
    middle = jail.read("f.txt", offset=4, length=2, margin=3)
    assert (middle.before, middle.data, middle.after, middle.eof) == (b"123", b"45", b"678", False)
    edge = jail.read("f.txt", offset=1, length=20, margin=3)
    assert (edge.before, edge.data, edge.after, edge.eof, edge.size) == (b"0", b"123456789", b"", True, 10)
    past = jail.read("f.txt", offset=12, length=2, margin=4)
    assert (past.before, past.data, past.after, past.eof) == (b"89", b"", b"", True)
    with pytest.raises(InvalidRequest):
        jail.read("f.txt", margin=-1)


def _rename_race(ws: Path, attempt: object, deadline_s: float = 60.0) -> tuple[set[str], int]:
    """Call `attempt(i)` while a thread renames ``.ssh`` <-> ``x``; the names it wrote, and how
    many attempts the secret-file rule refused (polled until some were, within `deadline_s`)."""
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for src, dst in ((".ssh", "x"), ("x", ".ssh")):
                with contextlib.suppress(OSError):
                    os.rename(ws / src, ws / dst)

    flipper = threading.Thread(target=flip)
    flipper.start()
    written: set[str] = set()
    denied = 0
    end = time.monotonic() + deadline_s
    try:
        i = 0
        while (denied < 3 or i < 2000) and time.monotonic() < end:
            try:
                written.add(attempt(i))  # type: ignore[operator]
            except PolicyDenied:
                denied += 1
            except NotFound:
                pass
            i += 1
    finally:
        stop.set()
        flipper.join()
    return written, denied


def _flipped_folder(ws: Path) -> Path:
    return ws / ".ssh" if (ws / ".ssh").exists() else ws / "x"


def test_rename_race_refused_write_leaves_no_file_in_the_secret_folder(jail: Jail, ws: Path) -> None:
    """Invariant: while a process renames ``.ssh`` <-> ``x`` in a loop, a write_file to ``x/<new name>``
    that the secret-file rule refuses (the folder was ``.ssh`` when the created file was judged) leaves
    nothing behind: the folder holds exactly the files of the writes that succeeded, each whole. Before,
    O_CREAT had made an empty file in ``.ssh`` first. Does not prove anything about writes that succeed
    while the folder is named ``x``: the rule matches names at the moment of the check (module docstring)."""
    (ws / ".ssh").mkdir()

    def attempt(i: int) -> str:
        jail.write(f"x/f{i}", b"data")
        return f"f{i}"

    written, denied = _rename_race(ws, attempt)
    assert denied > 0, "the race never reached the check: nothing was tested"
    folder = _flipped_folder(ws)
    assert {p.name for p in folder.iterdir()} == written
    assert all((folder / name).read_bytes() == b"data" for name in written)


def _swap_after_mkdir(monkeypatch: pytest.MonkeyPatch, replace: Callable[[str, int], None]) -> None:
    """Make the jail's next mkdir be raced: right after the real one, `replace(name, dir_fd)` runs, as a local
    user who can write the parent would do with renameat2(RENAME_EXCHANGE) before the jail's next step."""
    real_mkdir = os.mkdir

    def raced(name: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(name, mode, dir_fd=dir_fd)
        monkeypatch.setattr(os, "mkdir", real_mkdir)
        assert dir_fd is not None
        replace(name, dir_fd)

    monkeypatch.setattr(os, "mkdir", raced)


@pytest.mark.root
def test_a_hard_link_swapped_in_for_a_new_folder_is_not_chowned(
    ws: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: between the jail's mkdir of a missing parent and its chown, the new folder is renamed away and
    a hard link to a file elsewhere on the filesystem (root's /etc/shadow, say) takes its name. A chown by
    name gave that file to the workspace's owner; through the fd opened as a folder, nothing is chowned."""
    victim = outside / "shadow"
    victim.write_text("root:HASH:")
    os.chown(victim, 4242, 4242)
    victim.chmod(0o640)

    def hard_link(name: str, dir_fd: int) -> None:
        os.rename(name, "moved-away", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.link(victim, name, dst_dir_fd=dir_fd)

    with Jail(ws, owner=(1000, 1000)) as jail:
        _swap_after_mkdir(monkeypatch, hard_link)
        with pytest.raises(BastionError):
            jail.write("made/notes.txt", b"x", create_parents=True)
    info = victim.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (4242, 4242, 0o640)
    assert victim.read_text() == "root:HASH:"
    assert not (ws / "moved-away" / "notes.txt").exists()


@pytest.mark.root
def test_a_foreign_folder_swapped_in_for_a_new_folder_is_not_chowned(
    ws: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: the same race with a folder someone else owns: it is refused as a concurrent change, not given to
    the workspace's owner."""
    foreign = ws / "foreign"
    foreign.mkdir()
    os.chown(foreign, 4242, 4242)

    def folder(name: str, dir_fd: int) -> None:
        os.rename(name, "moved-away", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.rename("foreign", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    with Jail(ws, owner=(1000, 1000)) as jail:
        _swap_after_mkdir(monkeypatch, folder)
        with pytest.raises(Conflict, match="replaced while it was made"):
            jail.write("made/notes.txt", b"x", create_parents=True)
    assert (ws / "made").stat().st_uid == 4242
    assert not (ws / "made" / "notes.txt").exists()


@pytest.mark.root
def test_folders_made_for_a_write_belong_to_the_workspace_owner(ws: Path) -> None:
    with Jail(ws, owner=(1000, 1001)) as jail:
        jail.write("a/b/notes.txt", b"x", create_parents=True)
    for made in (ws / "a", ws / "a" / "b", ws / "a" / "b" / "notes.txt"):
        assert (made.stat().st_uid, made.stat().st_gid) == (1000, 1001)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user is a root server's")
def test_a_root_jail_acting_as_the_folder_owner_cannot_do_what_the_owner_could_not(ws: Path) -> None:
    """Attack: in a folder shared by several users, a root server's file tools read another user's 0600 file,
    overwrote a file made read-only, and wrote into another user's folder, all of which the workspace's commands
    (acting as the folder's owner) are refused. Acting as the owner, the kernel refuses the same."""
    os.chown(ws, 12345, 12346)
    (ws / "bob.txt").write_text("bob's notes")
    os.chown(ws / "bob.txt", 4242, 4242)
    (ws / "bob.txt").chmod(0o600)
    (ws / "frozen.txt").write_text("keep")
    os.chown(ws / "frozen.txt", 12345, 12346)
    (ws / "frozen.txt").chmod(0o444)
    (ws / "bobs").mkdir()
    os.chown(ws / "bobs", 4242, 4242)
    with Jail(ws, owner=(12345, 12346), act_as_owner=True) as jail:
        with pytest.raises(OperationFailed, match="refused access"):
            jail.read("bob.txt")
        with pytest.raises(OperationFailed, match="refused access"):
            jail.write("frozen.txt", b"changed")
        with pytest.raises(OperationFailed, match="refused access"):
            jail.write("bobs/new.txt", b"x")
        with pytest.raises(OperationFailed, match="refused access"):
            jail.replace("frozen.txt", b"changed", version=jail.read("frozen.txt").version)
        jail.write("mine/new.txt", b"mine", create_parents=True)
        assert jail.read("mine/new.txt").data == b"mine"
        jail.replace("mine/new.txt", b"edited", version=jail.read("mine/new.txt").version)
    assert (ws / "mine" / "new.txt").read_text() == "edited"
    assert (ws / "frozen.txt").read_text() == "keep"
    assert not (ws / "bobs" / "new.txt").exists()
    for made in (ws / "mine", ws / "mine" / "new.txt"):
        assert (made.stat().st_uid, made.stat().st_gid) == (12345, 12346)
    _assert_thread_is_the_servers()
    assert (ws / "bob.txt").read_text() == "bob's notes"  # this thread is root again: its own checks are back


def _thread_ids() -> dict[str, list[str]]:
    fields = dict(line.split(":\t", 1) for line in Path("/proc/thread-self/status").read_text().splitlines())
    return {name: fields[name].split() for name in ("Uid", "Gid", "Groups")}


def _assert_thread_is_the_servers() -> None:
    ids = _thread_ids()
    assert (ids["Uid"], ids["Gid"]) == (["0"] * 4, ["0"] * 4)  # real, effective, saved, filesystem
    assert ids["Groups"] == [str(group) for group in os.getgroups()]
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE: as before the switch


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user is a root server's")
def test_acting_as_the_owner_drops_the_servers_groups_and_keeps_a_setgid_folders(ws: Path) -> None:
    """Attack: the switch kept root's supplementary groups, so a root:root 0640 file in the owner's folder
    was readable though commands (run with no supplementary group) are refused it; and a file made in a
    setgid folder was chowned to the owner's primary group instead of the folder's."""
    os.chown(ws, 12345, 12346)
    (ws / "root-group.txt").write_text("root group only")
    (ws / "root-group.txt").chmod(0o640)
    os.setgroups([0, 4242])
    try:
        shared = ws / "shared"
        shared.mkdir()
        os.chown(shared, 12345, 4242)
        shared.chmod(0o2775)
        with Jail(ws, owner=(12345, 12346), act_as_owner=True) as jail:
            with pytest.raises(OperationFailed, match="refused access"):
                jail.read("root-group.txt")
            jail.write("shared/made.txt", b"x")
            jail.write("shared/sub/made.txt", b"x", create_parents=True)
        for made in (shared / "made.txt", shared / "sub", shared / "sub" / "made.txt"):
            assert (made.stat().st_uid, made.stat().st_gid) == (12345, 4242), made
        _assert_thread_is_the_servers()
    finally:
        os.setgroups([0])


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user is a root server's")
def test_a_signal_cutting_the_restore_leaves_the_thread_as_the_server_and_is_raised(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: a jail operation runs on the event loop's thread, where a signal's handler can raise
    (KeyboardInterrupt) between two calls of the restore; the thread stayed as the user, and the server's
    later work (removing state folders, the audit log) ran as them. The restore runs again, then the
    interruption goes on."""
    os.chown(ws, 12345, 12346)
    real = paths_module._restore_server_identity
    calls = []

    def interrupted(groups: list[int], capabilities: tuple[int, int] | None) -> None:
        calls.append(groups)
        if len(calls) == 1:
            paths_module._libc.setfsuid(os.geteuid())  # cut after its first call
            raise KeyboardInterrupt
        real(groups, capabilities)

    monkeypatch.setattr(paths_module, "_restore_server_identity", interrupted)
    with Jail(ws, owner=(12345, 12346), act_as_owner=True) as jail, pytest.raises(KeyboardInterrupt):
        jail.write("notes.txt", b"x")
    assert len(calls) == 2
    _assert_thread_is_the_servers()
    assert (ws / "notes.txt").stat().st_uid == 12345


def _folder(path: Path, owner: tuple[int, int], mode: int) -> Path:
    path.mkdir(exist_ok=True)
    os.chown(path, *owner)
    path.chmod(mode)
    return path


@pytest.mark.root
def test_who_can_replace_a_folder_by_renaming_another_into_its_path(tmp_path: Path) -> None:
    """Attack: whoever can write a folder on the way can rename any folder it holds into the configured name,
    a root-owned one included, and a root server then served it as root. `replaceable_by` names them: the
    owner of a folder on the way (with or without its write bit: they can chmod), a writing group with members
    other than root and the folder's owner (gid 4242 is named by no group here: who is in it cannot be told),
    everyone, and users or groups an ACL lets write, which the mode bits do not show."""
    alice, bob = (12345, 12346), (4242, 4242)
    home = _folder(tmp_path / "alice", alice, 0o755)
    assert replaceable_by(str(_folder(home / "code", alice, 0o755)), alice) is None
    assert "uid 12345" in str(replaceable_by(str(_folder(home / "root-data", (0, 0), 0o700)), (0, 0)))
    read_only = _folder(tmp_path / "bobs-read-only", bob, 0o555)
    assert "uid 4242" in str(replaceable_by(str(read_only / "ws"), alice))
    shared = _folder(tmp_path / "shared", (0, 4242), 0o2775)
    assert "group 4242" in str(replaceable_by(str(_folder(shared / "ws", (12345, 4242), 0o755)), (12345, 4242)))
    root_group = _folder(tmp_path / "root-group", (0, 0), 0o775)
    assert replaceable_by(str(_folder(root_group / "ws", alice, 0o755)), alice) is None
    open_to_all = _folder(tmp_path / "open", (0, 0), 0o777)
    assert "any user" in str(replaceable_by(str(_folder(open_to_all / "ws", alice, 0o755)), alice))
    sticky = _folder(tmp_path / "sticky", (0, 0), 0o1777)
    assert replaceable_by(str(_folder(sticky / "mine", alice, 0o755)), alice) is None
    assert "uid 4242" in str(replaceable_by(str(_folder(sticky / "bobs", bob, 0o755)), alice))
    acl = _folder(tmp_path / "acl", (0, 0), 0o755)
    entries = [
        (0x01, 7, 0xFFFFFFFF),
        (0x02, 7, 4242),
        (0x04, 5, 0xFFFFFFFF),
        (0x10, 7, 0xFFFFFFFF),
        (0x20, 5, 0xFFFFFFFF),
    ]
    os.setxattr(
        acl, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    )
    assert "uid 4242 (an ACL entry)" in str(replaceable_by(str(_folder(acl / "ws", alice, 0o755)), alice))


def _secret(path: Path, owner: tuple[int, int], mode: int) -> Path:
    path.write_text("key material")
    os.chown(path, *owner)
    path.chmod(mode)
    return path


@pytest.fixture
def open_folder() -> Iterator[Path]:
    with passable_folder() as folder:
        yield folder


@pytest.mark.root
def test_a_secret_file_others_may_read_or_swap_is_named(open_folder: Path) -> None:
    """Attack (a root server's private keys): a key others may read lets them act as the server (a gateway
    key runs the production host's actions with no approval); one they may swap, by its mode, its folder or a
    link on its way, chooses the key. `secret_file_problem` names who, as ssh refuses such a key."""
    tmp_path = open_folder
    root, bob = (0, 0), (4242, 4242)
    safe = _folder(tmp_path / "etc-bastion", root, 0o755)
    assert secret_file_problem(str(_secret(safe / "ok", root, 0o600)), root) is None
    assert "any user: they may read" in str(secret_file_problem(str(_secret(safe / "o", root, 0o604)), root))
    assert "group 100" in str(secret_file_problem(str(_secret(safe / "g", (0, 100), 0o640)), root))
    assert "any user: they may write" in str(secret_file_problem(str(_secret(safe / "w", root, 0o602)), root))
    assert "uid 4242, who owns" in str(secret_file_problem(str(_secret(safe / "b", bob, 0o600)), root))
    bobs = _folder(tmp_path / "bobs", bob, 0o755)
    assert "uid 4242, who owns" in str(secret_file_problem(str(_secret(bobs / "k", root, 0o600)), root))
    # A link in a root folder to a root file (/etc/letsencrypt/live/NAME/privkey.pem): fine.
    archive = _folder(tmp_path / "archive", root, 0o700)
    _secret(archive / "privkey1.pem", root, 0o600)
    live = _folder(tmp_path / "live", root, 0o755)
    (live / "privkey.pem").symlink_to("../archive/privkey1.pem")
    assert secret_file_problem(str(live / "privkey.pem"), root) is None
    # The same link kept in a folder bob may write, or leading through bob's folder: he could repoint it.
    shared = _folder(tmp_path / "shared", (0, 0), 0o777)
    (shared / "key.pem").symlink_to(archive / "privkey1.pem")
    assert "any user: they may write" in str(secret_file_problem(str(shared / "key.pem"), root))
    (live / "via-bob").symlink_to(bobs / "k")
    assert "uid 4242, who owns" in str(secret_file_problem(str(live / "via-bob"), root))
    acl = _secret(safe / "acl", root, 0o600)
    entries = [
        (0x01, 6, 0xFFFFFFFF),
        (0x02, 4, 4242),
        (0x04, 0, 0xFFFFFFFF),
        (0x10, 4, 0xFFFFFFFF),
        (0x20, 0, 0xFFFFFFFF),
    ]
    os.setxattr(
        acl, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    )
    assert "uid 4242 (an ACL entry): they may read" in str(secret_file_problem(str(acl), root))
    with pytest.raises(FileNotFoundError):
        secret_file_problem(str(safe / "missing"), root)


@pytest.mark.root
def test_a_key_readable_by_mode_in_a_folder_no_one_else_may_pass_is_not_refused(open_folder: Path) -> None:
    """Found by review: certbot's older keys are 0644 in its 0700 archive/ folder, which no one else may pass,
    and were refused as "any user may read"; Debian's 0640 root:ssl-cert key in /etc/ssl/private (0710
    root:ssl-cert) is readable by the group's members and is still named."""
    root = (0, 0)
    archive = _folder(open_folder / "archive", root, 0o700)
    assert secret_file_problem(str(_secret(archive / "privkey3.pem", root, 0o644)), root) is None
    private = _folder(open_folder / "private", (0, 100), 0o710)
    assert "group 100" in str(secret_file_problem(str(_secret(private / "shared.key", (0, 100), 0o640)), root))
    assert "any user" in str(secret_file_problem(str(_secret(private / "open.key", root, 0o604)), root))


@pytest.mark.root
def test_a_public_file_others_may_swap_is_named_but_not_one_they_may_only_read(open_folder: Path) -> None:
    """Attack (what a root server trusts but need not hide: a TLS certificate, a microVM's kernel, a venv's
    python): another user who may write the file, owns it, or could replace it through a folder or a link on
    its way chooses what runs or is presented. `file_replaceable_by` names them as `secret_file_problem` does,
    and lets everyone read; `folder_changeable_by` also names who may add entries to a sticky folder."""
    root, bob = (0, 0), (4242, 4242)
    safe = _folder(open_folder / "etc", root, 0o755)
    assert file_replaceable_by(str(_secret(safe / "cert.pem", root, 0o644)), root) is None
    assert "any user: they may write" in str(file_replaceable_by(str(_secret(safe / "w", root, 0o646)), root))
    assert "uid 4242, who owns" in str(file_replaceable_by(str(_secret(safe / "b", bob, 0o644)), root))
    bobs = _folder(open_folder / "bobs", bob, 0o755)
    assert "uid 4242, who owns" in str(file_replaceable_by(str(_secret(bobs / "c", root, 0o644)), root))
    (safe / "via-bob").symlink_to(bobs / "c")
    assert "uid 4242, who owns" in str(file_replaceable_by(str(safe / "via-bob"), root))
    os.mkfifo(safe / "fifo")
    assert "is not a regular file" in str(file_replaceable_by(str(safe / "fifo"), root))
    with pytest.raises(FileNotFoundError):
        file_replaceable_by(str(safe / "missing"), root)
    sticky = _folder(open_folder / "sticky", root, 0o1777)
    assert folder_replaceable_by(str(sticky), root) is None  # nobody can rename it away
    assert "any user: they may write" in str(folder_changeable_by(str(sticky), root))  # but may add names
    assert folder_changeable_by(str(safe), root) is None
    assert "uid 4242, who owns" in str(folder_changeable_by(str(bobs / "missing"), root))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user is a root server's")
def test_an_edit_that_cannot_keep_a_files_group_never_gives_its_rights_to_another(ws: Path) -> None:
    """Attack (found by review): acting as the owner, with no supplementary group, edit_file's new file could not
    be given the old one's group (the owner is not in it here), and got the old mode anyway: `secrets.env`,
    alice:team 0640 in alice's folder, became alice:alice 0640, readable by another group. The group's rights
    go with the group now."""
    os.chown(ws, 12345, 12346)
    secret = ws / "secrets.env"
    secret.write_text("TOKEN=1")
    os.chown(secret, 12345, 4242)
    secret.chmod(0o660)
    with Jail(ws, owner=(12345, 12346), act_as_owner=True) as jail:
        jail.replace("secrets.env", b"TOKEN=2", version=jail.read("secrets.env").version)
    info = secret.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (12345, 12346, 0o600)
    assert secret.read_text() == "TOKEN=2"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user is a root server's")
def test_a_switch_inside_a_switch_neither_switches_nor_restores(ws: Path) -> None:
    """Found by review: a leased operation calling another captured the outer switch's empty groups as the
    server's, and its restore made the thread root halfway through the outer operation. Inside a switch, the same
    ids do nothing and other ids are refused; the outer switch alone restores."""
    with paths_module.acting_as(12345, 12346):
        with paths_module.acting_as(12345, 12346):
            pass
        assert _thread_ids()["Uid"][3] == "12345"  # still acting: the inner one did not restore
        with pytest.raises(Unavailable, match="already acting"), paths_module.acting_as(4242, 4242):
            pass
        assert _thread_ids()["Groups"] == []
    _assert_thread_is_the_servers()


def test_a_file_really_named_deleted_is_not_read_as_another(jail: Jail, ws: Path) -> None:
    """Attack (found by review): the kernel names an unlinked file's fd with a ' (deleted)' suffix, and it was
    stripped from every real path: `notes.txt (deleted)` resolved to `notes.txt`, and edit_file read and wrote
    that other file. The suffix is dropped only for a file that has no name left."""
    (ws / "notes.txt").write_text("the real notes")
    (ws / "notes.txt (deleted)").write_text("the decoy")
    assert jail.real_path("notes.txt (deleted)") == "notes.txt (deleted)"
    assert jail.read("notes.txt (deleted)").data == b"the decoy"


@pytest.mark.root
def test_an_acl_mask_limits_its_named_entries(tmp_path: Path) -> None:
    """Found by review: a named entry's write was counted though the ACL's mask takes it away (what the mode's
    group bits show): an administrator's `chmod g-w` did not clear the refusal."""
    alice = (12345, 12346)

    def acl(folder: Path, entries: list[tuple[int, int, int]], version: int = 2) -> None:
        raw = struct.pack("<I", version) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
        os.setxattr(folder, "system.posix_acl_access", raw)

    masked = _folder(tmp_path / "masked", (0, 0), 0o755)
    acl(
        masked,
        [(0x01, 7, 0xFFFFFFFF), (0x02, 7, 4242), (0x04, 5, 0xFFFFFFFF), (0x10, 5, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)],
    )
    assert replaceable_by(str(_folder(masked / "ws", alice, 0o755)), alice) is None  # the mask takes the write away


def test_a_server_killed_while_it_writes_an_edit_leaves_no_file_in_the_folder(jail: Jail, ws: Path) -> None:
    """Found by attack: edit_file's new content went to `.bastion-edit-*.tmp` beside the file, and a server
    killed during its write or sync left that file (with the edit's content) in the user's folder for good.
    The new file is nameless until whole; here the kill lands at its sync."""
    (ws / "notes.txt").write_text("hello world\n")
    version = jail.read("notes.txt").version
    pid = os.fork()
    if pid == 0:
        try:
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
            jail.replace("notes.txt", b"goodbye world\n", version=version)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status  # killed mid-edit, as the attack did
    assert sorted(path.name for path in ws.iterdir()) == ["notes.txt"]
    assert (ws / "notes.txt").read_text() == "hello world\n"
    jail.replace("notes.txt", b"goodbye world\n", version=version)  # the next edit is whole
    assert (ws / "notes.txt").read_text() == "goodbye world\n"
    assert sorted(path.name for path in ws.iterdir()) == ["notes.txt"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server acting as the folder's owner")
@pytest.mark.parametrize(
    ("ids", "mode"),
    [((12345, 777), 0o664), ((23456, 23456), 0o666)],
    ids=["a-shared-group", "another-users-file"],
)
def test_write_over_a_file_the_owner_cannot_give_its_ids_keeps_them_and_its_mode(
    tmp_path: Path, ids: tuple[int, int], mode: int
) -> None:
    """Found by review of the atomic write (a new file renamed over the old): acting as the owner, the new file
    could not take a shared group's id (the thread has no supplementary group, no CAP_CHOWN), and the group lost
    the file and its rights (0664 became 0604); another user's writable file became the owner's. Invariant: such
    a file is written in place, keeping its owner, group and mode; an own file is still replaced whole."""
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, 12345, 12345)
    target, own = ws / "site.conf", ws / "mine.txt"
    for path, (uid, gid), bits in ((target, ids, mode), (own, (12345, 12345), 0o640)):
        path.write_text("old\n")
        os.chown(path, uid, gid)
        path.chmod(bits)
    inode = own.stat().st_ino
    with Jail(str(ws), owner=(12345, 12345), act_as_owner=True) as jail:
        jail.write("site.conf", b"new\n")
        jail.write("mine.txt", b"new\n")
    info = target.stat()
    assert target.read_bytes() == b"new\n"
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (*ids, mode)
    mine = own.stat()
    assert (mine.st_uid, mine.st_gid, stat.S_IMODE(mine.st_mode), own.read_text()) == (12345, 12345, 0o640, "new\n")
    assert mine.st_ino != inode  # replaced whole
