"""Host identities: the range's parsing and start-time check, and who gets which id."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.app import build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError, ResourceLimit, Unavailable
from bastion.sandbox.identity import (
    DEFAULT_HOST_ID_FIRST,
    IdentityPool,
    parse_range,
    range_conflict,
    unreachable_folder,
)
from tests.helpers import demo_config_at


def test_default_range_is_above_systemds_container_ranges_and_free_here() -> None:
    first, count = parse_range(f"{DEFAULT_HOST_ID_FIRST}:65536")
    assert first > 0x6FFFFFFF
    assert first + count - 1 < 0x7FFE0000  # systemd's "foreign" range starts there
    assert range_conflict(first, count) is None


@pytest.mark.parametrize(
    "text", ["", "5", "100000", "a:b", "100000:", ":5", "-1:5", "100000:0", "0:70000", "65535:10", "4294967290:10"]
)
def test_range_that_reaches_real_accounts_or_is_malformed_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="host_id_range"):
        parse_range(text)


@given(st.integers(min_value=65_536, max_value=0xFFFFFFFE), st.integers(min_value=1, max_value=1 << 24))
def test_parse_accepts_exactly_the_ranges_inside_the_unprivileged_ids(first: int, count: int) -> None:
    text = f"{first}:{count}"
    if first + count - 1 <= 0xFFFFFFFE:
        assert parse_range(text) == (first, count)
    else:
        with pytest.raises(ValueError, match="host_id_range"):
            parse_range(text)


def test_an_account_or_a_subordinate_range_inside_the_range_is_named(tmp_path: Path) -> None:
    passwd, subuid = tmp_path / "passwd", tmp_path / "subuid"
    passwd.write_text("root:x:0:0::/root:/bin/sh\nweird:x:200005:200005::/:/bin/sh\n")
    subuid.write_text("alice:300000:65536\n")
    files = {"account_files": [str(passwd)], "subordinate_files": [str(subuid)]}
    assert "'weird' with id 200005" in (range_conflict(200_000, 10, **files) or "")
    assert range_conflict(200_006, 10, **files) is None
    assert "'alice' 300000:65536" in (range_conflict(365_535, 5, **files) or "")  # overlaps its last id
    assert range_conflict(365_536, 5, **files) is None
    assert range_conflict(200_000, 10, account_files=[str(tmp_path / "missing")], subordinate_files=[]) is None


def test_each_live_sandbox_gets_its_own_id_and_a_released_one_comes_back_last(tmp_path: Path) -> None:
    pool = IdentityPool(100_000, 3, server_uid=0, server_gid=0, lock_dir=tmp_path / "ids")
    first, second, third = pool.acquire(), pool.acquire(), pool.acquire()
    assert [i.uid for i in (first, second, third)] == [100_000, 100_001, 100_002]
    assert all(i.uid == i.gid and i.switch for i in (first, second, third))
    with pytest.raises(ResourceLimit, match="all 3 ids"):
        pool.acquire()
    pool.release(second)
    assert pool.acquire().uid == 100_001
    pool.release(first)
    pool.release(third)
    assert [pool.acquire().uid, pool.acquire().uid] == [100_002, 100_000]
    pool.close()
    assert not (tmp_path / "ids").exists()


def test_two_servers_sharing_a_range_never_hand_out_one_id_at_once(tmp_path: Path) -> None:
    """Invariant: ids are held across processes (an flock per id), so a second server with the same
    range skips the ids the first one holds, gets them once released, and a holder that ends (a
    crash closes its fds) frees them."""
    locks = tmp_path / "ids"
    one = IdentityPool(100_000, 4, server_uid=0, server_gid=0, lock_dir=locks)
    two = IdentityPool(100_000, 4, server_uid=0, server_gid=0, lock_dir=locks)
    first, second = one.acquire(), one.acquire()
    assert [two.acquire().uid, two.acquire().uid] == [100_002, 100_003]
    with pytest.raises(ResourceLimit):
        two.acquire()
    one.release(first)
    assert two.acquire().uid == 100_000
    for fd in one._held.values():  # as a crash leaves them: files in place, locks gone with the fds
        os.close(fd)
    assert two.acquire().uid == 100_001
    assert second.uid == 100_001
    two.close()
    assert not locks.exists()


def test_a_crashed_servers_lock_files_do_not_keep_the_lock_folder_for_good(tmp_path: Path) -> None:
    """Found after a full run left /run/bastion-ids holding one file: a server killed while it held an id
    leaves the id's file (the kernel drops the lock, not the file), and the next server, taking other ids,
    could not remove the folder at close. Invariant: a closing server removes the files no live server
    holds, and never a held one."""
    locks = tmp_path / "ids"
    crashed = IdentityPool(100_000, 8, server_uid=0, server_gid=0, lock_dir=locks)
    for _ in range(6):
        crashed.acquire()
    for fd in crashed._held.values():  # as a kill -9 leaves them: files in place, locks gone with the fds
        os.close(fd)
    live = IdentityPool(100_000, 8, server_uid=0, server_gid=0, lock_dir=locks)
    held = live.acquire()
    assert held.uid == 100_000  # a crashed server's id is free again
    closing = IdentityPool(100_000, 8, server_uid=0, server_gid=0, lock_dir=locks)
    closing.acquire()
    closing.close()
    assert sorted(os.listdir(locks)) == ["100000"]  # the live server's file stays, the stale ones went
    blocked = os.open(locks / "100000", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(blocked, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and stays locked
    finally:
        os.close(blocked)
    live.close()
    assert not locks.exists()


def test_an_unprivileged_server_is_itself_every_sandboxs_identity() -> None:
    pool = IdentityPool(100_000, 3, server_uid=1234, server_gid=1235)
    identities = [pool.acquire() for _ in range(5)]  # no range used up: the one user is every identity
    assert {(i.uid, i.gid, i.switch) for i in identities} == {(1234, 1235, False)}
    assert not pool.switches
    assert pool.in_use() == 0


def test_unreachable_folder_names_the_first_closed_one(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    assert unreachable_folder(closed / "inner" / "state") == closed
    closed.chmod(0o711)
    assert unreachable_folder(closed / "inner" / "state") is None


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server hands out ids of the range")
def test_root_server_refuses_to_start_when_the_sandboxes_ids_cannot_reach_the_state_folder(tmp_path: Path) -> None:
    """Invariant: a state folder under a folder closed to others (0700) stops the start with one line
    naming that folder, instead of every sandbox failing later with bubblewrap's 'Permission denied'."""
    config = load_config(demo_config_at(tmp_path / "demo"))
    (tmp_path / "demo").chmod(0o700)
    with pytest.raises(ConfigError, match=r"demo cannot be passed through by the sandboxes' ids \(no o\+x\)"):
        build_services(config)
    assert not config.state_dir.exists() or not any(config.sandboxes_dir.glob("sb-*"))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server hands out ids of the range")
def test_root_server_refuses_a_range_smaller_than_what_it_may_run_at_once(tmp_path: Path) -> None:
    """Invariant: the range holds an id for every sandbox, pooled sandbox and host workspace that can
    live at once, so a full server refuses at start rather than failing create_sandbox later."""
    path = demo_config_at(tmp_path / "demo")
    text = path.read_text().replace("[sandboxes]\n", '[sandboxes]\nhost_id_range = "1879048192:10"\n', 1)
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"host_id_range has 10 ids, fewer than .* \(18\): widen it"):
        build_services(load_config(path))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server hands out ids of the range")
def test_root_server_refuses_a_template_folder_its_sandboxes_ids_cannot_reach(tmp_path: Path) -> None:
    """Invariant: a template's read-only folder that the sandboxes' own ids cannot pass through
    stops the start with one line naming it, instead of every create_sandbox of that template
    failing later with bubblewrap's 'Permission denied'."""
    private = tmp_path / "private"
    (private / "docs").mkdir(parents=True)
    private.chmod(0o700)
    path = demo_config_at(tmp_path / "demo")
    path.write_text(
        path.read_text()
        + f'\n[[template]]\nname = "docs"\n[[template.read_only]]\nsource = "{private / "docs"}"\ndest = "/docs"\n'
    )
    with pytest.raises(ConfigError, match=r"template 'docs': .*private cannot be passed through"):
        build_services(load_config(path))


class _VanishingFolder(type(Path())):  # type: ignore[misc]
    """A lock folder that another server, closing as the last one, removes right after each mkdir."""

    removals = 2

    def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        super().mkdir(mode, parents, exist_ok)
        if _VanishingFolder.removals:
            _VanishingFolder.removals -= 1
            self.rmdir()


def test_lock_folder_removed_by_another_server_closing_between_mkdir_and_open(tmp_path: Path) -> None:
    """Race: server B makes the lock folder, then server A, closing as the last holder, removes it (it
    was empty) before B creates its lock file. Invariant: B makes the folder again and takes its id,
    instead of failing to start with a traceback; the id is locked (a second pool cannot take it)."""
    _VanishingFolder.removals = 2
    locks = _VanishingFolder(tmp_path / "ids")
    pool = IdentityPool(100_000, 1, server_uid=0, server_gid=0, lock_dir=locks)
    identity = pool.acquire()
    assert identity.uid == 100_000
    assert _VanishingFolder.removals == 0
    other = IdentityPool(100_000, 1, server_uid=0, server_gid=0, lock_dir=tmp_path / "ids")
    with pytest.raises(ResourceLimit):
        other.acquire()
    pool.close()


def test_lock_folder_removed_and_remade_by_other_servers_all_along_never_fails_a_start(tmp_path: Path) -> None:
    """Race, found by a parallel test run: another server's close removed the lock folder between this
    server's mkdir (which found it there) and its check that it was a folder, and the start failed with a
    FileExistsError traceback. Here a second process removes and remakes the folder without pause while
    this server takes and gives back ids. Invariant: every take gives an id or a typed Unavailable (after
    the retries), never another exception, and every id taken is locked."""
    folder = tmp_path / "ids"
    script = (
        "import os, sys\n"
        "path, stop = sys.argv[1], sys.argv[2]\n"
        "while not os.path.exists(stop):\n"
        "    try:\n"
        "        os.rmdir(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        "        os.mkdir(path)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    stop = tmp_path / "stop"
    remover = subprocess.Popen([sys.executable, "-c", script, str(folder), str(stop)])
    pool = IdentityPool(100_000, 1, server_uid=0, server_gid=0, lock_dir=folder)
    taken = refused = 0
    try:
        for _ in range(3000):
            try:
                identity = pool.acquire()
            except Unavailable:
                refused += 1
                continue
            taken += 1
            fd = os.open(folder / str(identity.uid), os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            pool.release(identity)
    finally:
        stop.touch()
        remover.wait(10)
    assert taken > 0, f"no id was taken in 3000 tries ({refused} refused)"


def test_lock_folder_removed_every_time_gives_a_typed_refusal_not_a_traceback(tmp_path: Path) -> None:
    """Race, past the retries: the folder is removed after every mkdir. Invariant: acquire says so as
    Unavailable (a one-line answer), never a raw FileNotFoundError."""
    _VanishingFolder.removals = 100
    pool = IdentityPool(100_000, 1, server_uid=0, server_gid=0, lock_dir=_VanishingFolder(tmp_path / "ids"))
    with pytest.raises(Unavailable, match="removed 4 times"):
        pool.acquire()
    _VanishingFolder.removals = 0
