"""The sandboxes' own mount namespaces (`_mountns`): what is mounted there never reaches the host.

Real namespaces and tmpfs mounts, made by the server's namespace thread; root only.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import Unavailable
from bastion.sandbox._disk import mount_tmpfs
from bastion.sandbox._idmap import unmount
from bastion.sandbox._mountns import MountNamespaces
from tests.helpers import mounts_under

pytestmark = [pytest.mark.root]


@pytest.fixture
def namespaces() -> Iterator[MountNamespaces]:
    if os.geteuid() != 0:
        pytest.skip("mount namespaces of the server's own need root")
    made = MountNamespaces()
    yield made
    made.close()


def _tmpfs(at: Path) -> None:
    mount_tmpfs(at, 1 << 20, 64, 0o700)


def _namespace_of_the_thread(namespaces: MountNamespaces) -> str:
    return namespaces._submit(lambda: os.readlink("/proc/thread-self/ns/mnt"))


def test_a_mount_in_a_sandbox_namespace_never_reaches_the_host(namespaces: MountNamespaces, tmp_path: Path) -> None:
    """Invariant: the host's table never holds it and the host sees the bare folder; a process
    started in the namespace sees the mount; once closed, the namespace cannot be entered."""
    point = tmp_path / "scratch"
    point.mkdir()
    namespace = namespaces.make(lambda: _tmpfs(point))
    try:
        assert mounts_under(tmp_path) == []
        namespace.run(lambda: (point / "note").write_text("inside\n"))
        assert not (point / "note").exists()
        seen = namespace.run(lambda: subprocess.run(["cat", str(point / "note")], capture_output=True, check=True))
        assert seen.stdout == b"inside\n"
        assert _namespace_of_the_thread(namespaces) == os.readlink("/proc/self/ns/mnt")
    finally:
        namespace.close()
    with pytest.raises(Unavailable, match="closed"):
        namespace.run(lambda: None)
    assert mounts_under(tmp_path) == []


def test_a_namespace_mount_under_a_shared_host_mount_does_not_propagate(
    namespaces: MountNamespaces, tmp_path: Path
) -> None:
    """A systemd host makes its mounts shared: a copied namespace keeps the peer groups, and a mount
    made under one would appear on the host too. Invariant: the namespace is made private first."""
    shared = tmp_path / "shared"
    (shared / "scratch").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True)
        namespace = namespaces.make(lambda: _tmpfs(shared / "scratch"))
        try:
            assert mounts_under(shared) == [str(shared)]
            assert not os.path.ismount(shared / "scratch")
        finally:
            namespace.close()
    finally:
        unmount(shared)
    assert mounts_under(tmp_path) == []


def test_a_mount_the_host_makes_later_under_a_shared_mount_reaches_the_namespace(
    namespaces: MountNamespaces, tmp_path: Path
) -> None:
    """The namespace is a slave of the host's, not private: what the host mounts or unmounts later
    under a shared mount reaches it (a sleeping sandbox's next start sees the host as it is)."""
    shared = tmp_path / "shared"
    (shared / "later").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True)
        namespace = namespaces.make(lambda: None)
        try:
            _tmpfs(shared / "later")
            (shared / "later" / "note").write_text("host\n")
            assert namespace.run(lambda: (shared / "later" / "note").read_text()) == "host\n"
            unmount(shared / "later")
            assert not namespace.run(lambda: os.path.ismount(shared / "later"))
        finally:
            namespace.close()
    finally:
        unmount(shared)
    assert mounts_under(tmp_path) == []


def test_the_thread_goes_back_to_the_hosts_namespace_after_a_failure(
    namespaces: MountNamespaces, tmp_path: Path
) -> None:
    """Invariant: a task that fails in a sandbox's namespace, or a namespace whose mounts fail, leaves
    the thread in the host's namespace, where the next task starts; nothing is left mounted."""
    host = os.readlink("/proc/self/ns/mnt")
    point = tmp_path / "scratch"
    point.mkdir()
    namespace = namespaces.make(lambda: _tmpfs(point))
    try:

        def fail() -> None:
            raise OSError(5, "injected")

        with pytest.raises(OSError, match="injected"):
            namespace.run(fail)
        assert _namespace_of_the_thread(namespaces) == host
        with pytest.raises(Unavailable, match="cannot mount a tmpfs"):
            namespaces.make(lambda: _tmpfs(tmp_path / "missing"))
        assert _namespace_of_the_thread(namespaces) == host
    finally:
        namespace.close()
    assert mounts_under(tmp_path) == []
